"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention, DeepSeekMoE, and V3's MTP layers.

- Attention is MLA (:mod:`~fastdeploy.model_executor.layers.attention.mla_attn`): the paged
  cache holds one ``kv_lora_rank + qk_rope_head_dim`` latent per token and layer
  (:class:`MLAAttentionSpec`), prefills attend on up-projected keys/values, decodes on the
  latents with ``kv_b_proj`` absorbed into the query and the output. ``q_lora_rank`` may be
  None (V2-Lite: one ``q_proj``). RoPE covers the ``qk_rope_head_dim`` part only, GPT-J
  (interleaved) pairs unless a V3 config sets ``rope_interleave: false``; YaRN configs also
  scale the softmax by ``mscale(factor, mscale_all_dim) ** 2``, as DeepSeek's reference code and
  vLLM do for V2 and V3 (transformers 5.3 does it for V3 only).
- Layers ``i >= first_k_dense_replace`` with ``i % moe_layer_freq == 0`` are MoE (routed
  experts + shared experts), the others a dense SwiGLU MLP.
- ``model.layers.{num_hidden_layers + k}`` are V3's multi-token-prediction modules: the target
  model skips them; :class:`DeepSeekMTP` loads and runs them for speculative decoding.

Fields of these configs that change the computation and are not implemented are refused by
name (:func:`check_supported`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import paddle
from paddle import nn

from fastdeploy.model_executor.layers.attention.kv_cache_spec import MLAAttentionSpec
from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata
from fastdeploy.model_executor.layers.attention.mla_attn import MLAAttentionImpl
from fastdeploy.model_executor.layers.fused_moe import FusedMoE, expert_params_mapping
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from fastdeploy.model_executor.layers.logits_processor import LogitsProcessor
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig
from fastdeploy.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope, yarn_get_mscale
from fastdeploy.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from fastdeploy.model_executor.models.llama import LlamaForCausalLM, LlamaMLP, prenorm_layer_forward
from fastdeploy.model_executor.models.moe import COMMON_CHECKS, MoEModelMixin, SparseMoeBlock, refuse_unsupported
from fastdeploy.model_executor.utils import new_parameter

_ROPE_TYPES = ("default", "linear", "yarn", "deepseek_yarn")


def _rope_scaling(hf_config: Any) -> dict[str, Any]:
    """The config's rope parameters (transformers 5's ``rope_parameters`` or the older ``rope_scaling``)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return dict(params)


def _rope_type(value: Any) -> str:
    params = dict(value or {})
    return params.get("rope_type", params.get("type", "default"))


# Fields that change the computation, each with what is implemented; refused by name otherwise.
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **COMMON_CHECKS,
    "rope_parameters": (lambda v: _rope_type(v) in _ROPE_TYPES, f"rope_type in {list(_ROPE_TYPES)}"),
    "rope_scaling": (lambda v: _rope_type(v) in _ROPE_TYPES, f"rope_type in {list(_ROPE_TYPES)}"),
    "topk_method": (lambda v: v in (None, "greedy", "group_limited_greedy", "noaux_tc"),
                    "'greedy', 'group_limited_greedy' or 'noaux_tc'"),
    "scoring_func": (lambda v: v in (None, "softmax", "sigmoid"), "'softmax' or 'sigmoid'"),
    "ep_size": (lambda v: (v or 1) == 1, "1 (expert parallelism is not implemented)"),
    # DeepSeek-V3.2's sparse-attention indexer.
    "index_topk": (lambda v: not v, "unset (DeepSeek sparse attention is not implemented)"),
}


def check_supported(hf_config: Any) -> None:
    """Refuse, by field name, configs whose computation this implementation would get wrong.

    Raises:
        ValueError: naming the field, its value and what is supported.
    """
    refuse_unsupported(hf_config, _CHECKS)
    heads = hf_config.num_attention_heads
    refuse_unsupported(hf_config, {"num_key_value_heads": (
        lambda v: v in (None, heads), f"num_attention_heads ({heads}): MLA shares one latent across heads")})


def is_moe_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` has routed experts (vLLM's rule, with ``moe_layer_freq``)."""
    if not getattr(hf_config, "n_routed_experts", None):
        return False
    freq = getattr(hf_config, "moe_layer_freq", 1) or 1
    return layer_idx >= getattr(hf_config, "first_k_dense_replace", 0) and layer_idx % freq == 0


def mla_softmax_scale(hf_config: Any) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    scaling = _rope_scaling(hf_config)
    mscale_all_dim = scaling.get("mscale_all_dim", 0)
    if _rope_type(scaling) != "default" and mscale_all_dim:
        m = yarn_get_mscale(float(scaling.get("factor") or 1.0), float(mscale_all_dim))
        scale *= m * m
    return scale


def mla_rope(hf_config: Any, dtype: str, is_neox_style: bool) -> RotaryEmbedding:
    """The rotary embedding of the ``qk_rope_head_dim`` part (shared by every layer)."""
    scaling = _rope_scaling(hf_config)
    base = float(scaling.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    if _rope_type(scaling) == "default":
        scaling = {}
    rd = hf_config.qk_rope_head_dim
    return get_rope(rd, hf_config.max_position_embeddings, base=base, rope_scaling=scaling or None,
                    is_neox_style=is_neox_style, rotary_dim=rd, dtype=dtype)


class DeepseekV2MLAAttention(nn.Layer):
    """Multi-head latent attention of one layer (projections, RoPE on the rope part, latent cache)."""

    def __init__(self, hf_config: Any, rotary_emb: RotaryEmbedding, dtype: str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        c = hf_config
        hidden, h = c.hidden_size, c.num_attention_heads
        self.num_heads = h
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.qk_head_dim = self.nope + self.rope
        self.kv_lora_rank = c.kv_lora_rank
        self.q_lora_rank = getattr(c, "q_lora_rank", None)
        bias = bool(getattr(c, "attention_bias", False))
        kw = dict(dtype=dtype, quant_config=quant_config)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, prefix=f"{prefix}.q_a_proj", **kw)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, h * self.qk_head_dim, bias=False,
                                                 prefix=f"{prefix}.q_b_proj", **kw)
        else:
            self.q_proj = ColumnParallelLinear(hidden, h * self.qk_head_dim, bias=False, prefix=f"{prefix}.q_proj",
                                               **kw)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope, bias=bias,
                                                   prefix=f"{prefix}.kv_a_proj_with_mqa", **kw)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, h * (self.nope + self.v_dim), bias=False,
                                              prefix=f"{prefix}.kv_b_proj", **kw)
        self.o_proj = RowParallelLinear(h * self.v_dim, hidden, bias=bias, prefix=f"{prefix}.o_proj", **kw)
        self.rotary_emb = rotary_emb
        object.__setattr__(self, "impl", MLAAttentionImpl(h, self.nope, self.rope, self.v_dim, self.kv_lora_rank,
                                                          mla_softmax_scale(c)))

    def process_weights_after_loading(self) -> None:
        """Precompute the absorbed ``W_UK`` / ``W_UV`` from ``kv_b_proj``'s weight as its matmul uses it (after packing)."""
        self.impl.set_kv_b_weight(self.kv_b_proj.dense_weight())

    def forward(self, positions: paddle.Tensor, hidden_states: paddle.Tensor, kv_cache: tuple[paddle.Tensor, ...],
                attn_metadata: AttentionMetadata) -> paddle.Tensor:
        t = hidden_states.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q = q.reshape([t, self.num_heads, self.qk_head_dim])
        kv_a = self.kv_a_proj_with_mqa(hidden_states)
        c_kv, k_pe = paddle.split(kv_a, [self.kv_lora_rank, self.rope], axis=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_nope, q_pe = paddle.split(q, [self.nope, self.rope], axis=-1)
        # q's and k's rope parts stacked along heads take one rotation.
        cos, sin = self.rotary_emb.get_cos_sin(positions)
        pe = self.rotary_emb.rotate(paddle.concat([q_pe, k_pe.unsqueeze(1)], axis=1), cos, sin)
        q = paddle.concat([q_nope, pe[:, : self.num_heads]], axis=-1)
        latent = paddle.concat([c_kv, pe[:, self.num_heads]], axis=-1)
        out = self.impl.forward(q, latent, self.kv_b_proj, kv_cache, attn_metadata)
        return self.o_proj(out)


class DeepseekV2DecoderLayer(nn.Layer):
    """Pre-norm block: MLA, then a dense MLP or DeepSeekMoE; the residual stream is carried separately.

    Args:
        build_mlp: ``(layer_idx, prefix, dtype, quant_config) -> nn.Layer``, the model's choice of
            feed-forward for this layer (dense or MoE).
    """

    def __init__(self, hf_config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, dtype: str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 build_mlp: Callable[..., nn.Layer]) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = DeepseekV2MLAAttention(hf_config, rotary_emb, dtype, quant_config, f"{prefix}.self_attn")
        self.mlp = build_mlp(layer_idx, f"{prefix}.mlp", dtype, quant_config)
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)

    def process_weights_after_loading(self) -> None:
        """Split ``kv_b_proj`` for the absorbed decode (from its weight as the matmul uses it)."""
        self.self_attn.process_weights_after_loading()

    def forward(self, positions: paddle.Tensor, hidden_states: paddle.Tensor, residual: paddle.Tensor | None,
                kv_cache: tuple[paddle.Tensor, ...], attn_metadata: AttentionMetadata
                ) -> tuple[paddle.Tensor, paddle.Tensor]:
        return prenorm_layer_forward(self, positions, hidden_states, residual, kv_cache, attn_metadata)


class DeepseekV2Model(nn.Layer):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, hf_config: Any, dtype: str = "float32", quant_config: QuantizationConfig | None = None,
                 prefix: str = "model", *, is_neox_style: bool = False, build_mlp: Callable[..., nn.Layer]) -> None:
        super().__init__()
        self.config = hf_config
        self.rotary_emb = mla_rope(hf_config, dtype, is_neox_style)
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, dtype, quant_config,
                                                   f"{prefix}.embed_tokens")
        self.layers = nn.LayerList([
            DeepseekV2DecoderLayer(hf_config, i, self.rotary_emb, dtype, quant_config, f"{prefix}.layers.{i}",
                                   build_mlp=build_mlp)
            for i in range(hf_config.num_hidden_layers)
        ])
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)

    def process_weights_after_loading(self) -> None:
        """Each layer's once-per-load work (MLA's absorbed weights) after the matmul weights are packed."""
        for layer in self.layers:
            layer.process_weights_after_loading()

    def forward(self, input_ids: paddle.Tensor, positions: paddle.Tensor, kv_caches: list[tuple[paddle.Tensor, ...]],
                attn_metadata: AttentionMetadata) -> paddle.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


# HF name piece -> (our fused module, shard id).
_STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV2ForCausalLM(MoEModelMixin, LlamaForCausalLM):
    """DeepSeek-V2 (and V2-Lite, V2.5) with the LM head; the loading and logits of :class:`LlamaForCausalLM`.

    ``forward``'s ``kv_caches`` holds one ``(latent_cache,)`` per layer, each ``[num_blocks,
    block_size, 1, kv_lora_rank + qk_rope_head_dim]``, as :meth:`get_kv_cache_spec` describes.
    Checkpoint tensors of the MTP modules (``model.layers.{num_hidden_layers + k}``) are
    skipped here: :class:`~fastdeploy.model_executor.models.deepseek_mtp.DeepSeekMTP` loads them.
    """

    # The routing of a config without `topk_method` (transformers' configs have none): V2's softmax
    # greedy; V3 overrides it with "noaux_tc" (sigmoid, grouped, biased).
    default_topk_method = "greedy"

    def __init__(self, hf_config: Any, dtype: str = "float32", quant_config: QuantizationConfig | None = None) -> None:
        nn.Layer.__init__(self)
        check_supported(hf_config)
        self.config = hf_config
        self.dtype_name = dtype
        self.model = DeepseekV2Model(hf_config, dtype, quant_config, is_neox_style=self.rope_is_neox(hf_config),
                                     build_mlp=self.build_mlp)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype,
                                      quant_config=quant_config, prefix="lm_head")
        self.logits_processor = LogitsProcessor(hf_config.vocab_size)
        self.num_layers = hf_config.num_hidden_layers
        # One latent "head" per token: what the cache holds (see get_kv_cache_spec).
        self.num_kv_heads = 1
        self.head_dim = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
        self.compute_dtype = "float32"
        self.kv_cache_dtype = "float32"

    @classmethod
    def rope_is_neox(cls, hf_config: Any) -> bool:
        """Whether RoPE rotates halves (NeoX) rather than interleaved pairs; V2 always pairs."""
        return False

    @property
    def mlp_bias(self) -> bool:
        """``mlp_bias`` (DeepSeek-V2's config): biases on the dense and shared-expert SwiGLUs (the routed experts
        have none, as in transformers)."""
        return bool(getattr(self.config, "mlp_bias", False))

    def get_kv_cache_spec(self) -> list[MLAAttentionSpec]:
        """One latent of ``kv_lora_rank + qk_rope_head_dim`` per token and layer."""
        return [MLAAttentionSpec(1, self.head_dim, self.kv_cache_dtype)] * self.num_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        return is_moe_layer(self.config, layer_idx)

    def build_mlp(self, layer_idx: int, prefix: str, dtype: str, quant_config: QuantizationConfig | None) -> nn.Layer:
        """Layer ``layer_idx``'s feed-forward: DeepSeekMoE where :func:`is_moe_layer`, else the dense SwiGLU."""
        c = self.config
        return super().build_mlp(layer_idx, prefix, dtype, quant_config) or LlamaMLP(
            c.hidden_size, c.intermediate_size, self.mlp_bias, dtype, quant_config, prefix)

    def build_moe_block(self, prefix: str, dtype: str, quant_config: QuantizationConfig | None) -> nn.Layer:
        """Router + routed experts + ``n_shared_experts`` shared experts (one SwiGLU of their summed width).

        ``topk_method`` picks the routing: "greedy" (softmax top-k), "group_limited_greedy" (softmax,
        only the ``topk_group`` groups with the best expert compete), "noaux_tc" (sigmoid scores plus
        ``e_score_correction_bias`` for choosing, groups ranked by their two best); weights are
        renormalized with ``norm_topk_prob`` and scaled by ``routed_scaling_factor``.
        """
        c = self.config
        method = getattr(c, "topk_method", None) or self.default_topk_method
        scoring = getattr(c, "scoring_func", None) or ("sigmoid" if method == "noaux_tc" else "softmax")
        num_experts = c.n_routed_experts
        # The checkpoint stores the bias under the router (mlp.gate.e_score_correction_bias), in fp32.
        bias = new_parameter([num_experts], "float32") if method == "noaux_tc" else None
        grouped = method != "greedy"
        experts = FusedMoE(
            num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size,
            renormalize=bool(getattr(c, "norm_topk_prob", False)), dtype=dtype, quant_config=quant_config,
            prefix=f"{prefix}.experts", scoring_func=scoring, e_score_correction_bias=bias,
            num_expert_group=(getattr(c, "n_group", None) or 1) if grouped else None,
            topk_group=(getattr(c, "topk_group", None) or 1) if grouped else None,
            routed_scaling_factor=float(getattr(c, "routed_scaling_factor", 1.0) or 1.0),
        )  # fmt: skip
        n_shared = getattr(c, "n_shared_experts", None) or 0
        shared = (self.shared_mlp(c.moe_intermediate_size * n_shared, self.mlp_bias, dtype, quant_config,
                                  f"{prefix}.shared_experts") if n_shared else None)
        block = SparseMoeBlock(c.hidden_size, experts, dtype, prefix, shared=shared, shared_name="shared_experts")
        if bias is not None:
            block.gate.e_score_correction_bias = bias
        return block

    def _resolve(self, name: str) -> tuple[str, object] | None:
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= self.num_layers:
            return None  # a multi-token-prediction module: DeepSeekMTP loads it
        return self.resolve_layer_name(name)

    @staticmethod
    def resolve_layer_name(name: str) -> tuple[str, object] | None:
        """A checkpoint name -> (our parameter name, shard id), or None for entries to skip."""
        if name.endswith("rotary_emb.inv_freq"):
            return None
        expert = expert_params_mapping(name)
        if expert is not None:
            return expert
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _STACKED:
            fused, shard = _STACKED[parts[-2]]
            return ".".join(parts[:-2] + [fused, parts[-1]]), shard
        return name, None


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1: V2's layout with sigmoid grouped routing and a score-correction bias."""

    default_topk_method = "noaux_tc"

    @classmethod
    def rope_is_neox(cls, hf_config: Any) -> bool:
        # transformers' V3 permutes the interleaved pairs to halves (rope_interleave, the default):
        # the same rotation as GPT-J style on the original layout.
        return not getattr(hf_config, "rope_interleave", True)
