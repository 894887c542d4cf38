"""GGUF files served in their own block formats (vLLM's ``--quantization gguf``).

Every matrix of the file stays in its ggml blocks (``qweight``, uint8, and ``qweight_type``,
as vLLM names them), rearranged once at load into the layout the kernel streams
(``fd_gguf_pack``: tiles of 16 columns, the same bytes for the 4- and 8-bit 32-element
formats), and is multiplied from them by ``csrc/cpu/gguf_gemm.cc``: activations quantized
per 32 elements to int8, integer dot products, fp32 accumulation. The token embedding
dequantizes only the rows it looks up, and a tied LM head multiplies with the embedding's
own blocks (no second copy of the table).

Supported types: :data:`GGUF_KERNEL_TYPES`. A matrix of any other type (F16 included) is
refused at start-up, naming the tensor (:func:`check_tensor_types`); a GGUF file is served in
its blocks by default, ``--quantization none`` dequantizes it at load instead.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy import _custom_ops as ops
from fastdeploy.logger import init_logger
from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.fused_moe.layer import FusedMoE, FusedMoEMethodBase
from fastdeploy.model_executor.layers.linear import KernelWeight, LinearBase, LinearMethodBase
from fastdeploy.model_executor.layers.quantization import register_quantization_config
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from fastdeploy.model_executor.utils import new_parameter
from fastdeploy.transformers_utils.gguf_utils import GGUFBlocks

if TYPE_CHECKING:
    from fastdeploy.model_executor.layers.vocab_embedding import VocabParallelEmbedding

logger = init_logger(__name__)

# ggml type id -> name, for the types the block kernels multiply.
GGUF_KERNEL_TYPES = {8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# The platform's kernel path names (OpBackend.gguf) -> the op's isa argument.
KERNEL_PATHS = {"scalar": 0, "avx2": 1, "avx512-vnni": 2, "amx-int8": 3}


def check_blocks(loaded: Any, where: str, shape: tuple[int, int]) -> GGUFBlocks:
    """``loaded`` as GGUF blocks the kernels take, of HF shape ``shape``; a ValueError naming what is wrong."""
    if not isinstance(loaded, GGUFBlocks):
        raise ValueError(
            f"quantization='gguf' serves tensors of a GGUF file in their blocks; {where} got a dense "
            f"{type(loaded).__name__} (load a GGUF file, or drop --quantization gguf)."
        )
    if loaded.ggml_type not in GGUF_KERNEL_TYPES:
        raise ValueError(
            f"GGUF tensor {loaded.name!r} has type {loaded.type_name}, which quantization='gguf' has no kernel for; "
            f"supported: {', '.join(GGUF_KERNEL_TYPES.values())}. Serve the file with --quantization none "
            "to dequantize it at load instead."
        )
    if tuple(loaded.shape) != tuple(shape):
        raise ValueError(f"Shape mismatch loading {where}: checkpoint has {loaded.shape}, model expects {shape}.")
    return loaded


def check_tensor_types(path: str) -> None:
    """Refuse, from the file's header alone, a GGUF file with a matrix of a type the kernels do not multiply.

    Raises:
        ValueError: naming each such tensor with its type, and the supported types.
    """
    from fastdeploy.model_executor.model_loader.weight_utils import gguf_experts_name, gguf_router_name, gguf_to_hf_name
    from fastdeploy.transformers_utils.gguf_utils import ggml_type_name, read_gguf_tensor_infos

    # The loader keeps the matrices of the model (2-D, with a Hugging Face name) and the stacked MoE
    # experts (3-D) as blocks, the MoE routers (F32 in every llama.cpp file) aside.
    bad = [f"{info.name!r} ({ggml_type_name(info.ggml_type)})" for info in read_gguf_tensor_infos(path)
           if info.ggml_type not in GGUF_KERNEL_TYPES and (hf := gguf_to_hf_name(info.name))
           and (len(info.dims) == 2 and not gguf_router_name(hf) or len(info.dims) == 3 and gguf_experts_name(hf))]
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise ValueError(
            f"GGUF tensor {shown} of {os.path.basename(path)} has a type that quantization='gguf' has no kernel "
            f"for; supported: {', '.join(GGUF_KERNEL_TYPES.values())}. Serve the file with --quantization none "
            "to dequantize it at load instead."
        )


def random_blocks(ggml_type: int, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Synthetic GGUF weights ``[rows, bytes per row]`` for kernel tests and benchmarks.

    Random quants (every byte pattern is a valid block) with fp16 scales and mins of a
    plausible size (~0.01): gguf-py cannot quantize the K-quants, and timings do not depend
    on the values.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(ggml_type)
    elems, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // elems, size), dtype=np.uint8)
    # Byte offsets of the fp16 scale (and min) fields in a block.
    fp16_fields = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q4_1": [0, 2], "Q5_1": [0, 2]}
    for offset in fp16_fields.get(qtype.name, [0]):
        value = (rng.standard_normal((rows, k // elems)) * 0.01).astype(np.float16)
        raw[:, :, offset : offset + 2] = value.view(np.uint8).reshape(rows, k // elems, 2)
    return raw.reshape(rows, -1)


def dequantize_rows(qweight: paddle.Tensor, ggml_type: int, rows: int, dim: int) -> paddle.Tensor:
    """All ``rows`` rows of a packed block table as fp32 ``[rows, dim]`` (inspection and export, not the forward)."""
    return ops.gguf_embedding(paddle.arange(rows, dtype="int64"), qweight, ggml_type, rows, dim)


def pack_blocks(data: np.ndarray, ggml_type: int, rows: int, k: int) -> paddle.Tensor:
    """``rows`` rows of GGUF blocks (``k`` elements each) in the kernels' packed layout (``fd_gguf_pack``)."""
    return ops.gguf_pack(paddle.to_tensor(np.ascontiguousarray(data).reshape(-1)), [ggml_type, rows], k)


@register_quantization_config("gguf")
class GGUFConfig(QuantizationConfig):
    """``--quantization gguf``: a GGUF file's matrices kept in their blocks, multiplied by the block kernels.

    The kernel path ("amx-int8", "avx512-vnni", "avx2", "scalar") is the platform's choice (``FD_CPU_GGUF_KERNEL``).

    Raises:
        RuntimeError: the block kernels are not built here (the reason is logged by the kernel loader).
    """

    def __init__(self) -> None:
        path = get_op_backend().gguf
        if path not in KERNEL_PATHS:
            raise RuntimeError(
                "quantization='gguf' needs the C++ block kernels (csrc/cpu/gguf_gemm.cc), which are not available "
                "here (FD_CPU_KERNELS=0, or the kernels did not build: see the warning above)."
            )
        self.kernel_path = path
        self.isa = KERNEL_PATHS[path]
        # Linear layers (by prefix) the loader gives dense weights, not blocks (vLLM's name): e.g. the
        # kv_b_proj a deepseek2 file splits into 3-D attn_k_b / attn_v_b. Set by the model loader.
        self.unquantized_modules: list[str] = []

    supports_moe = True

    def __repr__(self) -> str:
        return f"GGUFConfig(kernel_path={self.kernel_path!r})"

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        return cls()

    @classmethod
    def check_model(cls, model_config: Any) -> None:
        if not getattr(model_config, "gguf_file", None):
            raise ValueError(
                f"quantization='gguf' needs a GGUF file, and {model_config.model!r} is not one; "
                "give the path of a .gguf file (or drop --quantization)."
            )
        check_tensor_types(os.path.join(model_config.model_path, model_config.gguf_file))

    def get_quant_method(self, layer: nn.Layer, prefix: str) -> QuantizeMethodBase | None:
        from fastdeploy.model_executor.layers.vocab_embedding import VocabParallelEmbedding

        if isinstance(layer, VocabParallelEmbedding):
            return GGUFEmbeddingMethod()
        if isinstance(layer, FusedMoE):
            return GGUFFusedMoEMethod(self.isa)
        if isinstance(layer, LinearBase):
            return None if prefix in self.unquantized_modules else GGUFLinearMethod(self.isa)
        return None


class GGUFLinearMethod(LinearMethodBase):
    """A linear layer's weight kept as GGUF blocks; the forward is ``fd_gguf_linear``.

    The checkpoint's tensor (or each shard of a fused layer) arrives through
    :meth:`weight_loader` as :class:`GGUFBlocks`; :meth:`process_weights_after_loading`
    packs the shards' rows into one ``qweight`` with its ``(type, rows)`` segments, so
    shards of different types (Q4_K q/k with a Q6_K v, as ``Q4_K_M`` files have) run in
    one call.

    Args:
        isa: the kernel path's id (:data:`KERNEL_PATHS`).
    """

    def __init__(self, isa: int) -> None:
        self.isa = isa

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool, dtype: str) -> None:
        # An empty placeholder the model's loader finds by name; the blocks replace it.
        layer.weight = new_parameter([0], dtype)
        layer.bias = new_parameter([output_size], dtype) if bias else None
        object.__setattr__(layer, "_gguf_shards", {})

    def weight_loader(self, layer: LinearBase, param: paddle.Tensor, loaded: Any, shard_id: object = None) -> bool:
        if param is not layer.weight or param is None:
            return False
        start, size = (0, layer.output_size) if shard_id is None else layer.shard_offsets[shard_id]
        where = f"{type(layer).__name__}" + ("" if shard_id is None else f"[{shard_id}]")
        layer._gguf_shards[start] = check_blocks(loaded, where, (size, layer.input_size))
        return True

    def tie_weights(self, layer: LinearBase, embedding: VocabParallelEmbedding) -> None:
        """Multiply with the embedding's own blocks (tied word embeddings): no copy of the table."""
        qweight, ggml_type, rows, dim = embedding._gguf_args
        if dim != layer.input_size or rows != layer.output_size:
            raise ValueError(f"Cannot tie the LM head ({layer.input_size} -> {layer.output_size}) to an embedding "
                             f"of {rows} x {dim}.")
        self._finish(layer, qweight, [ggml_type, layer.output_size], [0])

    def _finish(self, layer: LinearBase, qweight: paddle.Tensor, segments: list[int], offsets: list[int]) -> None:
        layer.register_buffer("qweight", qweight, persistable=True)
        # (type, rows) pairs; vLLM's qweight_type is the type of each.
        object.__setattr__(layer, "qweight_type", segments[0::2])
        object.__setattr__(layer, "_gguf_args", (qweight, layer.bias, segments, self.isa))
        object.__setattr__(layer, "_gguf_offsets", offsets)  # each segment's first byte in qweight
        object.__setattr__(layer, "_gguf_shards", {})
        layer.weight = None

    def process_weights_after_loading(self, layer: LinearBase, dtype: str) -> bool:
        """Concatenate the loaded shards' blocks once; True: the layer computes whatever ``dtype`` is."""
        if getattr(layer, "_gguf_args", None) is not None:
            return True
        shards = [layer._gguf_shards[start] for start in sorted(layer._gguf_shards)]
        if sum(s.shape[0] for s in shards) != layer.output_size:
            raise ValueError(f"{type(layer).__name__}: GGUF shards cover {sum(s.shape[0] for s in shards)} of "
                             f"{layer.output_size} output rows.")
        groups: list[list[GGUFBlocks]] = []
        for s in shards:  # consecutive shards of one type are one segment
            if groups and groups[-1][0].ggml_type == s.ggml_type:
                groups[-1].append(s)
            else:
                groups.append([s])
        segments, parts, offsets, offset = [], [], [], 0
        for group in groups:
            rows = sum(s.shape[0] for s in group)
            data = np.concatenate([np.ascontiguousarray(s.data).reshape(-1) for s in group])
            parts.append(pack_blocks(data, group[0].ggml_type, rows, layer.input_size))
            segments += [group[0].ggml_type, rows]
            offsets.append(offset)
            offset += parts[-1].shape[0]
        self._finish(layer, parts[0] if len(parts) == 1 else paddle.concat(parts), segments, offsets)
        return True

    def apply(self, layer: LinearBase, x: paddle.Tensor) -> paddle.Tensor:
        return ops.gguf_linear(x, *layer._gguf_args)

    def kernel_weight(self, layer: LinearBase) -> KernelWeight | None:
        args = getattr(layer, "_gguf_args", None)
        if args is None:
            return None
        qweight, bias, segments, isa = args
        return KernelWeight(qweight, bias, "gguf", segments, isa)

    def dense_weight(self, layer: LinearBase) -> paddle.Tensor:
        qweight, _, segments, _ = layer._gguf_args
        ends = [*layer._gguf_offsets[1:], qweight.shape[0]]
        parts = [
            dequantize_rows(qweight[begin:end], ggml_type, rows, layer.input_size)
            for ggml_type, rows, begin, end in zip(segments[0::2], segments[1::2], layer._gguf_offsets, ends,
                                                   strict=True)
        ]
        return paddle.concat(parts, axis=0).T


class GGUFFusedMoEMethod(FusedMoEMethodBase):
    """MoE experts kept in their GGUF blocks; the forward is ``fd_gguf_fused_moe``.

    The loader yields each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` rows of the file's
    stacked ``ffn_*_exps`` tensors as :class:`GGUFBlocks` (shards ``(e, "w1" | "w3" | "w2")``);
    :meth:`process_weights_after_loading` packs each expert's gate and up rows as two segments of
    one ``[2I, H]`` matrix and its down rows as ``[H, I]``, one row of ``w13_qweight`` /
    ``w2_qweight [E, bytes]`` per expert. The types are the file's (gate, up and down may differ,
    as in ``Q4_K_M`` files).

    Args:
        isa: the kernel path's id (:data:`KERNEL_PATHS`).
    """

    shared_expert_dtypes = ops.SHARED_EXPERT_DTYPES

    def __init__(self, isa: int) -> None:
        self.isa = isa

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_size: int,
                       dtype: str) -> None:
        # Placeholders the model's loader finds by name; the blocks replace them.
        layer.w13_weight = new_parameter([0], dtype)
        layer.w2_weight = new_parameter([0], dtype)
        object.__setattr__(layer, "_gguf_shards", {})

    def weight_loader(self, layer: FusedMoE, param: paddle.Tensor, loaded: Any, shard_id: object) -> bool:
        if shard_id is None:
            raise ValueError(f"quantization='gguf' loads MoE experts one by one; {type(loaded).__name__} came for "
                             "a whole stacked tensor.")
        expert, shard = shard_id
        if not 0 <= expert < layer.num_experts or shard not in ("w1", "w3", "w2"):
            raise ValueError(f"FusedMoE: shard {shard_id!r} does not fit {layer.num_experts} experts.")
        h, inter = layer.hidden_size, layer.intermediate_size
        shape = (h, inter) if shard == "w2" else (inter, h)
        layer._gguf_shards[shard_id] = check_blocks(loaded, f"FusedMoE[{expert}, {shard}]", shape)
        return True

    def process_weights_after_loading(self, layer: FusedMoE, dtype: str) -> bool:
        """Pack every expert's blocks once; True: the experts compute whatever ``dtype`` is."""
        if getattr(layer, "_gguf_moe_args", None) is not None:
            return True
        shards = layer._gguf_shards
        missing = [(e, n) for e in range(layer.num_experts) for n in ("w1", "w3", "w2") if (e, n) not in shards]
        if missing:
            raise ValueError(f"FusedMoE: GGUF expert shards {missing[:4]} were not loaded.")
        packed: dict[str, tuple[paddle.Tensor, list[int]]] = {}
        sizes: dict[str, list[int]] = {}  # each segment's packed bytes, for dense_weights
        for name, parts in (("w13", ("w1", "w3")), ("w2", ("w2",))):
            experts, segments = [], None
            for e in range(layer.num_experts):
                blocks = [shards[(e, p)] for p in parts]
                these = [v for b in blocks for v in (b.ggml_type, b.shape[0])]
                if segments is not None and these != segments:
                    raise ValueError(f"FusedMoE: GGUF expert {e} has types {these[0::2]}, expert 0 {segments[0::2]}.")
                segments = these
                # One segment per shard, packed one after the other (the layout of fd_gguf_pack over segments).
                pieces = [pack_blocks(b.data, b.ggml_type, *b.shape) for b in blocks]
                sizes[name] = [int(t.shape[0]) for t in pieces]
                experts.append(paddle.concat(pieces))
            packed[name] = (paddle.stack(experts), segments)
            layer.register_buffer(f"{name}_qweight", packed[name][0], persistable=True)
        (w13, seg13), (w2, seg2) = packed["w13"], packed["w2"]
        object.__setattr__(layer, "_gguf_moe_args", (w13, w2, seg13, seg2, self.isa))
        object.__setattr__(layer, "_gguf_moe_sizes", sizes)
        object.__setattr__(layer, "_gguf_shards", {})
        layer.w13_weight = None
        layer.w2_weight = None
        return True

    def apply(self, layer: FusedMoE, x: paddle.Tensor, topk_weights: paddle.Tensor, topk_ids: paddle.Tensor,
              shared: ops.SharedExperts | None = None, shared_weights: paddle.Tensor | None = None) -> paddle.Tensor:
        return ops.gguf_fused_moe(x, topk_ids, topk_weights, *layer._gguf_moe_args, shared, shared_weights)

    def dense_weights(self, layer: FusedMoE) -> tuple[paddle.Tensor, paddle.Tensor]:
        w13, w2, seg13, seg2, _ = layer._gguf_moe_args
        h, inter = layer.hidden_size, layer.intermediate_size

        def dense(packed: paddle.Tensor, segments: list[int], sizes: list[int], k: int) -> paddle.Tensor:
            experts = []
            for e in range(packed.shape[0]):
                parts, begin = [], 0
                for ggml_type, rows, size in zip(segments[0::2], segments[1::2], sizes, strict=True):
                    parts.append(dequantize_rows(packed[e, begin : begin + size], ggml_type, rows, k))
                    begin += size
                experts.append(paddle.concat(parts, axis=0))
            return paddle.stack(experts)

        sizes = layer._gguf_moe_sizes
        return dense(w13, seg13, sizes["w13"], h), dense(w2, seg2, sizes["w2"], inter)


class GGUFEmbeddingMethod(QuantizeMethodBase):
    """A token embedding kept as (packed) GGUF blocks: each step dequantizes only the rows it looks up
    (``fd_gguf_embedding``)."""

    def create_weights(self, layer: VocabParallelEmbedding, num_embeddings: int, embedding_dim: int,
                       dtype: str) -> None:
        layer.weight = new_parameter([0], dtype)  # the placeholder the loader finds; the blocks replace it

    def weight_loader(self, layer: VocabParallelEmbedding, param: paddle.Tensor, loaded: Any,
                      shard_id: object = None) -> bool:
        rows = layer.num_embeddings_per_partition
        blocks = check_blocks(loaded, type(layer).__name__, (rows, layer.embedding_dim))
        # Packed as the LM head's kernel reads it, so a tied head multiplies with this very table.
        qweight = pack_blocks(blocks.data, blocks.ggml_type, rows, layer.embedding_dim)
        layer.register_buffer("qweight", qweight, persistable=True)
        object.__setattr__(layer, "qweight_type", blocks.ggml_type)
        object.__setattr__(layer, "_gguf_args", (qweight, blocks.ggml_type, rows, layer.embedding_dim))
        layer.weight = None
        return True

    def apply(self, layer: VocabParallelEmbedding, input_ids: paddle.Tensor) -> paddle.Tensor:
        return ops.gguf_embedding(input_ids, *layer._gguf_args)

    def dense_weight(self, layer: VocabParallelEmbedding) -> paddle.Tensor:
        qweight, ggml_type, rows, dim = layer._gguf_args
        return dequantize_rows(qweight, ggml_type, rows, dim)
