"""Streaming requests to OpenAI-compatible endpoints, timed per chunk (vLLM's ``endpoint_request_func``).

Each function sends one streaming request and records when the first text
arrived (TTFT), the gap before every later chunk (ITL), the end-to-end latency
and the server's own count of generated tokens (``usage.completion_tokens``).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # aiohttp is imported where requests are sent, so the `fastdeploy` CLI's parser builds without it.
    import aiohttp
    from tqdm.asyncio import tqdm

# A long total limit (seconds): a request queued behind many others on a CPU server can take minutes.
AIOHTTP_TIMEOUT_S = 6 * 60 * 60


@dataclass
class RequestFuncInput:
    """What to send."""

    prompt: str
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    model_name: str | None = None
    ignore_eos: bool = False
    extra_body: dict[str, Any] | None = None
    api_key: str | None = None


@dataclass
class RequestFuncOutput:
    """What was measured."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0


async def _sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent-events stream, ``[DONE]`` excluded."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        # Events are separated by blank lines; a chunk may hold several or a part of one.
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.decode("utf-8").splitlines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    if data and data != "[DONE]":
                        yield data


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def _stream_request(request_func_input: RequestFuncInput, session: aiohttp.ClientSession,
                          payload: dict[str, Any], text_of: Callable[[dict[str, Any]], str | None],
                          pbar: tqdm | None) -> RequestFuncOutput:
    """Send ``payload`` as a stream; ``text_of`` extracts a chunk's new text."""
    payload["stream"] = True
    # The server's token count is exact; counting re-tokenized text would not be.
    payload["stream_options"] = {"include_usage": True}
    if request_func_input.ignore_eos:
        payload["ignore_eos"] = True
    if request_func_input.extra_body:
        payload.update(request_func_input.extra_body)
    output = RequestFuncOutput(prompt_len=request_func_input.prompt_len)
    generated: list[str] = []
    first_chunk_received = False
    st = time.perf_counter()
    output.start_time = st
    most_recent = st
    try:
        async with session.post(request_func_input.api_url, json=payload,
                                headers=_headers(request_func_input.api_key)) as response:
            if response.status != 200:
                output.error = f"HTTP {response.status}: {(await response.text())[:500]}"
            else:
                async for data in _sse_events(response):
                    event = json.loads(data)
                    now = time.perf_counter()
                    if event.get("usage"):
                        output.output_tokens = event["usage"].get("completion_tokens") or 0
                    if not event.get("choices"):
                        continue
                    # As vLLM: the first chunk with choices ends the TTFT (even with empty text, e.g. a
                    # request whose first token is EOS); every later one adds one ITL gap.
                    if not first_chunk_received:
                        first_chunk_received = True
                        output.ttft = now - st
                    else:
                        output.itl.append(now - most_recent)
                    most_recent = now
                    generated.append(text_of(event) or "")
                output.generated_text = "".join(generated)
                output.latency = most_recent - st
                output.success = first_chunk_received
                if not first_chunk_received:
                    output.error = "Never received a valid chunk to calculate TTFT."
    except Exception:
        output.error = "".join(traceback.format_exception(*sys.exc_info()))
    if pbar is not None:
        pbar.update(1)
    return output


async def async_request_openai_completions(request_func_input: RequestFuncInput, session: aiohttp.ClientSession,
                                           pbar: tqdm | None = None) -> RequestFuncOutput:
    """A streaming ``/v1/completions`` request."""
    if not request_func_input.api_url.endswith(("completions", "profile")):
        raise ValueError("The OpenAI completions API URL must end with 'completions'.")
    payload = {"model": request_func_input.model_name or request_func_input.model,
               "prompt": request_func_input.prompt, "temperature": 0.0,
               "max_tokens": request_func_input.output_len}
    return await _stream_request(request_func_input, session, payload,
                                 lambda event: event["choices"][0].get("text"), pbar)


async def async_request_openai_chat_completions(request_func_input: RequestFuncInput,
                                                session: aiohttp.ClientSession,
                                                pbar: tqdm | None = None) -> RequestFuncOutput:
    """A streaming ``/v1/chat/completions`` request with the prompt as one user message."""
    if not request_func_input.api_url.endswith(("chat/completions", "profile")):
        raise ValueError("The OpenAI chat completions API URL must end with 'chat/completions'.")
    payload = {"model": request_func_input.model_name or request_func_input.model,
               "messages": [{"role": "user", "content": request_func_input.prompt}], "temperature": 0.0,
               "max_completion_tokens": request_func_input.output_len}
    return await _stream_request(request_func_input, session, payload,
                                 lambda event: (event["choices"][0].get("delta") or {}).get("content"), pbar)


RequestFunc = Callable[[RequestFuncInput, "aiohttp.ClientSession", "tqdm | None"], Awaitable[RequestFuncOutput]]

# vLLM's backend names; "vllm" is its completions client, an alias here.
ASYNC_REQUEST_FUNCS: dict[str, RequestFunc] = {
    "openai": async_request_openai_completions,
    "vllm": async_request_openai_completions,
    "openai-chat": async_request_openai_chat_completions,
}
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
