"""Image content parts of chat messages (vLLM's ``chat_utils`` for images).

Accepted parts: ``{"type": "image_url", "image_url": {"url": ...}}`` (or the URL as a string),
and offline ``{"type": "image_pil", "image_pil": PIL.Image}`` / ``{"type": "image", "image": ...}``.
Each becomes ``{"type": "image"}`` in the content the chat template sees, so the model's own
template writes its image placeholder, and the image itself is appended to ``images``.
"""

from __future__ import annotations

from typing import Any

from fastdeploy.multimodal.media import MediaConnector

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")
TEXT_PART_TYPES = ("text", "input_text", "output_text")


def load_image_part(part: dict[str, Any], connector: MediaConnector) -> Any:
    """The PIL image of one image content part."""
    from PIL import Image

    part_type = part.get("type")
    if part_type == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not url:
            raise ValueError("An image_url content part needs image_url.url.")
        return connector.fetch_image(url)
    value = part.get(part_type)
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, str):
        return connector.fetch_image(value)
    raise ValueError(f"Content part {part_type!r} needs a PIL image or a URL, got {type(value).__name__}.")


def template_content(parts: list[dict[str, Any]], connector: MediaConnector, images: list[Any]) -> str | list[dict]:
    """A message's parts for the chat template: text parts joined as before when it has no image,
    else the list of ``{"type": "text", ...}`` / ``{"type": "image"}`` parts (images appended to ``images``)."""
    if not any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in parts):
        return "\n".join(str(p.get("text", "")) for p in parts)
    out: list[dict] = []
    for part in parts:
        part_type = part.get("type")
        if part_type in TEXT_PART_TYPES:
            out.append({"type": "text", "text": str(part.get("text", ""))})
        elif part_type in IMAGE_PART_TYPES:
            images.append(load_image_part(part, connector))
            out.append({"type": "image"})
        else:
            raise ValueError(f"Content part type {part_type!r} is not supported; supported: "
                             f"{list(TEXT_PART_TYPES + IMAGE_PART_TYPES)}.")
    return out
