"""Turning a prompt and its images into the engine's tokens and features, in the API process.

:class:`MultiModalProcessor` runs the model's Hugging Face image processor (resize, patching,
``image_grid_thw``) on each image and expands each image placeholder token of the prompt to
the image's number of tokens (what the HF processor does to the text); each image becomes a
:class:`~fastdeploy.multimodal.inputs.MultiModalFeatureSpec` with its hash. The model's own chat
template puts one placeholder per image (e.g. Qwen2-VL's ``<|vision_start|><|image_pad|>
<|vision_end|>``); a plain prompt for ``LLM.generate`` spells them itself, as with vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastdeploy.multimodal.hasher import hash_image
from fastdeploy.multimodal.inputs import MultiModalFeatureSpec, TensorData

# vLLM's default --limit-mm-per-prompt for every modality.
DEFAULT_LIMIT_PER_PROMPT = 999
SUPPORTED_MODALITIES = ("image",)


@dataclass(frozen=True)
class _ModelInfo:
    """How one family of architectures takes images."""

    image_processor_cls: str  # transformers class name (PIL/numpy, no torchvision needed)
    placeholder: str  # the token the chat template writes once per image


_MODELS: dict[str, _ModelInfo] = {
    "Qwen2_5_VLForConditionalGeneration": _ModelInfo("Qwen2VLImageProcessor", "<|image_pad|>"),
    "PaddleOCRVLForConditionalGeneration": _ModelInfo("PaddleOCRVLImageProcessor", "<|IMAGE_PLACEHOLDER|>"),
    "Ernie4_5_VLMoeForConditionalGeneration": _ModelInfo("Ernie4_5_VLMoeImageProcessor", "<|IMAGE_PLACEHOLDER|>"),
}


def is_multimodal_architecture(architectures: Sequence[str]) -> bool:
    return any(a in _MODELS for a in architectures)


def _image_processor(info: _ModelInfo, model_path: str, hf_config: Any) -> Any:
    import transformers

    cls = getattr(transformers, info.image_processor_cls)
    if os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        return cls.from_pretrained(model_path)
    vc = hf_config.vision_config  # no preprocessor config: the processor's defaults at the tower's sizes
    return cls(patch_size=vc.patch_size, temporal_patch_size=getattr(vc, "temporal_patch_size", 1),
               merge_size=vc.spatial_merge_size)


class MultiModalProcessor:
    """Images of one prompt -> expanded token ids and features (one instance per model)."""

    def __init__(self, model_config: Any, tokenizer: Any) -> None:
        archs = model_config.architectures
        arch = next((a for a in archs if a in _MODELS), None)
        if arch is None:
            raise ValueError(f"{archs[0] if archs else 'This model'} is not a multimodal model: it takes no image, "
                             "video or audio inputs. Send text only.")
        self.info = _MODELS[arch]
        hf_config = model_config.hf_config
        self.model_id = model_config.model
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(hf_config.vision_config.spatial_merge_size)
        self.image_processor = _image_processor(self.info, model_config.model_path, hf_config)
        self.limits = {m: DEFAULT_LIMIT_PER_PROMPT for m in SUPPORTED_MODALITIES}
        for modality, limit in (model_config.limit_mm_per_prompt or {}).items():
            if not isinstance(limit, int) or limit < 0:
                raise ValueError(f"--limit-mm-per-prompt: the limit of {modality!r} must be a non-negative integer, "
                                 f"got {limit!r}.")
            self.limits[modality] = limit

    def check_limits(self, counts: Mapping[str, int]) -> None:
        """vLLM's --limit-mm-per-prompt check (and modalities the model does not take)."""
        for modality, count in counts.items():
            if modality not in SUPPORTED_MODALITIES:
                raise ValueError(f"This model does not take {modality!r} inputs; supported: {list(SUPPORTED_MODALITIES)}.")
            limit = self.limits[modality]
            if count > limit:
                raise ValueError(f"You set or defaulted to '{{\"{modality}\": {limit}}}' in `--limit-mm-per-prompt`, "
                                 f"but passed {count} {modality} items in the same prompt.")

    def process(self, token_ids: list[int], mm_data: Mapping[str, Any],
                mm_processor_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """The prompt's ids with each image placeholder expanded, and one feature per image."""
        from PIL import Image

        if not isinstance(mm_data, Mapping):
            raise ValueError(f"multi_modal_data must be a dict such as {{'image': image}}, got {type(mm_data).__name__}.")
        items = {m: (v if isinstance(v, (list, tuple)) else [v]) for m, v in mm_data.items() if v is not None}
        self.check_limits({m: len(v) for m, v in items.items()})
        images = items.get("image", [])
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ValueError(f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, got {type(image).__name__}.")
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(f"The prompt has {len(slots)} image placeholders ({self.info.placeholder!r}) but "
                             f"{len(images)} images were given: each image needs one placeholder (the chat template "
                             "writes them).")
        kwargs = dict(mm_processor_kwargs or {})
        out_ids: list[int] = []
        features: list[MultiModalFeatureSpec] = []
        prev = 0
        for slot, image in zip(slots, images, strict=True):
            processed = self.image_processor(images=[image.convert("RGB")], return_tensors="np", **kwargs)
            grid = [int(v) for v in np.asarray(processed["image_grid_thw"]).reshape(-1)]
            length = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
            out_ids.extend(token_ids[prev:slot])
            features.append(MultiModalFeatureSpec(
                "image", hash_image(image, self.model_id, kwargs), len(out_ids), length,
                TensorData.from_array(np.asarray(processed["pixel_values"], dtype=np.float32)), grid))
            out_ids.extend([self.image_token_id] * length)
            prev = slot + 1
        out_ids.extend(token_ids[prev:])
        return out_ids, features
