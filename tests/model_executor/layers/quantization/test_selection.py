"""Which quantization a model gets at start-up: a GGUF file's blocks by default, ``-q none``, and the refusals."""

import json
import os
import shutil

import pytest

from fastdeploy.engine.arg_utils import EngineArgs
from fastdeploy.model_executor.layers.quantization import selection
from fastdeploy.platforms import current_platform
from fastdeploy.transformers_utils.model_resolver import resolve_model

ENGINE = {"max_model_len": 256}


def config(**kwargs):
    return EngineArgs(**{**ENGINE, **kwargs}).create_engine_config().model_config


def test_a_gguf_file_is_served_in_its_blocks_by_default_and_none_dequantizes_it(fd_logs):
    assert config().quantization == "gguf"
    assert "served in its own blocks (quantization='gguf'" in fd_logs.text
    assert config(quantization="gguf").quantization == "gguf"
    assert config(quantization="none").quantization is None
    assert "--quantization none: the GGUF file SmolLM2-135M-Instruct.Q4_1.gguf is dequantized at load" in fd_logs.text


@pytest.mark.parametrize("name, why", [("w4a8", "W4A8"), ("w4afp8", "FP8"), ("wint2", "W2A16"), ("w2a16", "W2A16"),
                                       ("block_wise_fp8", "FP8 activations.*--quantization fp8"),
                                       ("wfp8afp8", "FP8 activations.*--quantization fp8"),
                                       ("awq_marlin", "Marlin.*--quantization awq"),
                                       ("gptq_marlin", "Marlin.*--quantization gptq")])
def test_gpu_only_formats_are_refused_by_name_with_the_supported_list(name, why):
    with pytest.raises(ValueError, match=rf"quantization='{name}' is not supported on cpu: .*{why}.*"
                                         r"Supported: awq, fp8, gguf, gptq, w8a8, wint4, wint8 .*'none'"):
        config(quantization=name)


def test_method_names_are_case_insensitive():
    assert config(quantization="GGUF").quantization == "gguf"
    with pytest.raises(ValueError, match=r"quantization='w4a8' is not supported on cpu"):
        config(quantization="W4A8")


def test_an_unknown_method_is_refused_with_the_supported_list():
    with pytest.raises(ValueError, match=r"Unknown quantization method: 'nf5'\. Supported on cpu: awq, fp8, gguf, gptq, w8a8, wint4, wint8"):
        config(quantization="nf5")


def test_a_checkpoint_naming_an_unknown_method_is_refused(tmp_path):
    from tests.model_executor.utils import build_tiny_checkpoint

    path = build_tiny_checkpoint("LlamaForCausalLM", tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "squeezellm", "bits": 4}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"names the method 'squeezellm', which FastDeploy does not know\. "
                                         r"Supported on cpu: awq, fp8, gguf, gptq, w8a8, wint4, wint8"):
        config(model=path)
    cfg["quantization_config"] = {"quant_method": "w4afp8"}  # a known one without CPU instructions
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="quantization='w4afp8' is not supported on cpu"):
        config(model=path)
    with pytest.raises(ValueError, match=r"names the method 'w4afp8', which does not match --quantization 'gguf'"):
        config(model=path, quantization="gguf")


def test_without_the_block_kernels_an_explicit_gguf_fails_at_start_up_and_the_default_falls_back(
        monkeypatch, fd_logs):
    monkeypatch.setattr(type(current_platform), "quantization_unavailable_reason",
                        lambda self, name: "the C++ block kernels are not built (FD_CPU_KERNELS=0)")
    with pytest.raises(ValueError, match=r"quantization='gguf' cannot run here: the C\+\+ block kernels are not built"):
        config(quantization="gguf")
    assert config().quantization is None
    assert "is dequantized at load (more memory than its blocks) instead of served in its blocks: " \
           "quantization='gguf' cannot run here" in fd_logs.text


def test_paddleformers_and_dummy_weights_keep_the_dequantized_path(fd_logs):
    assert config(model_impl="paddleformers").quantization is None
    assert "built for FastDeploy's own model classes" in fd_logs.text
    assert config(load_format="dummy").quantization is None
    with pytest.raises(ValueError, match="model_impl='paddleformers'"):
        config(model_impl="paddleformers", quantization="gguf")
    with pytest.raises(ValueError, match="load_format='dummy' has none to keep"):
        config(load_format="dummy", quantization="gguf")


@pytest.fixture(scope="module")
def gguf_with_an_f16_matrix(tmp_path_factory):
    """A copy of the default model's GGUF whose header says blk.0.ffn_down.weight is F16.

    Only the header changes (the start-up checks read nothing else): the file is never loaded.
    """
    from gguf import GGMLQuantizationType, GGUFReader

    folder, name = resolve_model(None)
    path = str(tmp_path_factory.mktemp("gguf") / name)
    shutil.copyfile(os.path.join(folder, name), path)
    reader = GGUFReader(path, "r+")
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    tensor.field.parts[-2][0] = int(GGMLQuantizationType.F16)  # name, n_dims, dims, type, offset
    reader.data.flush()
    del reader
    return path


def test_a_tensor_type_without_a_kernel_is_refused_at_start_up_by_name(gguf_with_an_f16_matrix, fd_logs):
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk.0.ffn_down.weight' \(F16\) of .* has a type that "
                                         r"quantization='gguf' has no kernel for; supported: Q8_0, .*Q6_K\. "
                                         "Serve the file with --quantization none"):
        config(model=gguf_with_an_f16_matrix, quantization="gguf")
    # Without -q the file is still served, dequantized, and the log says why.
    assert config(model=gguf_with_an_f16_matrix).quantization is None
    assert "'blk.0.ffn_down.weight' (F16)" in fd_logs.text


def test_the_supported_list_is_the_registry_seen_through_the_platform(monkeypatch):
    assert selection.supported_methods(current_platform) == ["awq", "fp8", "gguf", "gptq", "w8a8", "wint4", "wint8"]
    monkeypatch.setattr(type(current_platform), "supported_quantization", ["gguf", "not-registered"])
    assert selection.supported_methods(current_platform) == ["gguf"]
    with pytest.raises(ValueError, match="Unknown quantization method: 'not-registered'"):
        config(quantization="not-registered")
