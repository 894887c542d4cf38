"""Prefill/decode disaggregation inside the engine: two LLMs hand a request's KV cache over.

The prefill LLM runs the prompt with ``kv_transfer_params.do_remote_decode`` and keeps the
blocks; the decode LLM receives them (pulled, or pushed by the prefill side) and generates.
Greedy outputs and logprobs must equal a single mixed engine's.
"""

from __future__ import annotations

import time

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.exceptions import EngineGenerateError

ENGINE_KWARGS = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20, dtype="float32", max_num_seqs=8)
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    # Several KV blocks (16 tokens each), with a partial last block.
    "Here is a list of the planets of the solar system, from the closest to the Sun to the farthest: "
    "Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus and Neptune. The largest of them is",
]


@pytest.fixture(scope="module")
def engines():
    mixed = LLM(**ENGINE_KWARGS)
    prefill = LLM(splitwise_role="prefill", **ENGINE_KWARGS)
    decode = LLM(kv_transfer_config={"kv_connector": "FastDeployConnector", "kv_role": "kv_consumer"},
                 **ENGINE_KWARGS)
    return mixed, prefill, decode


def core(llm: LLM):
    return llm.llm_engine.engine_core


def prefill_params(prefill: LLM, prompt: str, extra: dict | None = None) -> dict:
    params = SamplingParams(max_tokens=1, temperature=0,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True, **(extra or {})}})
    output = prefill.generate(prompt, params, use_tqdm=False)[0]
    assert output.kv_transfer_params["do_remote_prefill"] is True
    return output.kv_transfer_params


def decode_params(kv_params: dict, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, extra_args={"kv_transfer_params": kv_params}, **kwargs)


def step_until_released(llm: LLM, timeout: float = 10.0) -> None:
    """Step an idle engine until its handed-over blocks are freed (the offline LLM does not loop)."""
    deadline = time.monotonic() + timeout
    scheduler = core(llm).scheduler
    while scheduler.held_for_transfer and time.monotonic() < deadline:
        core(llm).step()
        time.sleep(0.01)
    assert not scheduler.held_for_transfer


def test_pulled_kv_gives_the_mixed_greedy_output_and_logprobs(engines):
    mixed, prefill, decode = engines
    sampling = dict(max_tokens=16, logprobs=3)
    expected = mixed.generate(PROMPTS, SamplingParams(temperature=0, **sampling), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        kv_params = prefill_params(prefill, prompt)
        assert len(kv_params["remote_block_ids"]) == -(-len(want.prompt_token_ids) // 16)
        got = decode.generate(prompt, decode_params(kv_params, **sampling), use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.outputs[0].token_ids, prompt
        assert got.text == want.outputs[0].text
        # The first token is sampled on the decode side, so its logprobs are there too.
        for got_step, want_step in zip(got.logprobs, want.outputs[0].logprobs, strict=True):
            assert got_step.keys() == want_step.keys()
            for token_id, lp in want_step.items():
                assert got_step[token_id].logprob == pytest.approx(lp.logprob, abs=1e-4)
    step_until_released(prefill)
    assert core(prefill).scheduler.kv_cache_manager.num_used_blocks == 0
    assert core(decode).scheduler.kv_cache_manager.num_used_blocks == 0
    metrics = core(decode).kv_transfer.connector.metrics
    assert metrics.total("requests", "recv") == len(PROMPTS)
    assert metrics.total("blocks", "recv") == sum(-(-len(p.prompt_token_ids) // 16) for p in expected)


def test_concurrent_protocol_prefill_pushes_into_preallocated_blocks(engines):
    mixed, prefill, decode = engines
    prompt = PROMPTS[2]
    want = mixed.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    address = core(decode).kv_transfer.address
    # The decode side allocates first and waits; the prefill side then pushes to it.
    decode_engine = decode.llm_engine
    decode_engine.add_request("pd-concurrent", prompt, decode_params(
        {"do_remote_prefill": True, "mode": "concurrent", "remote_request_id": "router-id-1"}, max_tokens=12))
    decode_engine.step()
    assert "pd-concurrent" in core(decode).scheduler.waiting_for_kv
    prefill_params(prefill, prompt, {"mode": "concurrent", "remote_host": address.host,
                                     "remote_port": address.port, "remote_host_id": address.host_id,
                                     "remote_request_id": "router-id-1"})
    outputs = []
    deadline = time.monotonic() + 60
    while decode_engine.has_unfinished_requests() and time.monotonic() < deadline:
        outputs.extend(o for o in decode_engine.step() if o.finished)
    assert [o.outputs[0].token_ids for o in outputs] == [want.token_ids]
    step_until_released(prefill)


def test_a_failed_transfer_fails_the_request_and_frees_its_blocks(engines):
    _, prefill, decode = engines
    address = core(prefill).kv_transfer.address
    bogus = {"do_remote_prefill": True, "remote_host": address.host, "remote_port": address.port,
             "remote_request_id": "never-prefilled", "remote_host_id": address.host_id}
    with pytest.raises(EngineGenerateError, match="KV cache transfer from the prefill instance failed"):
        decode.generate("The capital of France is", decode_params(bogus, max_tokens=4), use_tqdm=False)
    assert core(decode).scheduler.kv_cache_manager.num_used_blocks == 0
    assert not core(decode).scheduler.waiting_for_kv
    # The engine keeps serving.
    assert decode.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=2),
                           use_tqdm=False)[0].outputs[0].text


def test_aborting_a_request_that_waits_for_kv_frees_its_blocks(engines):
    _, _, decode = engines
    engine = decode.llm_engine
    engine.add_request("pd-abort", "The capital of France is", decode_params(
        {"do_remote_prefill": True, "mode": "concurrent", "remote_request_id": "nobody-sends"}, max_tokens=4))
    engine.step()
    assert core(decode).scheduler.kv_cache_manager.num_used_blocks > 0
    engine.abort_request("pd-abort")
    assert core(decode).scheduler.kv_cache_manager.num_used_blocks == 0
    assert not engine.has_unfinished_requests()


def test_kv_transfer_params_need_a_disaggregated_instance(engines):
    mixed, _, decode = engines
    with pytest.raises(ValueError, match="runs without KV transfer"):
        mixed.generate("Hi", decode_params({"do_remote_prefill": True}, max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="n=1"):
        decode.generate("Hi", SamplingParams(n=2, max_tokens=2, extra_args={"kv_transfer_params": {
            "do_remote_prefill": True}}), use_tqdm=False)


def test_role_flags_resolve_into_the_kv_transfer_config():
    from fastdeploy.config import KVTransferConfig

    assert KVTransferConfig.from_flags("decode").enabled
    assert KVTransferConfig.from_flags(kv_transfer_config={"kv_role": "kv_producer", "kv_port": 7100}).role == "prefill"
    config = KVTransferConfig.from_flags("mixed", pd_comm_port=[7200], cache_transfer_protocol="ipc")
    assert (config.enabled, config.port, config.protocol) == (True, 7200, "shm")
    assert KVTransferConfig.from_flags(cache_transfer_protocol="ipc,rdma").protocol == "auto"
    assert not KVTransferConfig.from_flags().enabled
    with pytest.raises(ValueError, match="contradicts"):
        KVTransferConfig.from_flags("prefill", {"kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="cache-transfer-protocol"):
        KVTransferConfig.from_flags("prefill", cache_transfer_protocol="carrier-pigeon")
