"""DeepSeek-V2 / V3 against transformers on tiny random checkpoints, and the MLA latent cache.

The V3 checkpoint has a q LoRA, YaRN with DeepSeek's mscale (so the softmax scale carries
``mscale ** 2``) and sigmoid grouped routing with a correction bias; the V2 one has no q LoRA
(V2-Lite's ``q_proj``) and softmax greedy routing. Layer 0 is dense, the others MoE.
"""

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers.attention.kv_cache_spec import MLAAttentionSpec
from fastdeploy.model_executor.layers.attention.mla_attn import MLAAttentionImpl
from fastdeploy.model_executor.models.registry import ModelRegistry
from tests.model_executor.utils import (
    TINY_VOCAB,
    PagedRunner,
    build_tiny_checkpoint,
    greedy_generate,
    hf_greedy,
    hf_logits,
    load_hf_model,
    load_our_model,
    prefill_logits,
)

DEEPSEEK = ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"]


@pytest.fixture(scope="module", params=DEEPSEEK)
def tiny(request, tmp_path_factory):
    """(architecture, our model, transformers model, checkpoint folder)."""
    path = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), num_hidden_layers=3)
    if request.param == "DeepseekV3ForCausalLM":
        _randomize_correction_bias(path)
    return request.param, load_our_model(path), load_hf_model(path), path


def _randomize_correction_bias(path):
    """transformers keeps e_score_correction_bias a zero buffer; a random one makes it change the choice."""
    import torch
    from safetensors.torch import load_file, save_file

    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = 0.2 * torch.randn(tensors[name].shape, generator=gen)
    save_file(tensors, file, metadata={"format": "pt"})


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, TINY_VOCAB, n).tolist()


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_model_class_and_latent_cache_spec(tiny):
    arch, ours, _, _ = tiny
    assert type(ours) is ModelRegistry.resolve_model_cls([arch])
    cfg = ours.config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert ours.get_kv_cache_spec() == [MLAAttentionSpec(1, latent, "float32")] * 3
    # One latent per token and layer: 3 layers x 48 fp32 values, not 2 x heads x head_dim.
    assert MLAAttentionSpec(1, latent, "float32").page_size_bytes(16) == 16 * 48 * 4


@pytest.mark.parametrize("prefill_chunk", [None, 5])
def test_greedy_matches_generate(tiny, prefill_chunk):
    _, ours, hf, _ = tiny
    for seed, n in [(1, 11), (2, 7), (3, 19)]:
        prompt = _prompt(n, seed=seed)
        got, first_logits = greedy_generate(ours, prompt, 32, block_size=4, prefill_chunk=prefill_chunk)
        assert got == hf_greedy(hf, prompt, 32), (seed, n)
        np.testing.assert_allclose(first_logits, hf_logits(hf, prompt)[-1], atol=1e-4, rtol=0)


def test_prompt_logprobs_match(tiny):
    _, ours, hf, _ = tiny
    prompt = _prompt(23, seed=4)
    ours_lp, hf_lp = _log_softmax(prefill_logits(ours, prompt)), _log_softmax(hf_logits(hf, prompt))
    rows, targets = np.arange(len(prompt) - 1), np.asarray(prompt[1:])
    np.testing.assert_allclose(ours_lp[rows, targets], hf_lp[rows, targets], atol=1e-3, rtol=0)
    np.testing.assert_allclose(ours_lp, hf_lp, atol=1e-3, rtol=0)


def test_mixed_batch_equals_separate(tiny):
    """2 decodes + 2 prefills (one a later chunk over cached context) in one forward."""
    _, ours, _, _ = tiny
    prompts = {sid: _prompt(n, seed=10 + i) for i, (sid, n) in enumerate([("a", 6), ("b", 9), ("c", 7), ("d", 10)])}
    batched = PagedRunner(ours, num_blocks=64, block_size=4, seed=3)
    for sid, p in prompts.items():
        batched.add(sid, p + [5])
    batched.step([("a", 6), ("b", 9), ("d", 4)])  # d: first chunk only
    mixed = batched.step([("a", 1), ("b", 1), ("c", 7), ("d", 6)]).numpy()
    for row, (sid, chunks) in enumerate([("a", [6, 1]), ("b", [9, 1]), ("c", [7]), ("d", [4, 6])]):
        alone = PagedRunner(ours, num_blocks=16, block_size=4, seed=row)
        alone.add(sid, prompts[sid] + [5])
        for n in chunks:
            logits = alone.step([(sid, n)])
        np.testing.assert_allclose(mixed[row], logits.numpy()[0], atol=1e-5, rtol=0)


def test_prefix_cache_hit_gives_same_output(tiny):
    """A second sequence reusing the first one's full latent blocks computes only its tail."""
    _, ours, _, _ = tiny
    shared, tail = _prompt(12, seed=20), _prompt(5, seed=21)
    runner = PagedRunner(ours, num_blocks=32, block_size=4, seed=5)
    runner.add("first", shared + _prompt(3, seed=22))
    runner.step([("first", 15)])
    runner.add("second", shared + tail)
    second = runner.seqs["second"]
    second.blocks = list(runner.seqs["first"].blocks[:3])  # the 12 shared tokens' blocks
    second.num_computed = 12
    hit = runner.step([("second", 5)]).numpy()[0]
    miss, _ = greedy_generate(ours, shared + tail, 1, block_size=4)
    cold = PagedRunner(ours, num_blocks=32, block_size=4, seed=6)
    cold.add(0, shared + tail)
    np.testing.assert_allclose(hit, cold.step([(0, 17)]).numpy()[0], atol=1e-5, rtol=0)
    assert int(np.argmax(hit)) == miss[0]


def test_cache_rows_hold_the_latent(tiny):
    """Each written slot holds ``[kv_a_layernorm(c_kv) ; rope(k_pe)]`` of its token, nothing per head."""
    _, ours, _, _ = tiny
    prompt = _prompt(6, seed=30)
    runner = PagedRunner(ours, num_blocks=8, block_size=4, seed=0)
    runner.add(0, prompt)
    runner.step([(0, 6)])
    cache = runner.kv_caches[0]
    assert len(cache) == 1 and list(cache[0].shape) == [8, 4, 1, 48]
    attn = ours.model.layers[0].self_attn
    x = ours.model.layers[0].input_layernorm(ours.model.embed_tokens(paddle.to_tensor(prompt, dtype="int64")))
    c_kv, k_pe = paddle.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank, attn.rope], axis=-1)
    seq_blocks = runner.seqs[0].blocks
    rows = cache[0].reshape([-1, 48]).numpy()[[seq_blocks[p // 4] * 4 + p % 4 for p in range(6)]]
    np.testing.assert_allclose(rows[:, :32], attn.kv_a_layernorm(c_kv).numpy(), atol=1e-5, rtol=0)
    cos, sin = attn.rotary_emb.get_cos_sin(paddle.arange(6, dtype="int64"))
    k_rot = attn.rotary_emb.rotate(k_pe.unsqueeze(1), cos, sin)[:, 0].numpy()
    np.testing.assert_allclose(rows[:, 32:], k_rot, atol=1e-5, rtol=0)


def test_absorbed_decode_equals_naive(tiny):
    _, ours, _, _ = tiny
    prompt = _prompt(9, seed=40)
    absorbed, _ = greedy_generate(ours, prompt, 8, block_size=4)
    impls = [layer.self_attn.impl for layer in ours.model.layers]
    runs = {}
    try:
        for absorbed_decode in (True, False):
            for impl in impls:
                impl.absorbed_decode = absorbed_decode
            runner = PagedRunner(ours, num_blocks=16, block_size=4, seed=1)
            runner.add(0, prompt + absorbed[:4])
            runner.step([(0, 9)])
            runs[absorbed_decode] = [runner.step([(0, 1)]).numpy()[0] for _ in range(4)]
    finally:
        for impl in impls:
            impl.absorbed_decode = True
    np.testing.assert_allclose(np.stack(runs[True]), np.stack(runs[False]), atol=1e-5, rtol=0)


def test_absorbed_attention_kernel_equals_naive_formulation():
    """Random latents and queries: folding W_UK / W_UV in gives the per-head attention's numbers."""
    rng = np.random.default_rng(0)
    h, nope, rope, v, r, ctx_len = 4, 16, 8, 12, 24, 10
    impl = MLAAttentionImpl(h, nope, rope, v, r, scale=0.3)
    w = paddle.to_tensor(rng.standard_normal((r, h * (nope + v))).astype(np.float32))
    impl.set_kv_b_weight(w)
    q = paddle.to_tensor(rng.standard_normal((3, h, nope + rope)).astype(np.float32))
    ctx = paddle.to_tensor(rng.standard_normal((3, ctx_len, r + rope)).astype(np.float32))
    mask = np.zeros((3, 1, ctx_len), np.float32)
    mask[1, :, 7:] = -np.inf  # a shorter context, padded
    mask = paddle.to_tensor(mask)
    naive = impl.attend_naive(q, ctx, lambda c: paddle.matmul(c, w), mask).numpy()
    # Per-head reference, straight from the definition.
    qn, ctxn, wn = q.numpy(), ctx.numpy(), w.numpy().reshape(r, h, nope + v)
    ref = np.zeros((3, h, v), np.float32)
    for b in range(3):
        n = 7 if b == 1 else ctx_len
        c, k_pe = ctxn[b, :n, :r], ctxn[b, :n, r:]
        for head in range(h):
            k = np.concatenate([c @ wn[:, head, :nope], k_pe], axis=1)
            s = k @ qn[b, head] * 0.3
            p = np.exp(s - s.max())
            ref[b, head] = (p / p.sum()) @ (c @ wn[:, head, nope:])
    np.testing.assert_allclose(naive, ref.reshape(3, h * v), atol=1e-4, rtol=0)
    np.testing.assert_allclose(impl.attend_absorbed(q, ctx, mask).numpy(), naive, atol=1e-4, rtol=0)


def test_routing_matches_transformers(tiny):
    """Our MoE block picks the experts (and weights) transformers' picks, on the same router logits."""
    import torch

    arch, ours, hf, _ = tiny
    rng = np.random.default_rng(50)
    hidden = rng.standard_normal((64, ours.config.hidden_size)).astype(np.float32)
    block, hf_block = ours.model.layers[1].mlp, hf.model.layers[1].mlp
    logits = block.gate(paddle.to_tensor(hidden))
    weights, ids = block.experts.select_experts(logits)
    if arch == "DeepseekV3ForCausalLM":
        assert float(paddle.abs(block.gate.e_score_correction_bias).max()) > 0  # the bias is in play
        hf_ids, hf_weights = hf_block.route_tokens_to_experts(torch.tensor(logits.numpy()))
    else:
        hf_ids, hf_weights = hf_block.route_tokens_to_experts(torch.tensor(logits.numpy())[None])
    order, hf_order = np.argsort(ids.numpy(), axis=1), np.argsort(hf_ids.numpy(), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(ids.numpy(), order, 1),
                                  np.take_along_axis(hf_ids.numpy(), hf_order, 1))
    np.testing.assert_allclose(np.take_along_axis(weights.numpy(), order, 1),
                               np.take_along_axis(hf_weights.detach().numpy(), hf_order, 1), atol=1e-6, rtol=0)
    counts = np.bincount(ids.numpy().ravel(), minlength=8)
    assert counts.max() > 2  # several tokens share experts
    # Three tokens: at most six of the eight experts get one, the rest none; the block's output (shared
    # experts included) is still transformers'.
    few = hidden[:3]
    _, few_ids = block.experts.select_experts(block.gate(paddle.to_tensor(few)))
    assert len(set(few_ids.numpy().ravel().tolist())) < 8
    with torch.no_grad():
        want = hf_block(torch.tensor(few)[None])[0].numpy()
    np.testing.assert_allclose(block(paddle.to_tensor(few)).numpy(), want, atol=1e-5, rtol=0)


def test_group_limited_greedy_matches_its_definition():
    """DeepSeek-V2's group_limited_greedy (transformers 5.3's own crashes): softmax scores, the topk_group groups
    with the best single expert, the top-k (3) experts inside them, weights scaled by routed_scaling_factor."""
    from fastdeploy.model_executor.layers.fused_moe.router import select_experts

    logits = np.random.default_rng(52).standard_normal((64, 8)).astype(np.float32)
    weights, ids = select_experts(paddle.to_tensor(logits), 3, False, num_expert_group=4, topk_group=2,
                                  routed_scaling_factor=1.5)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    limited = 0  # tokens whose plain top-3 reaches outside their best groups: the rule must matter
    for t in range(len(logits)):
        best_groups = np.argsort(-probs[t].reshape(4, 2).max(1))[:2]
        masked = np.zeros(8)
        for g in best_groups:
            masked[2 * g:2 * g + 2] = probs[t, 2 * g:2 * g + 2]
        want = np.argsort(-masked)[:3]
        limited += set(np.argsort(-probs[t])[:3].tolist()) != set(want.tolist())
        assert set(ids.numpy()[t].tolist()) == set(want.tolist()), t
        np.testing.assert_allclose(np.sort(weights.numpy()[t]), np.sort(1.5 * probs[t, want]), atol=1e-6, rtol=0)
    assert limited > 0


def test_grouped_routing_stays_in_topk_groups(tiny):
    """V3: every token's experts lie in at most topk_group of the n_group groups."""
    arch, ours, _, _ = tiny
    if arch != "DeepseekV3ForCausalLM":
        pytest.skip("grouped routing is V3's here")
    c = ours.config
    block = ours.model.layers[1].mlp
    logits = paddle.to_tensor(np.random.default_rng(51).standard_normal((64, c.n_routed_experts)).astype(np.float32))
    _, ids = block.experts.select_experts(logits)
    groups = ids.numpy() // (c.n_routed_experts // c.n_group)
    assert max(len(set(row)) for row in groups.tolist()) <= c.topk_group


@pytest.mark.parametrize("field, value", [
    ("hidden_act", "gelu"),
    ("topk_method", "random"),
    ("scoring_func", "tanh"),
    ("ep_size", 2),
    ("index_topk", 2048),
])
def test_unsupported_fields_are_refused_by_name(tmp_path, field, value):
    from fastdeploy.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM
    from tests.model_executor.utils import tiny_hf_config

    config = tiny_hf_config("DeepseekV3ForCausalLM", num_hidden_layers=2)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        DeepseekV3ForCausalLM(config)


def test_v2_mlp_bias_on_the_dense_and_shared_mlps(tmp_path):
    """DeepSeek-V2's ``mlp_bias``: biases on the dense and shared-expert SwiGLUs (random here: transformers
    initializes them to zero), logits as transformers'."""
    import torch
    from safetensors.torch import load_file, save_file

    path = build_tiny_checkpoint("DeepseekV2ForCausalLM", tmp_path, num_hidden_layers=2, mlp_bias=True)
    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(1)
    biases = [n for n in tensors if ".mlp." in n and n.endswith("_proj.bias")]
    assert len(biases) == 6  # gate / up / down of layer 0's dense MLP and of layer 1's shared expert
    for name in biases:
        tensors[name] = 0.5 * torch.randn(tensors[name].shape, generator=gen)
    save_file(tensors, file, metadata={"format": "pt"})
    prompt = _prompt(9, seed=70)
    np.testing.assert_allclose(prefill_logits(load_our_model(path), prompt), hf_logits(load_hf_model(path), prompt),
                               atol=1e-4, rtol=0)


def test_unsupported_rope_type_is_refused():
    from fastdeploy.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM
    from tests.model_executor.utils import tiny_hf_config

    config = tiny_hf_config("DeepseekV2ForCausalLM", num_hidden_layers=2)
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type"):
        DeepseekV2ForCausalLM(config)


def test_kv_cache_memory_bytes_buys_latent_blocks(tiny):
    """The worker sizes the cache from the model's spec: latent bytes per block, not heads x head_dim."""
    from fastdeploy.engine.arg_utils import EngineArgs
    from fastdeploy.worker.worker import Worker

    _, _, _, path = tiny
    budget = 1 << 20
    config = EngineArgs(model=path, kv_cache_memory_bytes=budget, dtype="float32", block_size=16,
                        skip_tokenizer_init=True).create_engine_config()
    worker = Worker(config)
    worker.load_model()
    per_block = 3 * 16 * 48 * 4  # layers x tokens x (kv_lora_rank + qk_rope_head_dim) x fp32
    assert worker.model_runner.kv_cache_bytes_per_block() == per_block
    num_blocks = worker.determine_num_available_blocks()
    assert num_blocks == budget // per_block
    worker.initialize_cache(num_blocks)
    assert [[list(t.shape) for t in layer] for layer in worker.model_runner.kv_caches] == [[[num_blocks, 16, 1, 48]]] * 3


def test_bfloat16_latent_cache(tmp_path):
    """bf16: the latent cache is bf16 (half the bytes) and written bit-exactly; logits stay near fp32.

    Dense layers only: on random tiny weights bf16 rounding flips near-tied expert choices, which
    says nothing about the attention.
    """
    path = build_tiny_checkpoint("DeepseekV3ForCausalLM", tmp_path, num_hidden_layers=2, first_k_dense_replace=2)
    bf16, fp32 = load_our_model(path, dtype="bfloat16"), load_our_model(path)
    assert bf16.get_kv_cache_spec() == [MLAAttentionSpec(1, 48, "bfloat16")] * 2
    assert bf16.get_kv_cache_spec()[0].page_size_bytes(16) == 16 * 48 * 2
    prompt = _prompt(10, seed=60)
    np.testing.assert_allclose(prefill_logits(bf16, prompt), prefill_logits(fp32, prompt), atol=0.05, rtol=0)
    got, _ = greedy_generate(bf16, prompt, 8, block_size=4, prefill_chunk=4)
    want, _ = greedy_generate(fp32, prompt, 8, block_size=4)
    assert got[:3] == want[:3]


def test_llm_engine_serves_deepseek_with_prefix_cache(tiny):
    """Through the real engine (scheduler, model runner, latent-sized blocks): greedy == transformers, and a
    request sharing a cached prefix gets a hit and the same tokens."""
    from fastdeploy import LLM, SamplingParams

    arch, _, hf, path = tiny
    if arch != "DeepseekV3ForCausalLM":
        pytest.skip("one engine start is enough for the suite: V2 differs only inside the model, tested above")
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=1 << 20, block_size=16,
              max_model_len=256)
    assert llm.llm_engine.engine_core.fd_config.cache_config.num_blocks == (1 << 20) // (3 * 16 * 48 * 4)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [_prompt(40, seed=70), _prompt(9, seed=71)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, p, 32)
    shared = prompts[0][:32] + [7, 8, 9]
    again = llm.generate([{"prompt_token_ids": shared}], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    assert list(again.outputs[0].token_ids) == hf_greedy(hf, shared, 32)


def test_kv_connectors_refuse_the_latent_cache():
    from fastdeploy.distributed.kv_transfer.utils import numpy_kv_caches

    latent = MLAAttentionSpec(1, 48).allocate(4, 16)
    with pytest.raises(ValueError, match="latent"):
        numpy_kv_caches([latent, latent])


def test_real_v2_lite_config_fields():
    """DeepSeek-V2-Lite's own config.json fields: accepted, YaRN's mscale ** 2 in the softmax scale, latent
    bytes per block, dense layer 0 then MoE (and moe_layer_freq spacing the MoE layers)."""
    import math

    import transformers

    from fastdeploy.model_executor.models.deepseek_v2 import check_supported, is_moe_layer, mla_softmax_scale

    config = transformers.DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1, routed_scaling_factor=1.0,
        topk_method="greedy", norm_topk_prob=False, scoring_func="softmax", n_group=1, topk_group=1,
        max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                      "beta_slow": 1, "original_max_position_embeddings": 4096, "rope_theta": 10000},
    )  # fmt: skip
    config.architectures = ["DeepseekV2ForCausalLM"]
    config.ep_size = 1
    check_supported(config)
    m = 0.1 * 0.707 * math.log(40) + 1.0
    assert mla_softmax_scale(config) == pytest.approx(192**-0.5 * m * m)
    assert [is_moe_layer(config, i) for i in range(4)] == [False, True, True, True]
    config.moe_layer_freq = 2
    assert [is_moe_layer(config, i) for i in range(5)] == [False, False, True, False, True]
    # 27 layers x 16 tokens x (512 + 64) bf16 values: 486 KiB a block (full K/V of 16 heads: 2.6 MiB).
    assert MLAAttentionSpec(1, 576, "bfloat16").page_size_bytes(16) * 27 == 27 * 16 * 576 * 2
