"""Content hashes of multimodal items (vLLM's ``MultiModalHasher``).

An image's hash covers its mode, size and pixels, the model and the processor options, so the
same picture sent twice (as base64 or from a URL) has one hash, and two pictures never share
one. It keys the encoder cache and enters the prefix-cache hashes of the blocks its
placeholder tokens fill.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from PIL import Image


def hash_image(image: Image.Image, model_id: str, processor_kwargs: dict[str, Any] | None = None) -> str:
    """Hex digest of one image as the model will see it."""
    h = hashlib.blake2b(digest_size=32)
    h.update(model_id.encode())
    h.update(json.dumps(processor_kwargs or {}, sort_keys=True, default=str).encode())
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}".encode())
    h.update(image.tobytes())
    return h.hexdigest()
