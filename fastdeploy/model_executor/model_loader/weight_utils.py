"""Iterate the tensors of a checkpoint as ``(Hugging Face name, numpy array in HF layout)``.

Formats: safetensors (single file or sharded, bf16 included: numpy has no bf16, so it
is widened to fp32 here), PyTorch ``.bin`` (needs torch), and GGUF (dequantized with
the ``gguf`` package, tensor names mapped to Hugging Face's).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from fastdeploy.logger import init_logger

if TYPE_CHECKING:
    from fastdeploy.transformers_utils.gguf_utils import GGUFBlocks

logger = init_logger(__name__)

_ST_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "?",
}


def _progress(total: int, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit="tensor", mininterval=1.0, dynamic_ncols=True)


# ---------------------------------------------------------------------------- safetensors


def safetensors_files(folder: str) -> list[str]:
    """The safetensors files of a model folder: the shards named by the index, else every ``*.safetensors``."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def _safetensors_header(path: str) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


# safetensors' fp8 dtypes -> the format names of --quantization fp8.
FP8_DTYPES = {"F8_E4M3": "e4m3", "F8_E5M2": "e5m2"}


class Float8Tensor:
    """An fp8 safetensors tensor kept as its bytes (``raw``, uint8): numpy has no fp8.

    Only the fp8 linear method reads it (``raw``, ``fmt``); anything else that asks for its values
    is refused, because the bytes mean nothing without the tensor's scales.
    """

    def __init__(self, raw: np.ndarray, fmt: str, name: str) -> None:
        self.raw, self.fmt, self.name = raw, fmt, name
        self.shape = raw.shape
        self.ndim = raw.ndim
        self.dtype = raw.dtype

    @property
    def T(self) -> Float8Tensor:  # noqa: N802 - numpy's name
        return Float8Tensor(self.raw.T, self.fmt, self.name)

    def __getitem__(self, index: Any) -> Float8Tensor:
        return Float8Tensor(self.raw[index], self.fmt, self.name)

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise ValueError(f"Tensor {self.name} is fp8 ({self.fmt}); only --quantization fp8 loads fp8 weights "
                         "(this layer or model is not quantized with it).")


def _decode(buf: np.ndarray, dtype: str, shape: list[int], name: str) -> np.ndarray | Float8Tensor:
    if dtype in FP8_DTYPES:
        return Float8Tensor(buf.view(np.uint8).reshape(shape), FP8_DTYPES[dtype], name)
    if dtype == "BF16":
        # bf16 is the top half of an fp32: widen exactly.
        return (buf.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if dtype not in _ST_DTYPES:
        raise ValueError(f"Tensor {name} has dtype {dtype}, which the safetensors loader does not support.")
    return buf.view(_ST_DTYPES[dtype]).reshape(shape)


class LazyBF16:
    """A bf16 safetensors tensor widened to fp32 only where it is read.

    Under tensor parallelism each rank slices its share first (``loaded[rows]``), so it widens
    (and reads from the memory map) only that slice; anything else sees the whole fp32 array
    (``np.asarray``, ``.T``, any other attribute).
    """

    def __init__(self, raw: np.ndarray) -> None:
        self.raw = raw  # uint16 view of the file, in the tensor's shape
        self.shape = raw.shape
        self.ndim = raw.ndim
        self.dtype = np.dtype(np.float32)

    @staticmethod
    def _widen(raw: np.ndarray) -> np.ndarray:
        return (raw.astype(np.uint32) << 16).view(np.float32)

    def __getitem__(self, index: Any) -> np.ndarray:
        return self._widen(self.raw[index])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self._widen(self.raw)
        return array if dtype is None else array.astype(dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # numpy probing for its array protocols: only __array__ is offered
            raise AttributeError(name)
        return getattr(np.asarray(self), name)


def safetensors_weights_iterator(files: list[str], lazy_bf16: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the files, read through a memory map (read-only arrays).

    ``lazy_bf16`` (tensor parallelism): bf16 tensors come as :class:`LazyBF16`, so a rank widens
    only the slice it keeps; fp32 tensors are memory-map views either way.
    """
    headers = [_safetensors_header(f) for f in files]
    total = sum(len(h) for _, h in headers)
    with _progress(total, "Loading safetensors weights") as bar:
        for path, (offset, header) in zip(files, headers, strict=True):
            data = np.memmap(path, dtype=np.uint8, mode="r", offset=offset)
            for name, info in header.items():
                start, end = info["data_offsets"]
                if lazy_bf16 and info["dtype"] == "BF16":
                    yield name, LazyBF16(data[start:end].view("<u2").reshape(info["shape"]))
                else:
                    yield name, _decode(data[start:end], info["dtype"], info["shape"], name)
                bar.update(1)
            del data


# ---------------------------------------------------------------------------- PyTorch .bin


def pt_files(folder: str) -> list[str]:
    """PyTorch checkpoint files: the shards named by the index, else ``*.bin`` / ``*.pt``."""
    index = os.path.join(folder, "pytorch_model.bin.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return [os.path.join(folder, s) for s in sorted(set(json.load(f)["weight_map"].values()))]
    files = sorted(glob.glob(os.path.join(folder, "*.bin")) + glob.glob(os.path.join(folder, "*.pt")))
    return [f for f in files if not os.path.basename(f).startswith("training_args")]


def pt_weights_iterator(files: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of PyTorch checkpoint files (torch is needed only for this format)."""
    try:
        import torch
    except ImportError as e:
        raise ValueError("Loading PyTorch .bin checkpoints needs torch; convert the model to safetensors.") from e
    for path in tqdm(files, desc="Loading pt checkpoint shards", unit="file"):
        state = torch.load(path, map_location="cpu", weights_only=True)
        for name, tensor in state.items():
            yield name, tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
        del state


# ---------------------------------------------------------------------------- GGUF

# llama.cpp tensor name (after "blk.N.") -> Hugging Face module name inside "model.layers.N."
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE (qwen2moe / qwen3moe): the router, the shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # Every expert's projection stacked [E, out, in]; the iterator yields them one expert at a time.
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    # Gate and up of every expert in one [E, 2 * ff, in] tensor (the converter's --fuse-gate-up-exps).
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    # deepseek2 (MLA): the q LoRA (or V2-Lite's attn_q), the latent projection and its norm, kv_b
    # (or, from current converters, its split k_b / v_b, merged back by the iterator).
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",  # as "exp_probs_b.bias"; see gguf_to_hf_name
}
# Where an architecture's Hugging Face names differ: DeepSeek's shared experts are "shared_experts".
_GGUF_ARCH_LAYER_NAMES = {
    "deepseek2": {
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
}
# MoE routers (GateLinear, never quantized): dequantized even with keep_blocks.
_FP32_ROUTER_SUFFIXES = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")
# Stacked expert tensors, split into Hugging Face's per-expert names.
_STACKED_EXPERTS_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj|gate_up_proj)\.weight$")
# deepseek2's kv_b split per head into k_b [H, kv_lora_rank, nope] (transposed) and v_b [H, v, kv_lora_rank].
_MLA_SPLIT_RE = re.compile(r"^(.*\.self_attn)\.(k_b_proj|v_b_proj)\.weight$")
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp derives for itself (e.g. llama3 rope factors); the HF config carries the same.
_GGUF_SKIPPED = {"rope_freqs", "rope_factors_long", "rope_factors_short"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
    """Hugging Face name of a llama.cpp tensor name (of GGUF architecture ``arch``), or None for tensors to skip.

    Raises:
        ValueError: a tensor this mapping does not know.
    """
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        base, suffix = name, ""
    if base in _GGUF_SKIPPED:
        return None
    tail = f".{suffix}" if suffix else ""
    if base in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[base] + tail
    m = _LAYER_RE.match(base)
    names = {**_GGUF_LAYER_NAMES, **_GGUF_ARCH_LAYER_NAMES.get(arch or "", {})}
    if m and m.group(2) in names:
        if m.group(2) == "exp_probs_b":
            tail = ""  # llama.cpp names the correction bias "exp_probs_b.bias"; HF has no suffix
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}{tail}"
    raise ValueError(f"GGUF tensor {name!r} has no known Hugging Face name (unsupported architecture?).")


def unpermute_llama_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for Llama.

    convert_hf_to_gguf reorders each head's rows from rotate-half order (all first
    halves, then all second halves) to interleaved pairs, for llama.cpp's interleaved
    RoPE. Our Llama uses rotate-half RoPE, so the rows go back: in GGUF, row
    ``h*D + 2*j + s`` holds HF row ``h*D + s*D/2 + j``.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weight.shape))


def merge_mla_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """Hugging Face's ``kv_b_proj.weight`` ``[H * (nope + v), kv_lora_rank]`` from llama.cpp's split halves.

    The deepseek2 converter views ``kv_b`` as ``[H, nope + v, kv_lora_rank]``, splits it into
    ``k_b`` (transposed to ``[H, kv_lora_rank, nope]``) and ``v_b`` ``[H, v, kv_lora_rank]``.
    """
    heads, rank = k_b.shape[0], k_b.shape[1]
    if v_b.shape[0] != heads or v_b.shape[2] != rank:
        raise ValueError(f"GGUF attn_k_b {k_b.shape} and attn_v_b {v_b.shape} do not fit together.")
    kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return np.ascontiguousarray(kv_b.reshape(-1, rank))


def _split_rows(expert: np.ndarray | GGUFBlocks) -> tuple:
    """One expert's fused ``[2 * ff, in]`` gate|up rows (fp32 or blocks) -> (gate rows, up rows)."""
    if isinstance(expert, np.ndarray):
        return tuple(np.split(expert, 2, axis=0))
    half = expert.shape[0] // 2
    return tuple(dataclasses.replace(expert, shape=(half, expert.shape[1]), data=part)
                 for part in (expert.data[:half], expert.data[half:]))


def gguf_router_name(hf_name: str) -> bool:
    """Whether ``hf_name`` is an MoE router's weight, dequantized even with ``keep_blocks`` (llama.cpp's
    converter and llama-quantize keep ``ffn_gate_inp`` in F32)."""
    return hf_name.endswith(_FP32_ROUTER_SUFFIXES)


def gguf_experts_name(hf_name: str) -> bool:
    """Whether ``hf_name`` is a stacked MoE experts tensor (``ffn_*_exps`` under its Hugging Face name)."""
    return _STACKED_EXPERTS_RE.match(hf_name) is not None


def gguf_dense_modules(path: str) -> list[str]:
    """Hugging Face names of the linear modules whose weights :func:`gguf_weights_iterator` yields dense
    even with ``keep_blocks``: the ``kv_b_proj`` rebuilt from a deepseek2 file's 3-D ``attn_k_b`` / ``attn_v_b``."""
    from fastdeploy.transformers_utils.gguf_utils import read_gguf_metadata, read_gguf_tensor_infos

    arch = read_gguf_metadata(path).get("general.architecture")
    names = (gguf_to_hf_name(info.name, arch) for info in read_gguf_tensor_infos(path))
    return sorted({f"{m.group(1)}.kv_b_proj" for n in names if n and (m := _MLA_SPLIT_RE.match(n))})


def gguf_weights_iterator(
    path: str, hf_config: Any, keep_blocks: bool = False
) -> Iterator[tuple[str, np.ndarray | GGUFBlocks]]:
    """The tensors of a GGUF file under Hugging Face names and layouts.

    Dequantized to fp32, or with ``keep_blocks`` (``--quantization gguf``) every matrix as its
    raw :class:`GGUFBlocks` whatever its type (the layer's method decides what it can serve);
    vectors (norms, biases) and MoE routers are dequantized either way. The stacked MoE experts
    (``ffn_*_exps``) are yielded one expert at a time under Hugging Face's per-expert names: blocks
    with ``keep_blocks``, else fp32.
    """
    from fastdeploy.transformers_utils.gguf_utils import (
        load_gguf_blocks,
        load_gguf_expert_blocks,
        load_gguf_tensor,
        read_gguf_metadata,
        read_gguf_tensor_infos,
    )

    arch = read_gguf_metadata(path).get("general.architecture")
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    infos = read_gguf_tensor_infos(path)

    def unpermute(hf_name: str, array: np.ndarray) -> np.ndarray:
        # The permutation moves whole rows, so it applies to rows of blocks as to rows of values.
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return unpermute_llama_qk(array, num_heads)
        if arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return unpermute_llama_qk(array, num_kv_heads)
        return array

    data = np.memmap(path, dtype=np.uint8, mode="r")
    mla_parts: dict[str, dict[str, np.ndarray]] = {}
    with _progress(len(infos), "Loading GGUF weights") as bar:
        for info in infos:
            hf_name = gguf_to_hf_name(info.name, arch)
            bar.update(1)
            if hf_name is None:
                continue
            stacked = _STACKED_EXPERTS_RE.match(hf_name)
            mla_split = _MLA_SPLIT_RE.match(hf_name)
            if mla_split is not None:
                # 3-D, so never kept in blocks: kv_b_proj is rebuilt dense from its two halves.
                halves = mla_parts.setdefault(mla_split.group(1), {})
                halves[mla_split.group(2)] = load_gguf_tensor(data, info)
                if len(halves) == 2:
                    del mla_parts[mla_split.group(1)]
                    yield f"{mla_split.group(1)}.kv_b_proj.weight", merge_mla_kv_b(halves["k_b_proj"],
                                                                                 halves["v_b_proj"])
            elif keep_blocks and len(info.dims) == 2 and not gguf_router_name(hf_name):
                blocks = load_gguf_blocks(data, info)
                yield hf_name, dataclasses.replace(blocks, data=unpermute(hf_name, blocks.data))
            elif stacked is not None:
                # One expert at a time: blocks for the MoE block kernels (keep_blocks), else fp32.
                if keep_blocks:
                    experts: list = load_gguf_expert_blocks(data, info)
                else:
                    experts = list(load_gguf_tensor(data, info))
                projs = [stacked.group(2)]
                if projs == ["gate_up_proj"]:  # [E, 2 * ff, in]: gate rows, then up rows
                    projs, per_proj = ["gate_proj", "up_proj"], [[], []]
                    for x in experts:
                        for half, part in zip(per_proj, _split_rows(x), strict=True):
                            half.append(part)
                else:
                    per_proj = [experts]
                for proj, stack in zip(projs, per_proj, strict=True):
                    for e, expert in enumerate(stack):
                        yield f"{stacked.group(1)}.{e}.{proj}.weight", expert
            elif hf_name.endswith("shared_expert_gate.weight"):
                yield hf_name, load_gguf_tensor(data, info).reshape(1, -1)  # llama.cpp keeps it as [H]
            else:
                yield hf_name, unpermute(hf_name, load_gguf_tensor(data, info))
    if mla_parts:
        raise ValueError(f"GGUF file {path} has attn_k_b without attn_v_b (or the reverse) in: {sorted(mla_parts)}.")
    del data
