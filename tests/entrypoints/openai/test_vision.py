"""Image inputs through the OpenAI chat API (vLLM's tests/entrypoints/openai/test_vision.py).

One server runs the tiny random Qwen2.5-VL; images come as base64 data URLs, from a loopback
HTTP server and from a local folder. Every bad image input is a 400 with vLLM's error envelope
and the server keeps serving.
"""

from __future__ import annotations

import base64
import http.server
import threading
from functools import partial

import openai
import pytest
from remote_server import RemoteOpenAIServer

from tests.multimodal.utils import build_tiny_paddleocr_vl, build_tiny_qwen2_5_vl, png_bytes, random_image

MODEL = "tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png_bytes(random_image(5)))
    (folder / "dog.png").write_bytes(png_bytes(random_image(6, (112, 84))))
    (folder / "notes.png").write_bytes(b"these bytes are not an image")
    return folder


@pytest.fixture(scope="module")
def http_base(media_dir):
    """A loopback HTTP server over the media folder."""
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(media_dir))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _server_args(path, media_dir):
    return ["--model", path, "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "1024",
            "--kv-cache-memory-bytes", "64M", "--max-num-seqs", "8", "--disable-log-stats",
            "--uvicorn-log-level", "warning", "--limit-mm-per-prompt", '{"image": 2}',
            "--allowed-local-media-path", str(media_dir), "--allowed-media-domains", "127.0.0.1"]


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory, media_dir):
    with RemoteOpenAIServer(_server_args(build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl")),
                                         media_dir)) as srv:
        yield srv


@pytest.fixture(scope="module")
def vl_client(vl_server):
    return vl_server.get_client()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _ask(client, urls, model=MODEL):
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content.append({"type": "text", "text": "What is in the picture?"})
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=12, temperature=0)


def test_base64_url_and_file_images_answer_alike(vl_client, media_dir, http_base):
    by_data = _ask(vl_client, [_data_url((media_dir / "cat.png").read_bytes())])
    by_http = _ask(vl_client, [f"{http_base}/cat.png"])
    by_file = _ask(vl_client, [f"file://{media_dir / 'cat.png'}"])
    text_only = vl_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is in the picture?"}], max_tokens=12, temperature=0)
    assert by_data.choices[0].message.content
    assert by_data.choices[0].message.content == by_http.choices[0].message.content == by_file.choices[0].message.content
    # 56x56 -> 4 image tokens plus <|vision_start|> and <|vision_end|>.
    assert by_data.usage.prompt_tokens == text_only.usage.prompt_tokens + 6
    two = _ask(vl_client, [f"{http_base}/cat.png", f"{http_base}/dog.png"])
    assert two.usage.prompt_tokens == by_data.usage.prompt_tokens + 2 + 12


def test_paddleocr_vl_answers_base64_and_url_images(tmp_path_factory, media_dir, http_base):
    path = build_tiny_paddleocr_vl(tmp_path_factory.mktemp("paddleocr_vl"))
    with RemoteOpenAIServer(_server_args(path, media_dir)) as srv:
        client = srv.get_client()
        by_data = _ask(client, [_data_url((media_dir / "dog.png").read_bytes())])
        by_http = _ask(client, [f"{http_base}/dog.png"])
        assert by_data.choices[0].message.content
        assert by_data.choices[0].message.content == by_http.choices[0].message.content
        with pytest.raises(openai.BadRequestError):
            _ask(client, [f"{http_base}/notes.png"])


@pytest.mark.parametrize("url, match", [
    ("data:image/png;base64,not*valid*base64", "base64"),
    (_data_url(b"these bytes are not an image"), "image"),
    ("{http}/notes.png", "image"),
    ("http://localhost:1/cat.png", "allowed domains"),
    ("file:///etc/hostname", "allowed-local-media-path"),
    ("ftp://127.0.0.1/cat.png", "HTTP, data or file URL"),
])
def test_bad_image_is_a_400(vl_client, vl_server, http_base, url, match):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(vl_client, [url.format(http=http_base)])
    assert e.value.status_code == 400
    assert match in e.value.body["message"]
    assert e.value.body["type"] == "BadRequestError"
    assert _ask(vl_client, [f"{http_base}/cat.png"]).choices[0].message.content  # still serving


def test_more_images_than_the_limit_is_a_400(vl_client, http_base):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(vl_client, [f"{http_base}/cat.png"] * 3)
    assert "`--limit-mm-per-prompt`" in e.value.body["message"] and "passed 3 image items" in e.value.body["message"]


def test_image_to_a_text_only_model_is_a_400(client, http_base):
    """The suite's shared SmolLM2 server takes text only."""
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, [f"{http_base}/cat.png"], model="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "image_url" in e.value.body["message"]
