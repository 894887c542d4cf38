"""Hugging Face config of a GGUF file of llama.cpp's ``deepseek2`` architecture (DeepSeek-V2, V2-Lite, V2.5, V3, R1).

transformers 5.3 has no GGUF mapping for ``deepseek2``, so the metadata llama.cpp's converter
(``convert_hf_to_gguf.py``, ``DeepseekV2Model``) writes is mapped back here, key by key:

- MLA sizes: ``attention.kv_lora_rank``, ``attention.q_lora_rank`` (absent: V2-Lite's single
  ``attn_q``), ``rope.dimension_count`` (``qk_rope_head_dim``) and the head sizes. Current converters
  write the absorbed (MQA) form: ``head_count_kv`` 1, ``key_length`` = kv_lora_rank + rope,
  ``value_length`` = kv_lora_rank, the real head sizes in ``key_length_mla`` / ``value_length_mla``,
  and ``attn_kv_b`` split into ``attn_k_b`` / ``attn_v_b``. Older files have ``key_length`` =
  nope + rope, ``value_length`` = v_head_dim and one ``attn_kv_b``.
- DeepSeekMoE: ``expert_count``, ``expert_used_count``, ``expert_shared_count``,
  ``expert_feed_forward_length``, ``leading_dense_block_count`` (first_k_dense_replace),
  ``expert_weights_scale`` (routed_scaling_factor), ``expert_weights_norm`` (norm_topk_prob),
  ``expert_group_count`` / ``expert_group_used_count`` (n_group / topk_group) and
  ``expert_gating_func`` (1 softmax: V2, 2 sigmoid with the ``exp_probs_b`` correction bias: V3).
  Absent gating means softmax, as llama.cpp reads V2 / V2.5 files written before the key existed.
- YaRN: ``rope.scaling.{type,factor,original_context_length,yarn_beta_fast,yarn_beta_slow}`` and
  ``rope.scaling.yarn_log_multiplier``, which the converter writes as ``0.1 * mscale_all_dim``;
  ``mscale`` is not stored: as llama.cpp does, it is 1 unless ``mscale_all_dim`` is not 1, then equal
  to it (V2 / V2-Lite have both 0.707, V3 both 1).

Metadata this mapping cannot honour is refused by name (:class:`ValueError`).
"""

from __future__ import annotations

from typing import Any

from transformers import DeepseekV2Config, DeepseekV3Config, PretrainedConfig

ARCH = "deepseek2"
_SOFTMAX, _SIGMOID = 1, 2


def _refuse(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"GGUF {ARCH} metadata {ARCH}.{key} = {value!r} is not supported: {why}.")


def _int(meta: dict[str, Any], key: str, default: int | None = None) -> int | None:
    value = meta.get(f"{ARCH}.{key}", default)
    if isinstance(value, list):  # llama.cpp allows per-layer arrays for some keys
        if len(set(value)) != 1:
            raise _refuse(key, value, "per-layer values that differ are not implemented")
        value = value[0]
    return None if value is None else int(value)


def _rope_parameters(meta: dict[str, Any]) -> dict[str, Any]:
    theta = float(meta.get(f"{ARCH}.rope.freq_base", 10000.0))
    kind = str(meta.get(f"{ARCH}.rope.scaling.type", "none"))
    for key in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.attn_factor"):
        if f"{ARCH}.{key}" in meta:
            raise _refuse(key, meta[f"{ARCH}.{key}"], "DeepSeek's YaRN is built from factor and mscale only")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind not in ("linear", "yarn"):
        raise _refuse("rope.scaling.type", kind, "supported: none, linear, yarn")
    factor = float(meta[f"{ARCH}.rope.scaling.factor"])
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    # The converter writes 0.1 * mscale_all_dim ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX] in llama.cpp).
    mscale_all_dim = float(meta.get(f"{ARCH}.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    mscale_all_dim = round(mscale_all_dim, 6)  # undo the float32 round trip (0.0707 -> 0.707)
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": factor,
        "original_max_position_embeddings": int(meta[f"{ARCH}.rope.scaling.original_context_length"]),
        "beta_fast": float(meta.get(f"{ARCH}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(meta.get(f"{ARCH}.rope.scaling.yarn_beta_slow", 1.0)),
        "mscale": mscale_all_dim if mscale_all_dim not in (0.0, 1.0) else 1.0,
        "mscale_all_dim": mscale_all_dim,
    }


def deepseek2_hf_config(meta: dict[str, Any], tensor_names: set[str]) -> PretrainedConfig:
    """The DeepseekV2 / DeepseekV3 config of a ``deepseek2`` GGUF file's metadata and tensor names.

    Sigmoid gating (``expert_gating_func`` 2) gives ``DeepseekV3ForCausalLM`` (``noaux_tc`` routing
    with the file's ``exp_probs_b``), softmax ``DeepseekV2ForCausalLM`` (``greedy``, or
    ``group_limited_greedy`` with more than one expert group).

    Raises:
        ValueError: naming the metadata key (or tensor) this mapping does not implement.
    """
    if (nextn := _int(meta, "nextn_predict_layers", 0)) > 0:
        raise _refuse("nextn_predict_layers", nextn, "multi-token-prediction layers in deepseek2 GGUF files "
                      "are not mapped (llama.cpp's DeepSeek converter leaves them out)")
    for key in ("attention.temperature_scale", "attention.temperature_length", "expert_group_scale",
                "experts_per_group", "expert_chunk_feed_forward_length"):
        if f"{ARCH}.{key}" in meta:
            raise _refuse(key, meta[f"{ARCH}.{key}"], "not implemented for DeepSeek models")
    heads = _int(meta, "attention.head_count")
    rope_dim = _int(meta, "rope.dimension_count")
    kv_lora_rank = _int(meta, "attention.kv_lora_rank")
    if f"{ARCH}.attention.key_length_mla" in meta:  # the absorbed (MQA) form of current converters
        qk_head_dim = _int(meta, "attention.key_length_mla")
        v_head_dim = _int(meta, "attention.value_length_mla")
    else:  # older files: the real head sizes, one attn_kv_b
        qk_head_dim = _int(meta, "attention.key_length")
        v_head_dim = _int(meta, "attention.value_length")
    num_layers = _int(meta, "block_count")
    vocab = _int(meta, "vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    gating = _int(meta, "expert_gating_func")
    if gating is None:
        # As llama.cpp: V2 / V2.5 files predate the key (softmax); GLM-4.7-Lite's are sigmoid.
        gating = _SIGMOID if num_layers in (47, 48) and vocab == 154880 else _SOFTMAX
    if gating not in (_SOFTMAX, _SIGMOID):
        raise _refuse("expert_gating_func", gating, "supported: 1 (softmax), 2 (sigmoid)")
    n_group = _int(meta, "expert_group_count", 1) or 1
    topk_group = _int(meta, "expert_group_used_count", 1) or 1
    has_bias = any(n.endswith("exp_probs_b.bias") for n in tensor_names)
    if gating == _SIGMOID and not has_bias:
        raise _refuse("expert_gating_func", gating, "sigmoid gating without exp_probs_b (correction bias) "
                      "tensors is not implemented")
    if gating == _SOFTMAX and has_bias:
        raise ValueError(f"GGUF {ARCH} file has exp_probs_b (correction bias) tensors with softmax gating, "
                         "which is not implemented.")
    common = dict(
        vocab_size=vocab,
        max_position_embeddings=_int(meta, "context_length"),
        hidden_size=_int(meta, "embedding_length"),
        intermediate_size=_int(meta, "feed_forward_length"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,  # MLA: every head reads the one latent
        rms_norm_eps=float(meta.get(f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-6)),
        q_lora_rank=_int(meta, "attention.q_lora_rank"),
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=qk_head_dim - rope_dim,
        v_head_dim=v_head_dim,
        moe_intermediate_size=_int(meta, "expert_feed_forward_length"),
        n_routed_experts=_int(meta, "expert_count"),
        num_experts_per_tok=_int(meta, "expert_used_count"),
        n_shared_experts=_int(meta, "expert_shared_count", 0),
        first_k_dense_replace=_int(meta, "leading_dense_block_count", 0),
        routed_scaling_factor=float(meta.get(f"{ARCH}.expert_weights_scale", 1.0)),
        norm_topk_prob=bool(meta.get(f"{ARCH}.expert_weights_norm", False)),
        n_group=n_group,
        topk_group=topk_group,
        rope_parameters=_rope_parameters(meta),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=False,
    )
    if gating == _SIGMOID:
        # rope_interleave: llama.cpp rotates interleaved pairs on the original (unpermuted) rows.
        config = DeepseekV3Config(**common, rope_interleave=True)
        config.architectures = ["DeepseekV3ForCausalLM"]
    else:
        config = DeepseekV2Config(**common, topk_method="group_limited_greedy" if n_group > 1 else "greedy")
        config.architectures = ["DeepseekV2ForCausalLM"]
    return config
