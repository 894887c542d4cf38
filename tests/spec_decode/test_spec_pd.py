"""The decode side of PD disaggregation with speculation: the prompt's KV arrives, drafts follow."""

from fastdeploy import LLM, SamplingParams

KW = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20, max_num_seqs=4)
PROMPT = "one two three four five, one two three four five, one two three four five, one two three"


def test_decode_instance_speculates_and_matches_a_mixed_instance(smol_llm):
    prefill = LLM(splitwise_role="prefill", **KW)
    decode = LLM(kv_transfer_config={"kv_connector": "FastDeployConnector", "kv_role": "kv_consumer"},
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                     "prompt_lookup_max": 3}, **KW)
    first = prefill.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, extra_args={
        "kv_transfer_params": {"do_remote_decode": True}}), use_tqdm=False)[0]
    params = SamplingParams(temperature=0, max_tokens=24, extra_args={"kv_transfer_params": first.kv_transfer_params})
    got = decode.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    want = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert got == want.outputs[0].token_ids
    assert decode.llm_engine.spec_decode_totals.stats.num_accepted_tokens > 0
