"""One server with -dp 2 -tp 2 (two engines, each driving two tensor-parallel ranks) behind the openai SDK.

The model is a tiny random Llama with SmolLM2's tokenizer (SmolLM2's own 9 heads do not split
over 2 ranks). Each request runs on exactly one engine, both engines serve (the per-engine
metrics say so), the answers equal one engine at one rank, and a rank that dies fails the
server cleanly: /health 503, exit non-zero. 4 ranks on this 2-core machine: FD_CPU_OVERSUBSCRIBE=1.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.entrypoints.openai.remote_server import RemoteOpenAIServer
from tests.model_executor.utils import build_tiny_checkpoint

pytestmark = pytest.mark.slow

PROMPTS = [f"Request number {i} asks about {topic}" for i, topic in enumerate(
    ["cats", "the sea", "paddle", "servers", "rain", "trains", "maps", "bread"])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import AutoTokenizer

    from fastdeploy.transformers_utils.model_resolver import resolve_model

    path = tmp_path_factory.mktemp("tiny-llama-smol-tokenizer")
    folder, gguf_file = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    build_tiny_checkpoint("LlamaForCausalLM", path, vocab_size=len(tokenizer), max_position_embeddings=512)
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir):
    args = [model_dir, "--served-model-name", "tiny", "-tp", "2", "-dp", "2", "--dtype", "float32",
            "--max-model-len", "256", "--kv-cache-memory-bytes", "16M", "--uvicorn-log-level", "warning"]
    srv = RemoteOpenAIServer(args, env={"FD_CPU_OVERSUBSCRIBE": "1"}, timeout_s=600, cli=True)
    try:
        yield srv
    finally:
        srv.stop()


def test_dp2_tp2_serves_the_openai_sdk_like_one_engine(server, model_dir):
    from fastdeploy import LLM, SamplingParams

    client = server.get_client(timeout=300)

    def complete(prompt: str) -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(complete, PROMPTS))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.choices[0].message.content is not None

    # One engine at one rank gives the same answers.
    reference = LLM(model_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    want = [o.outputs[0].text for o in reference.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))]
    assert texts == want

    # Every request finished on exactly one engine, and both engines took some.
    per_engine = [server.metric("vllm:request_success_total", engine=str(e)) for e in (0, 1)]
    assert sum(per_engine) == len(PROMPTS) + 1, per_engine
    assert min(per_engine) > 0, per_engine
    assert server.metric("vllm:generation_tokens_total", engine="1") > 0


def test_a_dead_rank_fails_the_server(server):
    ranks = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
             if p.ppid() != server.proc.pid and "resource_tracker" not in " ".join(p.cmdline())]
    assert len(ranks) == 4, [p.cmdline() for p in ranks]  # two engines x two ranks
    ranks[-1].kill()
    statuses = []
    deadline = time.monotonic() + 60
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            statuses.append(httpx.get(server.url_for("health"), timeout=2).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert server.proc.wait(30) != 0
    assert 200 not in statuses[-3:]
    assert "died unexpectedly" in server.log_tail(400)
