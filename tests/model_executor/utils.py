"""Shared helpers for model tests: tiny random HF checkpoints and a paged-cache greedy runner.

``build_tiny_checkpoint`` writes a 2-layer, hidden-64 model of any supported
architecture with transformers (random weights, seeded, biases and norm weights
randomized too so they matter). ``PagedRunner`` drives one of our models the way
the model runner does: a paged KV cache with a shuffled block table, flat slot
mapping, decodes first and prefills after, one forward per step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle

from fastdeploy.model_executor.layers.attention.metadata import build_attention_metadata

TINY_VOCAB = 1000
ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Ernie4_5ForCausalLM"]
# Mixture-of-experts architectures: 8 experts, top-2, one sparse and one dense layer (or both sparse).
MOE_ARCHITECTURES = ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Ernie4_5_MoeForCausalLM"]
# Architectures with no native implementation, served through the PaddleFormers backend.
PADDLEFORMERS_ONLY_ARCHITECTURES = ["Phi3ForCausalLM"]

_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Each architecture exercises its own options: untied head, biases, head_dim != hidden / heads.
_ARCH_OPTIONS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "Qwen2ForCausalLM": dict(tie_word_embeddings=False),
    "Qwen3ForCausalLM": dict(tie_word_embeddings=True, head_dim=32),
    "Ernie4_5ForCausalLM": dict(tie_word_embeddings=True, use_bias=True, head_dim=16),
    # Layer 1 dense (mlp_only_layers), renormalized top-k.
    "Qwen3MoeForCausalLM": dict(tie_word_embeddings=False, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    # Layer 0 dense (decoder_sparse_step 2), top-k not renormalized, gated shared expert.
    "Qwen2MoeForCausalLM": dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
                                decoder_sparse_step=2),
    # Both layers sparse, biases, two shared experts; the random correction bias changes the choice. Untied: with
    # the head tied to the embedding its greedy output repeats one or two tokens (a weak check of the decode).
    "Ernie4_5_MoeForCausalLM": dict(tie_word_embeddings=False, use_bias=True, head_dim=16, moe_num_experts=8, moe_k=2,
                                    moe_intermediate_size=32, moe_num_shared_experts=2, moe_layer_start_index=0,
                                    moe_layer_end_index=1, moe_layer_interval=1),
    # Sliding window shorter than the test sequences, partial rotary: both must be honoured.
    "Phi3ForCausalLM": dict(tie_word_embeddings=False, sliding_window=12, partial_rotary_factor=0.5),
    # MLA with distinct nope / rope / v widths and a q LoRA; YaRN with DeepSeek's mscale (V3) or none (V2-Lite's
    # q_proj, softmax greedy routing). Layer 0 dense, the rest MoE: 8 experts, 2 per token, shared experts.
    "DeepseekV3ForCausalLM": dict(
        tie_word_embeddings=False, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0},
    ),
    "DeepseekV2ForCausalLM": dict(
        tie_word_embeddings=False, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=1.0, topk_method="greedy",
        norm_topk_prob=False, n_group=1, topk_group=1,
    ),
}


def tiny_hf_config(arch: str, **overrides: Any):
    """A transformers config of ``arch`` with tiny dimensions."""
    import transformers

    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Ernie4_5ForCausalLM": transformers.Ernie4_5Config,
        "Phi3ForCausalLM": transformers.Phi3Config,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
        "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
        "Ernie4_5_MoeForCausalLM": transformers.Ernie4_5_MoeConfig,
        "DeepseekV3ForCausalLM": transformers.DeepseekV3Config,
        "DeepseekV2ForCausalLM": transformers.DeepseekV2Config,
    }[arch]
    kwargs = {**_COMMON, **_ARCH_OPTIONS[arch], **overrides}
    config = config_cls(**kwargs)
    config.architectures = [arch]
    return config


def build_tiny_checkpoint(
    arch: str, path: str | os.PathLike, seed: int = 0, std: float = 0.08, **overrides: Any
) -> str:
    """Save a tiny random ``arch`` model as safetensors into ``path``; returns the folder."""
    import torch
    import transformers

    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def load_hf_model(path: str):
    """The transformers model of a checkpoint folder, fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def load_our_model(path: str, gguf_file: str | None = None, load_format: str = "auto", dtype: str = "float32"):
    """Our model of a checkpoint folder (or GGUF file in it) through ModelConfig + get_model.

    float32 by default: the comparisons against transformers' fp32 forward need it ("auto"
    picks bfloat16 on CPUs with bf16 units), and a GGUF file dequantized (``quantization="none"``,
    not the GGUF default of served engines, ``quantization="gguf"``).
    """
    from fastdeploy.config import LoadConfig, ModelConfig
    from fastdeploy.model_executor.model_loader import get_model

    model_config = ModelConfig(model=os.path.join(path, gguf_file) if gguf_file else path, dtype=dtype,
                               quantization="none")
    return get_model(model_config, LoadConfig(load_format=load_format))


def named_weights(model) -> dict[str, np.ndarray]:
    """Every parameter of ``model`` as numpy, with packed matmul weights unpacked under their ``.weight`` names."""
    from fastdeploy.model_executor.layers.linear import LinearBase

    weights = {name: p.numpy() for name, p in model.named_parameters()}
    for name, layer in model.named_sublayers():
        if isinstance(layer, LinearBase) and layer.is_packed:
            weights[f"{name}.weight"] = layer.dense_weight().numpy()
    return weights


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (never stops at EOS)."""
    import torch

    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def hf_logits(hf_model, prompt: list[int]) -> np.ndarray:
    """transformers' logits ``[len(prompt), vocab]`` for one prompt."""
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float().numpy()


@dataclass
class _Seq:
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedRunner:
    """A minimal model runner: paged KV cache with shuffled blocks, mixed decode/prefill steps.

    Args:
        model: one of our models.
        num_blocks: blocks per layer cache.
        block_size: tokens per block (small, so sequences span several blocks).
        seed: seeds the block order (a shuffled, non-identity block table).
    """

    def __init__(self, model, num_blocks: int = 128, block_size: int = 4, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        get_spec = getattr(model, "get_kv_cache_spec", None)
        if get_spec is not None:  # the model's own cache layout (MLA's latent)
            self.kv_caches = [spec.allocate(num_blocks, block_size, zero=True) for spec in get_spec()]
        else:
            shape = [num_blocks, block_size, model.num_kv_heads, model.head_dim]
            dtype = getattr(model, "kv_cache_dtype", "float32")
            # Zero-filled so that masked padding slots hold finite values.
            self.kv_caches = [(paddle.zeros(shape, dtype), paddle.zeros(shape, dtype)) for _ in range(model.num_layers)]
        self.free_blocks = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]
        self.seqs: dict[Any, _Seq] = {}

    def add(self, seq_id: Any, prompt: list[int]) -> None:
        self.seqs[seq_id] = _Seq(list(prompt))

    def append(self, seq_id: Any, token: int) -> None:
        self.seqs[seq_id].tokens.append(int(token))

    def _slots(self, seq: _Seq, positions: np.ndarray) -> np.ndarray:
        blocks = np.asarray(seq.blocks, dtype=np.int64)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def step(self, schedule: list[tuple[Any, int]]) -> paddle.Tensor:
        """Run one forward over ``(seq_id, num_new_tokens)`` pairs; returns the logits of each chunk's last token.

        Chunks of one token are decodes and must come first; the rest are (chunked) prefills.
        """
        seen_prefill = False
        tables, query_lens, seq_lens, input_ids, last_rows = [], [], [], [], []
        for seq_id, n in schedule:
            seq = self.seqs[seq_id]
            start, end = seq.num_computed, seq.num_computed + n
            assert end <= len(seq.tokens), "scheduled past the known tokens"
            assert n > 1 or not seen_prefill, "decodes must come before prefills"
            seen_prefill = seen_prefill or n > 1
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free_blocks.pop())
            tables.append(seq.blocks)
            query_lens.append(n)
            seq_lens.append(end)
            input_ids += seq.tokens[start:end]
            last_rows.append(len(input_ids) - 1)
            seq.num_computed = end
        block_tables = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        md, positions = build_attention_metadata(block_tables, np.array(query_lens), np.array(seq_lens), self.block_size)
        with paddle.no_grad():
            hidden = self.model(
                paddle.to_tensor(np.asarray(input_ids, dtype=np.int64)),
                paddle.to_tensor(positions),
                self.kv_caches,
                md,
            )
            self.last_hidden = hidden
            return self.model.compute_logits(paddle.gather(hidden, paddle.to_tensor(last_rows, dtype="int64")))


def greedy_generate(
    model, prompt: list[int], max_new_tokens: int, block_size: int = 4, prefill_chunk: int | None = None, seed: int = 0
) -> tuple[list[int], np.ndarray]:
    """Greedy continuation of ``prompt`` through ``PagedRunner``: (new tokens, logits of the first sampled step).

    ``prefill_chunk`` splits the prompt into chunks (chunked prefill over cached context).
    """
    num_blocks = (len(prompt) + max_new_tokens) // block_size + 4
    runner = PagedRunner(model, num_blocks=num_blocks, block_size=block_size, seed=seed)
    runner.add(0, prompt)
    chunk = prefill_chunk or len(prompt)
    done = 0
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)
        logits = runner.step([(0, n)])
        done += n
    first = logits.numpy()[0]
    out = []
    for _ in range(max_new_tokens):
        token = int(np.argmax(logits.numpy()[0]))
        out.append(token)
        runner.append(0, token)
        if len(out) < max_new_tokens:
            logits = runner.step([(0, 1)])
    return out, first


def prefill_logits(model, prompt: list[int], block_size: int = 4, seed: int = 0) -> np.ndarray:
    """Logits ``[len(prompt), vocab]`` of every prompt position from one paged prefill."""
    runner = PagedRunner(model, num_blocks=len(prompt) // block_size + 4, block_size=block_size, seed=seed)
    runner.add(0, prompt)
    runner.step([(0, len(prompt))])
    with paddle.no_grad():
        return model.compute_logits(runner.last_hidden).numpy()
