"""Tensor parallelism: the split model equals the whole one, and impossible splits are refused by name.

Model level: tiny random Llama, Qwen3 (tied head, q/k norm, one KV head replicated on both
ranks) and ERNIE 4.5 (biases, interleaved RoPE), and SmolLM2 on 3 ranks (9 heads / 3 KV
heads), each run on rank processes of a gloo group: fp32 prefill logits within 1e-4 of one
rank, 32 greedy tokens identical, plain and with chunked prefill.
"""

from __future__ import annotations

import numpy as np
import pytest
from tp_rank import run_jobs, run_tensor_parallel

from tests.model_executor.utils import TINY_VOCAB, build_tiny_checkpoint

MAX_NEW = 32
# Architecture -> overrides: Qwen3 with one KV head, which both ranks hold (vLLM's replication).
TINY = {"LlamaForCausalLM": {}, "Qwen3ForCausalLM": {"num_key_value_heads": 1}, "Ernie4_5ForCausalLM": {}}


def _prompts(vocab: int, lengths=(5, 11, 17)) -> list[list[int]]:
    return [np.random.default_rng(n).integers(3, vocab, n).tolist() for n in lengths]


def _assert_same(ours: dict, ref: dict, atol: float = 1e-4) -> None:
    assert ours["tokens"] == ref["tokens"]
    for a, b in zip(ours["logits"] + ours["first"], ref["logits"] + ref["first"], strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def tiny_jobs(tmp_path_factory) -> list[dict]:
    jobs = []
    for arch, overrides in TINY.items():
        path = build_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch), **overrides)
        jobs.append({"name": arch, "path": path, "prompts": _prompts(TINY_VOCAB)})
        jobs.append({"name": f"{arch}-chunked", "path": path, "prompts": _prompts(TINY_VOCAB)[1:], "prefill_chunk": 4})
    # A bf16 checkpoint: under TP each rank widens only its slice (LazyBF16).
    jobs.append({"name": "llama-bf16", "path": _bf16_copy(jobs[0]["path"], tmp_path_factory.mktemp("bf16")),
                 "prompts": _prompts(TINY_VOCAB)[:2]})
    return jobs


def _bf16_copy(path: str, out) -> str:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(f"{path}/model.safetensors").items()}
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
    shutil.copy(f"{path}/config.json", f"{out}/config.json")
    return str(out)


def test_tiny_models_tp2_equal_tp1(tiny_jobs, tmp_path):
    results = run_tensor_parallel(tiny_jobs, 2, MAX_NEW, str(tmp_path / "tp2.pkl"))
    reference = run_jobs(tiny_jobs, MAX_NEW)  # in this process: one rank
    for job in tiny_jobs:
        _assert_same(results[job["name"]], reference[job["name"]])
    # Qwen3's single KV head is on both ranks; the others split theirs (2 -> 1 each).
    assert {job["name"]: results[job["name"]]["num_kv_heads"] for job in tiny_jobs if "-" not in job["name"]
            and "ForCausalLM" in job["name"]} == {
        "LlamaForCausalLM": 1, "Qwen3ForCausalLM": 1, "Ernie4_5ForCausalLM": 1}


@pytest.mark.slow
def test_smollm2_tp3_equals_tp1(tmp_path):
    """9 query heads and 3 KV heads split 3 ways (one KV head per rank); the vocabulary 49152 / 3."""
    from fastdeploy.transformers_utils.model_resolver import resolve_model

    folder, gguf_file = resolve_model(None)
    job = {"name": "smollm2", "path": folder, "gguf_file": gguf_file, "prompts": _prompts(49152, (6, 13))}
    # -q gguf: every matrix stays in its Q4_1 blocks, split by rows (column-parallel) and by whole
    # 32-value blocks of the input (row-parallel: 576 / 3 and 1536 / 3 are multiples of 32).
    gguf = {**job, "name": "smollm2-gguf", "quantization": "gguf"}
    reference = run_jobs([job, gguf], MAX_NEW)
    # One rank's greedy continuations fed back as prompts: both runs score the same tokens all along them.
    forced = {**gguf, "name": "smollm2-gguf-forced", "prefill_only": True,
              "prompts": [p + t for p, t in zip(job["prompts"], reference["smollm2-gguf"]["tokens"], strict=True)]}
    reference.update(run_jobs([forced], MAX_NEW))
    results = run_tensor_parallel([job, gguf, forced], 3, MAX_NEW, str(tmp_path / "tp3.pkl"))
    assert results["smollm2"]["num_kv_heads"] == 1
    # 30 layers and logits up to ~25: the ranks' partial sums in another order move fp32 logits by up
    # to ~2e-4 (measured 1.7e-4), so 1e-4 holds for the 2-layer models only; the tokens are identical.
    _assert_same(results["smollm2"], reference["smollm2"], atol=5e-4)
    # In GGUF blocks each layer requantizes its input to int8: the all-reduces' fp32 sums in another order
    # flip some roundings, which 30 layers carry on (logits a mean 0.13-0.2 apart), so the greedy tokens part
    # at the first near-tie, which moves whenever any kernel's summation order does (at 7 and 17 on an EPYC,
    # at the second token of one prompt on a Sapphire Rapids). So the checks: TP=3 in blocks stays as close to
    # the fp32 model as one rank in blocks; the first tokens agree; and along one rank's whole continuation
    # TP=3's logits stay close to its (mean drift under 0.3, none over 2: measured 1.08 on the Sapphire Rapids),
    # and where they part, at a token one rank nearly tied (within twice that prompt's largest drift).
    tp3, tp1, fp32 = results["smollm2-gguf"], reference["smollm2-gguf"], reference["smollm2"]
    for ours, one, exact in zip(tp3["logits"], tp1["logits"], fp32["logits"], strict=True):
        assert np.abs(ours - exact).mean() < 1.5 * np.abs(one - exact).mean()
    assert [t[0] for t in tp3["tokens"]] == [t[0] for t in tp1["tokens"]]
    for prompt, ours, one, a, b in zip(job["prompts"], results["smollm2-gguf-forced"]["logits"],
                                       reference["smollm2-gguf-forced"]["logits"], tp3["tokens"], tp1["tokens"],
                                       strict=True):
        steps = slice(len(prompt) - 1, len(prompt) - 1 + MAX_NEW)
        drift = np.abs(ours[steps] - one[steps])
        assert drift.mean() < 0.3 and drift.max() < 2.0, (drift.mean(), drift.max())
        parted = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if parted is not None:  # one rank's logits at that step: TP=3's token within twice the drift of its top
            row = one[len(prompt) - 1 + parted]
            assert row.max() - row[a[parted]] < 2 * drift.max(), (parted, row.max() - row[a[parted]], drift.max())


# ---- refusals ------------------------------------------------------------------------------------


def test_heads_that_cannot_split_are_refused(tmp_path):
    from fastdeploy.engine.arg_utils import EngineArgs

    path = build_tiny_checkpoint("LlamaForCausalLM", tmp_path / "llama")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by --tensor-parallel-size \(3\)"):
        EngineArgs(model=path, tensor_parallel_size=3).create_engine_config()
    # SmolLM2: 9 heads do not split over 2 ranks.
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\).*\(2\)"):
        EngineArgs(model=None, tensor_parallel_size=2).create_engine_config()


def test_kv_heads_split_or_replicate():
    from fastdeploy.distributed.parallel_state import kv_heads_per_rank

    assert [kv_heads_per_rank(8, n) for n in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    with pytest.raises(ValueError, match="num_key_value_heads"):
        kv_heads_per_rank(3, 2)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        kv_heads_per_rank(2, 3)


def test_more_ranks_than_cores_needs_the_override():
    from fastdeploy.platforms.cpu_binding import plan_rank_cores

    assert plan_rank_cores(2, {0, 1, 2, 3, 4}, oversubscribe=False) == [frozenset({1, 2}), frozenset({3, 4})]
    with pytest.raises(ValueError, match=r"3 parallel ranks .* need at least 3 CPU cores.*FD_CPU_OVERSUBSCRIBE=1"):
        plan_rank_cores(3, {0, 1}, oversubscribe=False)
    assert plan_rank_cores(3, {0, 1}, oversubscribe=True) == [frozenset({0}), frozenset({1}), frozenset({0})]


def test_gguf_blocks_shard_whole_blocks_only():
    from fastdeploy.model_executor.layers.tp_shard import shard_tensor
    from fastdeploy.transformers_utils.gguf_utils import GGUFBlocks

    # Q8_0: blocks of 32 values in 34 bytes; a [4, 64] matrix is 2 blocks per row.
    data = np.arange(4 * 68, dtype=np.uint8).reshape(4, 68)
    blocks = GGUFBlocks("w", 8, (4, 64), data)
    cols = shard_tensor(blocks, 1, 32, 32, "RowParallelLinear")
    assert cols.shape == (4, 32) and (cols.data == data[:, 34:]).all()
    rows = shard_tensor(blocks, 0, 2, 2, "ColumnParallelLinear")
    assert rows.shape == (2, 64) and (rows.data == data[2:]).all()
    with pytest.raises(ValueError, match="whole blocks"):
        shard_tensor(blocks, 1, 16, 16, "RowParallelLinear")
    # Real Q4_1 blocks: the rank's columns dequantize to exactly the whole matrix's columns.

    from fastdeploy.model_executor.layers.quantization.gguf import dequantize_rows, pack_blocks, random_blocks

    q41 = GGUFBlocks("w", 3, (6, 192), random_blocks(3, 6, 192, np.random.default_rng(0)))
    whole = dequantize_rows(pack_blocks(q41.data, 3, 6, 192), 3, 6, 192).numpy()
    for rank in range(3):
        part = shard_tensor(q41, 1, rank * 64, 64, "RowParallelLinear")
        got = dequantize_rows(pack_blocks(part.data, 3, 6, 64), 3, 6, 64).numpy()
        np.testing.assert_array_equal(got, whole[:, rank * 64:(rank + 1) * 64])
    # Dense arrays past the end (vocabulary padding) are zero rows.
    padded = shard_tensor(np.ones((5, 2)), 0, 3, 3, "ParallelLMHead")
    assert padded.tolist() == [[1, 1], [1, 1], [0, 0]]


def test_paddleformers_backend_is_refused_under_tp(tmp_path):
    from fastdeploy.engine.arg_utils import EngineArgs

    path = build_tiny_checkpoint("Phi3ForCausalLM", tmp_path / "phi3")  # no native class: "auto" is PaddleFormers
    for impl in ("auto", "paddleformers"):
        with pytest.raises(ValueError, match="not supported by the PaddleFormers backend"):
            EngineArgs(model=path, tensor_parallel_size=2, model_impl=impl).create_engine_config()


def test_dp_and_pd_together_are_refused():
    from fastdeploy.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="--data-parallel-size > 1 with prefill/decode"):
        EngineArgs(data_parallel_size=2, splitwise_role="prefill").create_engine_config()


def test_lazy_bf16_widens_only_the_slice_read():
    from fastdeploy.model_executor.model_loader.weight_utils import LazyBF16

    values = np.array([[1.0, -2.5], [3.25, 0.5], [7.0, 8.0]], dtype=np.float32)
    lazy = LazyBF16((values.view(np.uint32) >> 16).astype(np.uint16))
    assert lazy.shape == (3, 2) and lazy[1:].tolist() == values[1:].tolist()
    assert np.asarray(lazy).T.tolist() == lazy.T.tolist() == values.T.tolist()


def test_models_whose_layers_do_not_shard_are_refused_under_tp(tmp_path):
    from fastdeploy.engine.arg_utils import EngineArgs

    path = build_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path / "moe")  # the experts hold every weight whole
    with pytest.raises(ValueError, match="not supported for Qwen3MoeForCausalLM"):
        EngineArgs(model=path, tensor_parallel_size=2).create_engine_config()


def test_speculative_decoding_is_refused_under_tp(tmp_path):
    from fastdeploy.engine.arg_utils import EngineArgs

    path = build_tiny_checkpoint("LlamaForCausalLM", tmp_path / "llama")
    with pytest.raises(ValueError, match="--tensor-parallel-size > 1 with --speculative-config"):
        EngineArgs(model=path, tensor_parallel_size=2,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_engine_config()
