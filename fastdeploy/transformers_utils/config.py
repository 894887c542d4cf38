"""Load the Hugging Face config of a local model folder or GGUF file."""

from __future__ import annotations

import os
import shutil
import tempfile

from transformers import AutoConfig, PretrainedConfig

from fastdeploy.logger import init_logger
from fastdeploy.transformers_utils.gguf_utils import gguf_cache_dir, read_gguf_metadata

logger = init_logger(__name__)

# GGUF general.architecture -> HF architecture, where it differs from transformers'
# model_type -> CausalLM mapping (used for everything else).
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# MoE sizes transformers' GGUF config reader leaves out: GGUF key (after "<arch>.") -> config field.
_GGUF_MOE_FIELDS = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def _causal_lm_architecture(model_type: str) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def _patch_gguf_config(config: PretrainedConfig, gguf_path: str) -> None:
    """Fill what transformers' GGUF config reader leaves out or may get wrong."""
    meta = read_gguf_metadata(gguf_path)
    if not getattr(config, "architectures", None):
        arch = _GGUF_ARCHITECTURES.get(str(meta.get("general.architecture", "")))
        arch = arch or _causal_lm_architecture(config.model_type)
        if arch:
            config.architectures = [arch]
    gguf_arch = str(meta.get("general.architecture", ""))
    for key, field in _GGUF_MOE_FIELDS.items():
        value = meta.get(f"{gguf_arch}.{key}")
        if value is not None:
            setattr(config, field, int(value))
    # The special token ids the GGUF file declares are the ones its chat format uses.
    for attr, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            setattr(config, attr, int(value))


def _save_atomically(config: PretrainedConfig, folder: str) -> None:
    """Write config.json into ``folder`` so that concurrent readers never see a partial file."""
    os.makedirs(folder, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=folder, prefix=".tmp-config-")
    try:
        config.save_pretrained(tmp)
        os.replace(os.path.join(tmp, "config.json"), os.path.join(folder, "config.json"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def get_gguf_config(model_path: str, gguf_file: str) -> PretrainedConfig:
    """HF config of a GGUF file, cached as config.json under ``FD_CACHE_ROOT`` (parsing takes seconds)."""
    gguf_path = os.path.join(model_path, gguf_file)
    cache_dir = gguf_cache_dir(gguf_path)
    cached = os.path.join(cache_dir, "config.json")
    if os.path.isfile(cached):
        try:
            config = AutoConfig.from_pretrained(cache_dir)
            config._name_or_path = model_path  # as if read from the model itself
            return config
        except Exception as e:  # noqa: BLE001 - a damaged cache entry is rebuilt below
            logger.warning("Ignoring unreadable cached config %s: %s", cached, e)
    if read_gguf_metadata(gguf_path).get("general.architecture") == "deepseek2":
        # transformers has no GGUF mapping for llama.cpp's deepseek2: ours.
        from fastdeploy.transformers_utils.gguf_deepseek2 import deepseek2_hf_config
        from fastdeploy.transformers_utils.gguf_utils import read_gguf_tensor_infos

        names = {info.name for info in read_gguf_tensor_infos(gguf_path)}
        config = deepseek2_hf_config(read_gguf_metadata(gguf_path), names)
        config._name_or_path = model_path
    else:
        config = AutoConfig.from_pretrained(model_path, gguf_file=gguf_file)
    _patch_gguf_config(config, gguf_path)
    try:
        _save_atomically(config, cache_dir)
    except OSError as e:
        logger.warning("Could not cache the GGUF config in %s: %s", cache_dir, e)
    return config


def get_hf_config(model_path: str, gguf_file: str | None = None, trust_remote_code: bool = False) -> PretrainedConfig:
    """The ``transformers`` config of a local model.

    Args:
        model_path: local folder (with config.json, or holding ``gguf_file``).
        gguf_file: file name of a GGUF checkpoint inside ``model_path``, or None.
        trust_remote_code: passed to ``AutoConfig`` for folders with custom code.

    For GGUF files, ``architectures`` is always set (e.g. ``["LlamaForCausalLM"]``) and
    bos/eos/pad ids come from the file's ``tokenizer.ggml.*_token_id`` metadata.
    """
    if gguf_file is not None:
        return get_gguf_config(model_path, gguf_file)
    return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
