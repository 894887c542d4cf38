"""An architecture with no native implementation (Phi-3) served through PaddleFormers by the real server."""

import pytest

from tests.entrypoints.openai.remote_server import RemoteOpenAIServer
from tests.model_executor.utils import build_tiny_checkpoint, hf_greedy, load_hf_model

pytestmark = pytest.mark.slow


def test_phi3_serves_with_model_impl_auto_and_matches_transformers(tmp_path):
    from fastdeploy.transformers_utils.model_resolver import resolve_model
    from fastdeploy.transformers_utils.tokenizer import get_tokenizer

    # SmolLM2's tokenizer gives the tiny checkpoint a real vocabulary the server can use.
    path, gguf = resolve_model(None)
    tokenizer = get_tokenizer(path, gguf_file=gguf)
    folder = build_tiny_checkpoint("Phi3ForCausalLM", tmp_path / "phi3", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(folder)
    prompt = tokenizer.encode("The capital of France is")
    expected = hf_greedy(load_hf_model(folder), prompt, 16)

    args = ["--model", folder, "--max-model-len", "256", "--kv-cache-memory-bytes", "64M", "--dtype", "float32",
            "--disable-log-stats", "--uvicorn-log-level", "warning"]
    with RemoteOpenAIServer(args) as server:
        client = server.get_client()
        out = client.completions.create(model=folder, prompt=prompt, max_tokens=16, temperature=0.0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        choice = out.choices[0]
        assert choice.token_ids == expected
        assert choice.text == tokenizer.decode(expected)
