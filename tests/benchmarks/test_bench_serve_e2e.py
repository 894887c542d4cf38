"""``fastdeploy bench serve`` end to end against a real ``fastdeploy serve`` subprocess."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "entrypoints", "openai"))
from remote_server import DEFAULT_SERVER_ARGS, MODEL_NAME, RemoteOpenAIServer  # noqa: E402

from fastdeploy.entrypoints.cli.main import main  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with RemoteOpenAIServer(DEFAULT_SERVER_ARGS, cli=True) as srv:
        yield srv


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_bench_serve_json(server, tmp_path, capsys, backend):
    main(["bench", "serve", "--backend", backend, "--port", str(server.port), "--num-prompts", "4",
          "--random-input-len", "32", "--random-output-len", "8", "--ignore-eos", "--max-concurrency", "2",
          "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "r.json",
          "--percentile-metrics", "ttft,tpot,itl,e2el", "--metadata", "server=fastdeploy", "--disable-tqdm"])
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out and "Median TPOT (ms):" in out
    result = json.loads((tmp_path / "r.json").read_text())
    # --model was not given: the served model's name comes from /v1/models, and its tokenizer resolves offline.
    assert result["model_id"] == MODEL_NAME and result["endpoint_type"] == backend
    assert result["server"] == "fastdeploy" and result["request_rate"] == "inf" and result["max_concurrency"] == 2
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_input_tokens"] == 4 * 32
    # ignore_eos: every request generates exactly the asked-for tokens, as the server's usage reports.
    assert result["total_output_tokens"] == 4 * 8 and result["output_lens"] == [8] * 4
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert result[f"{stat}_{metric}_ms"] >= 0
    assert result["mean_ttft_ms"] > 0 and result["median_tpot_ms"] > 0 and result["output_throughput"] > 0
    assert result["max_concurrent_requests"] <= 2 and len(result["itls"]) == 4
