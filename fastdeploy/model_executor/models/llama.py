"""Llama-style decoder-only models, shared by every architecture that differs only in options.

Qwen2, Qwen3 and ERNIE 4.5 (dense) subclass :class:`LlamaForCausalLM` and override
:meth:`LlamaForCausalLM.decoder_options`. With the C++ kernels a layer is nine ops:
fused residual-add + RMSNorm, the QKV matmul, (q/k norm +) RoPE + KV-cache write,
paged attention, the output projection, fused residual-add + RMSNorm, the gate/up
matmul, SiLU-and-multiply, the down projection; the matmuls run on weights packed once
after loading, in bf16 when the model dtype is bfloat16. Without the kernels the same
layers fall back to plain Paddle ops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy.logger import init_logger
from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.activation import SiluAndMul
from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata
from fastdeploy.model_executor.layers.attention.paged_attention import PagedAttention
from fastdeploy.model_executor.layers.layernorm import RMSNorm, rms_norm
from fastdeploy.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    process_linear_weights,
)
from fastdeploy.model_executor.layers.logits_processor import LogitsProcessor
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig
from fastdeploy.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope
from fastdeploy.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from fastdeploy.model_executor.models.fused_layers import FusedLayerArgs, FusedLayerRun, plan_runs
from fastdeploy.model_executor.utils import check_all_loaded, load_into, load_into_slice, new_parameter

logger = init_logger(__name__)


@dataclass(frozen=True)
class DecoderOptions:
    """What distinguishes the Llama-family architectures from each other."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    is_neox_style: bool = True  # False: interleaved (GPT-J) RoPE pairs (ERNIE 4.5)


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None, int]:
    """``(rope_theta, scaling dict or None, rotary_dim)`` from a transformers 4 or 5 config."""
    head_dim = get_head_dim(hf_config)
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        scaling = dict(params)
        base = float(scaling.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        factor = scaling.pop("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    else:
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
        base = float(getattr(hf_config, "rope_theta", 10000.0))
        factor = getattr(hf_config, "partial_rotary_factor", 1.0)
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = {}
    return base, scaling or None, int(head_dim * (factor or 1.0))


def get_head_dim(hf_config: Any) -> int:
    """Per-head dimension: ``head_dim`` when the config sets it, else hidden / heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class LlamaMLP(nn.Layer):
    """SwiGLU feed-forward with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias, dtype=dtype,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, dtype=dtype,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class QKNorm(nn.Layer):
    """Per-head RMSNorm of queries and keys stacked as ``[T, H + KVH, D]`` (Qwen3's q_norm / k_norm).

    The q and k weights are tiled into one ``[H + KVH, D]`` table at load time, so both
    norms take one normalization and one multiply.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, dtype: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.weight = new_parameter([num_heads + num_kv_heads, head_dim], dtype, fill=1.0)
        self.register_buffer("ones", paddle.ones([head_dim], dtype=dtype), persistable=False)
        self._paddle_fused = get_op_backend().paddle_fused_rms_norm

    shard_ids = ("q", "k")

    def forward(self, qk: paddle.Tensor) -> paddle.Tensor:
        return rms_norm(qk, self.ones, self.eps, fused=self._paddle_fused)[0] * self.weight

    def kernel_args(self) -> tuple[paddle.Tensor, float]:
        """(weight ``[H + KVH, D]``, eps) for the fused rope kernel, which normalizes each head itself."""
        return self.weight, self.eps

    def weight_loader(self, param: paddle.Tensor, loaded: np.ndarray, shard_id: object = None) -> None:
        """Load HF's ``q_norm.weight`` (shard "q") or ``k_norm.weight`` (shard "k"), each ``[D]``."""
        if shard_id == "q":
            load_into_slice(param, np.tile(loaded, (self.num_heads, 1)), 0, self.num_heads, 0, "q_norm")
        elif shard_id == "k":
            tiled = np.tile(loaded, (self.num_kv_heads, 1))
            load_into_slice(param, tiled, self.num_heads, self.num_kv_heads, 0, "k_norm")
        else:
            raise ValueError(f"QKNorm shard must be 'q' or 'k', got {shard_id!r}.")


class LlamaAttention(nn.Layer):
    """Self-attention: fused QKV projection, RoPE (+ optional q/k norm), paged attention, output projection."""

    def __init__(self, hf_config: Any, options: DecoderOptions, rotary_emb: RotaryEmbedding, dtype: str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        self.head_dim = get_head_dim(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, total_heads, total_kv_heads, bias=options.qkv_bias, dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        # This tensor-parallel rank's heads (all of them at one rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=options.o_bias, dtype=dtype,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.qk_norm = (
            QKNorm(self.num_heads, self.num_kv_heads, self.head_dim, hf_config.rms_norm_eps, dtype)
            if options.qk_norm
            else None
        )
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(
        self,
        positions: paddle.Tensor,
        hidden_states: paddle.Tensor,
        kv_cache: tuple[paddle.Tensor, paddle.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> paddle.Tensor:
        qkv = self.qkv_proj(hidden_states)
        out = self.attn.forward_qkv(qkv, positions, self.rotary_emb, kv_cache, attn_metadata, self.qk_norm)
        return self.o_proj(out)


def prenorm_layer_forward(layer: nn.Layer, positions: paddle.Tensor, hidden_states: paddle.Tensor,
                          residual: paddle.Tensor | None, kv_cache: Any, attn_metadata: Any
                          ) -> tuple[paddle.Tensor, paddle.Tensor]:
    """A pre-norm decoder layer op by op: norm, attention, residual-fused norm, MLP (Llama's shape,
    shared by the architectures whose layers have ``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm`` and ``mlp``)."""
    if residual is None:
        residual = hidden_states
        hidden_states = layer.input_layernorm(hidden_states)
    else:
        hidden_states, residual = layer.input_layernorm(hidden_states, residual)
    hidden_states = layer.self_attn(positions, hidden_states, kv_cache, attn_metadata)
    hidden_states, residual = layer.post_attention_layernorm(hidden_states, residual)
    return layer.mlp(hidden_states), residual


class LlamaDecoderLayer(nn.Layer):
    """Pre-norm decoder block; the residual stream is carried separately so norms fuse the add.

    Where the platform built the fused kernel and the matmul weights are packed,
    :class:`LlamaModel` runs the block in one kernel (``fd_decoder_layers``, the same kernels in
    the same order as the separate layers) together with the consecutive layers that can, which
    saves nine trips per layer through Paddle's custom-op dispatch.
    """

    def __init__(self, hf_config: Any, options: DecoderOptions, rotary_emb: RotaryEmbedding, dtype: str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", mlp: nn.Layer | None = None) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = LlamaAttention(hf_config, options, rotary_emb, dtype, quant_config, f"{prefix}.self_attn")
        # ``mlp``: another feed-forward (an MoE block) instead of the dense SwiGLU.
        self.mlp = mlp if mlp is not None else LlamaMLP(hidden, hf_config.intermediate_size, options.mlp_bias, dtype,
                                                        quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        down = getattr(self.mlp, "down_proj", None)  # an MoE block has none (and no fused kernel)
        self.intermediate_size = down.input_size if down is not None else hf_config.intermediate_size  # this rank's
        # The fused kernel runs a whole layer with no all-reduce inside: under tensor parallelism
        # the layer runs op by op (LlamaModel logs it once).
        self._fusable = (get_op_backend().decoder_layer and self.input_layernorm.uses_kernel
                         and self.self_attn.o_proj.tp_size == 1)

    # The fused kernel's arguments of this layer, set once the weights are packed
    # (process_weights_after_loading); None: the layer runs op by op. LlamaModel runs the layers
    # that have them in runs of one call each; called alone, a layer runs op by op.
    _fused_args: FusedLayerArgs | None = None
    op_by_op_reason = ""

    def process_weights_after_loading(self) -> None:
        """Switch to the fused kernel when the platform built it and every matmul of the layer is packed (or GGUF)."""
        built = self._build_fused_args()
        object.__setattr__(self, "_fused_args", None if isinstance(built, str) else built)
        object.__setattr__(self, "op_by_op_reason", built if isinstance(built, str) else "")

    def _build_fused_args(self) -> FusedLayerArgs | str:
        """The fused kernel's arguments, or why the layer runs op by op ("" where LlamaModel already said why)."""
        attn, mlp = self.self_attn, self.mlp
        if not self._fusable:
            return ""
        if not isinstance(mlp, LlamaMLP):
            return "the fused kernel computes the dense SwiGLU only, not this layer's MoE block"
        linears = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj, "gate_up_proj": mlp.gate_up_proj,
                   "down_proj": mlp.down_proj}
        weights = [m.quant_method.kernel_weight(m) for m in linears.values()]
        missing = [f"{name} ({type(m.quant_method).__name__})" for (name, m), w in zip(linears.items(), weights,
                                                                                      strict=True) if w is None]
        if missing:
            return f"no weights packed for the fused kernel: {', '.join(missing)}"
        if len({w.dtype for w in weights}) != 1:  # one compute dtype (or GGUF) for the whole layer
            return f"its matmuls compute in different dtypes ({', '.join(w.dtype for w in weights)})"
        qkv, o, gu, down = weights
        qk_norm_w, qk_eps = attn.qk_norm.kernel_args() if attn.qk_norm is not None else (None, 0.0)
        norm_in = self.input_layernorm
        settings = (attn.num_heads, self.intermediate_size, norm_in.variance_epsilon, qk_eps,
                    attn.rotary_emb.is_neox_style, attn.attn.scale, qkv.dtype)
        return FusedLayerArgs(norm_in.weight, qkv, qk_norm_w, attn.rotary_emb.kernel_cos_sin, o,
                              self.post_attention_layernorm.weight, gu, down, settings, qkv.gguf_isa,
                              attn.attn.impl.attn_isa)

    def forward(
        self,
        positions: paddle.Tensor,
        hidden_states: paddle.Tensor,
        residual: paddle.Tensor | None,
        kv_cache: tuple[paddle.Tensor, paddle.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        return prenorm_layer_forward(self, positions, hidden_states, residual, kv_cache, attn_metadata)


class LlamaModel(nn.Layer):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, hf_config: Any, options: DecoderOptions, dtype: str = "float32",
                 quant_config: QuantizationConfig | None = None, prefix: str = "model",
                 build_mlp: Callable[[int, str], nn.Layer | None] | None = None) -> None:
        super().__init__()
        self.config = hf_config
        base, scaling, rotary_dim = rope_settings(hf_config)
        self.rotary_emb = get_rope(
            get_head_dim(hf_config),
            hf_config.max_position_embeddings,
            base=base,
            rope_scaling=scaling,
            is_neox_style=options.is_neox_style,
            rotary_dim=rotary_dim,
            dtype=dtype,
        )
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, dtype,
                                                   quant_config, f"{prefix}.embed_tokens")
        self.layers = nn.LayerList([
            LlamaDecoderLayer(hf_config, options, self.rotary_emb, dtype, quant_config, f"{prefix}.layers.{i}",
                              build_mlp(i, f"{prefix}.layers.{i}.mlp") if build_mlp is not None else None)
            for i in range(hf_config.num_hidden_layers)
        ])
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)
        # Every layer op by op: the plan before loading, and of steps whose metadata the kernels cannot take.
        self._op_by_op: list[tuple[int, int, None]] = [(i, i + 1, None) for i in range(len(self.layers))]
        self._plan: list[tuple[int, int, FusedLayerRun | None]] = self._op_by_op
        if self.embed_tokens.tp_size > 1 and get_op_backend().decoder_layer:
            logger.info("Tensor parallel: the decoder layers run op by op (the fused layer kernel has no "
                        "all-reduce inside).")

    def forward(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> paddle.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches: {len(kv_caches)} for {len(self.layers)} layers")
        for start, stop, run in self._plan if attn_metadata.has_kernel_fields else self._op_by_op:
            if run is not None:
                hidden_states, residual = run(hidden_states, residual, positions, kv_caches[start:stop], attn_metadata)
            else:
                hidden_states, residual = self.layers[start](positions, hidden_states, residual, kv_caches[start],
                                                             attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def process_weights_after_loading(self) -> None:
        """Each layer's fused kernel arguments (its weights are packed by now), then the runs they make; the
        layers that run op by op instead are logged with the reason (one line per reason)."""
        reasons: dict[str, list[int]] = {}
        for i, layer in enumerate(self.layers):
            layer.process_weights_after_loading()
            reason = getattr(layer, "op_by_op_reason", "")  # other models' layer classes have no fused kernel
            if reason:
                reasons.setdefault(reason, []).append(i)
        for reason, layers in reasons.items():
            logger.info("Decoder layers %s of %d run op by op: %s.", _ranges(layers), len(self.layers), reason)
        self.plan_fused_runs()

    def plan_fused_runs(self) -> None:
        """Group the layers whose fused kernel arguments are set into runs of one op call each (after loading)."""
        self._plan = plan_runs([layer._fused_args for layer in self.layers])


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"`` (sorted input)."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


# HF projection name -> (fused parameter's module name, shard id).
_STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "q_norm": ("qk_norm", "q"),
    "k_norm": ("qk_norm", "k"),
}
# Checkpoint entries that are not weights of the model (buffers some exporters save).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaForCausalLM(nn.Layer):
    """Llama decoder with LM head.

    Interface shared by every model class:

    - ``forward(input_ids [T] int64, positions [T] int64, kv_caches, attn_metadata) -> [T, hidden]``
      (final norm applied); ``kv_caches`` holds one ``(k_cache, v_cache)`` per layer, each
      ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    - ``compute_logits(hidden_states [S, hidden]) -> [S, vocab]`` float32.
    - ``load_weights(iterable of (HF name, array in HF layout))``.
    - ``num_layers``, ``num_kv_heads``, ``head_dim`` and ``kv_cache_dtype`` for sizing the KV cache.
    - ``process_weights_after_loading(dtype)``: convert the loaded weights once for the compute dtype.
    """

    def __init__(self, hf_config: Any, dtype: str = "float32", quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype_name = dtype
        self.options = self.decoder_options(hf_config)
        self.model = LlamaModel(hf_config, self.options, dtype, quant_config,
                                build_mlp=lambda i, prefix: self.build_mlp(i, prefix, dtype, quant_config))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, bias=self.lm_head_bias(hf_config),
                                      dtype=dtype, quant_config=quant_config, prefix="lm_head")
        self.logits_processor = LogitsProcessor(hf_config.vocab_size)
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads if self.num_layers else 0
        self.head_dim = get_head_dim(hf_config)
        # The dtype the matmuls compute in and the KV cache's dtype, set by process_weights_after_loading.
        self.compute_dtype = "float32"
        self.kv_cache_dtype = "float32"

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        """Architecture switches read from the config; subclasses override this."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))

    @classmethod
    def lm_head_bias(cls, hf_config: Any) -> bool:
        """Whether the LM head has a bias (ERNIE 4.5 MoE's with ``use_bias``); subclasses override this."""
        return False

    def build_mlp(self, layer_idx: int, prefix: str, dtype: str,
                  quant_config: QuantizationConfig | None) -> nn.Layer | None:
        """The feed-forward of layer ``layer_idx`` when it is not the dense SwiGLU (MoE models), else None."""
        return None

    def forward(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> paddle.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def process_weights_after_loading(self, dtype: str) -> None:
        """Pack every matmul weight (projections and LM head) once for the linear kernel in ``dtype``.

        In bfloat16 the KV cache is bf16 too (half the memory and bandwidth; attention still
        computes in fp32). Without the kernels the weights stay fp32 for ``paddle.matmul``.

        Raises:
            RuntimeError: ``dtype`` is bfloat16 but the kernels are not available.
        """
        self.compute_dtype = process_linear_weights(self, dtype)
        self.model.process_weights_after_loading()
        self.kv_cache_dtype = "bfloat16" if self.compute_dtype == "bfloat16" else "float32"

    def compute_logits(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        """Logits ``[S, vocab]`` float32 of the hidden states of the positions being sampled."""
        return self.logits_processor(self.lm_head, hidden_states)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def _resolve(self, name: str) -> tuple[str, object] | None:
        """HF parameter name -> (our parameter name, shard id), or None for entries to skip."""
        if name.endswith(_IGNORED_SUFFIXES):
            return None
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _STACKED_PARAMS:
            fused, shard = _STACKED_PARAMS[parts[-2]]
            return ".".join(parts[:-2] + [fused, parts[-1]]), shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> set[str]:
        """Load Hugging Face-named tensors (``[out, in]`` layout), fusing QKV and gate/up once.

        Returns the names of the model parameters that were loaded. With tied embeddings
        (or no ``lm_head.weight`` in the checkpoint) the LM head copies the embedding.

        Raises:
            ValueError: a tensor's shape does not match, or parameters are left unloaded.
        """
        params = dict(self.named_parameters())
        layers = dict(self.named_sublayers())
        loaded: dict[str, set[object]] = {}
        skipped: list[str] = []
        unexpected: list[str] = []
        for hf_name, array in weights:
            if self.tie_word_embeddings and hf_name == "lm_head.weight":
                continue  # the copy of the embedding below is the same tensor
            resolved = self._resolve(hf_name)
            if resolved is None:
                continue
            name, shard = resolved
            if name not in params:
                owner_name, _, leaf = name.rpartition(".")
                # The layer exists without this parameter: an option not built here (refused after the loop, so
                # that a tensor's own refusal, e.g. fp8 bytes without -q fp8, comes first).
                if owner_name in layers:
                    unexpected.append(f"{hf_name} ({type(layers[owner_name]).__name__} {owner_name} has no {leaf!r})")
                else:
                    skipped.append(hf_name)
                continue
            owner = layers.get(name.rpartition(".")[0])
            loader = getattr(owner, "weight_loader", None)
            if loader is not None:
                try:
                    loader(params[name], array, shard)
                except ValueError as e:  # the layer names its shard; say which checkpoint tensor it was
                    raise ValueError(f"{hf_name}: {e}") from e
            else:
                load_into(params[name], array, hf_name)
            loaded.setdefault(name, set()).add(shard)
        if unexpected:
            raise ValueError(f"{len(unexpected)} checkpoint tensors have no parameter in layers this model does build, "
                             f"e.g. {'; '.join(unexpected[:3])}: the checkpoint uses an option its config.json does "
                             "not declare, or one FastDeploy does not implement.")
        if skipped:
            logger.warning("Ignored %d checkpoint tensors the model does not use, e.g. %s", len(skipped), skipped[:5])
        if "lm_head.weight" not in loaded:
            if not self.tie_word_embeddings:
                logger.info("No lm_head.weight in the checkpoint: tying the LM head to the embedding.")
            self.lm_head.tie_weights(self.model.embed_tokens)
            loaded["lm_head.weight"] = {None}
        check_all_loaded(params, layers, loaded)
        return set(loaded)
