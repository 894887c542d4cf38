"""Loading images from the URLs of chat content parts (vLLM's ``MediaConnector``).

- ``data:image/...;base64,...``: decoded in place;
- ``file://...``: only below ``--allowed-local-media-path`` (refused without it);
- ``http(s)://...``: fetched with a timeout (``FD_IMAGE_FETCH_TIMEOUT``) and a size limit
  (``FD_MEDIA_MAX_BYTES``), from the hosts in ``--allowed-media-domains`` when it is set.

Every failure is a :class:`MediaLoadError` (a ``ValueError``): the server answers 400.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from PIL import Image, UnidentifiedImageError

from fastdeploy import envs


class MediaLoadError(ValueError):
    """An image URL that cannot be used: not allowed, unreachable, or not an image."""


def load_image_bytes(data: bytes) -> Image.Image:
    """Decode image file bytes into an RGB PIL image."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as e:
        raise MediaLoadError(f"Failed to load image: {e}") from e
    return image.convert("RGB")


class MediaConnector:
    """Fetches the media of content parts under the server's media flags."""

    def __init__(self, allowed_local_media_path: str = "", allowed_media_domains: list[str] | None = None) -> None:
        if allowed_local_media_path:
            path = Path(allowed_local_media_path).resolve()
            if not path.exists():
                raise ValueError(f"Invalid `--allowed-local-media-path`: The path {path} does not exist.")
            if not path.is_dir():
                raise ValueError(f"Invalid `--allowed-local-media-path`: The path {path} must be a directory.")
            self.allowed_local_media_path: Path | None = path
        else:
            self.allowed_local_media_path = None
        self.allowed_media_domains = list(allowed_media_domains or [])

    def fetch_image(self, url: str) -> Image.Image:
        """The RGB image a data, file or http(s) URL names."""
        if not isinstance(url, str):
            raise MediaLoadError(f"image_url.url must be a string, got {type(url).__name__}.")
        if url[:5].lower() == "data:":
            return load_image_bytes(self._data_url_bytes(url))
        spec = urlparse(url)
        if spec.scheme in ("http", "https"):
            return load_image_bytes(self._http_bytes(url, spec.hostname))
        if spec.scheme == "file":
            return load_image_bytes(self._file_bytes(spec))
        raise MediaLoadError("The URL must be either a HTTP, data or file URL.")

    @staticmethod
    def _data_url_bytes(url: str) -> bytes:
        # RFC 2397: data:[<mediatype>][;base64],<data>
        spec, sep, payload = url[5:].partition(",")
        if not sep:
            raise MediaLoadError(f"Invalid data URL {url[:32]!r}: missing ',' separator.")
        if spec.rpartition(";")[2] != "base64":
            raise MediaLoadError("Only base64 data URLs are supported for now.")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaLoadError(f"Invalid base64 data in the image URL: {e}") from e

    def _file_bytes(self, spec) -> bytes:
        root = self.allowed_local_media_path
        if root is None:
            raise MediaLoadError("Cannot load local files without `--allowed-local-media-path`.")
        path = Path(url2pathname((spec.netloc or "") + (spec.path or "")))
        if root not in path.resolve().parents:
            raise MediaLoadError(f"The file path {path} must be a subpath of `--allowed-local-media-path {root}`.")
        try:
            return path.read_bytes()
        except OSError as e:
            raise MediaLoadError(f"Failed to read {path}: {e}") from e

    def _http_bytes(self, url: str, host: str | None) -> bytes:
        if self.allowed_media_domains and host not in self.allowed_media_domains:
            raise MediaLoadError(f"The URL must be from one of the allowed domains: {self.allowed_media_domains}. "
                                 f"Input URL domain: {host}")
        import requests

        limit = envs.media_max_bytes()
        try:
            # Redirects are not followed: a redirect could leave the allowed domains.
            with requests.get(url, timeout=envs.image_fetch_timeout(), stream=True, allow_redirects=False) as resp:
                if resp.status_code != 200:
                    raise MediaLoadError(f"Failed to fetch media from URL: HTTP {resp.status_code} error")
                chunks, size = [], 0
                for chunk in resp.iter_content(1 << 16):
                    size += len(chunk)
                    if size > limit:
                        raise MediaLoadError(f"Failed to fetch media from URL: the download exceeds {limit} bytes "
                                             "(FD_MEDIA_MAX_BYTES).")
                    chunks.append(chunk)
        except requests.RequestException as e:
            raise MediaLoadError(f"Failed to fetch media from URL {url}: {e}") from e
        return b"".join(chunks)
