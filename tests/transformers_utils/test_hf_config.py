"""get_hf_config: HF folders and GGUF files (architectures and special ids filled, cached)."""

import os
import time

import pytest
import transformers

from fastdeploy.transformers_utils.config import get_hf_config
from fastdeploy.transformers_utils.gguf_utils import gguf_cache_dir, read_gguf_metadata
from fastdeploy.transformers_utils.model_resolver import resolve_model


def test_folder_config(tmp_path):
    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4)
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    loaded = get_hf_config(str(tmp_path), None, False)
    assert loaded.model_type == "qwen2"
    assert loaded.architectures == ["Qwen2ForCausalLM"]


def test_gguf_config_is_complete_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FD_CACHE_ROOT", str(tmp_path))
    folder, gguf = resolve_model(None)
    cfg = get_hf_config(folder, gguf, False)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert cfg.num_hidden_layers == 30 and cfg.hidden_size == 576
    assert cfg.num_attention_heads == 9 and cfg.num_key_value_heads == 3
    assert cfg.tie_word_embeddings
    assert cfg.max_position_embeddings == 8192
    cache = gguf_cache_dir(os.path.join(folder, gguf))
    assert cache.startswith(str(tmp_path)) and os.path.isfile(os.path.join(cache, "config.json"))

    start = time.perf_counter()
    again = get_hf_config(folder, gguf, False)
    assert time.perf_counter() - start < 1.0
    assert again.to_dict() == cfg.to_dict()


def test_gguf_metadata_reader_matches_gguf_package():
    gguf = pytest.importorskip("gguf")
    folder, name = resolve_model(None)
    path = os.path.join(folder, name)
    meta = read_gguf_metadata(path)
    reader = gguf.GGUFReader(path)
    for key in ("general.architecture", "llama.block_count", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert meta[key] == reader.fields[key].contents()
    assert meta["tokenizer.ggml.tokens"][:20] == reader.fields["tokenizer.ggml.tokens"].contents()[:20]
    assert len(meta["tokenizer.ggml.merges"]) == len(reader.fields["tokenizer.ggml.merges"].data)
