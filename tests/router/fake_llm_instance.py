"""A fake serving instance for router tests: the server's routes, answers that name the instance.

Per-request behaviour comes from extra body fields (the real server ignores unknown fields):
``fake_delay`` (seconds before answering), ``fake_chunks`` (stream events), ``fake_chunk_delay``,
``fake_status`` (answer with that error status), ``fake_die_after`` (stream that many events,
then die: the process exits when run as a script, the connection breaks when in a thread).

Run as a script (``python fake_llm_instance.py --port P --name N``) for tests that kill it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import threading
import time
from collections import Counter
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeInstance:
    """State and FastAPI app of one fake instance."""

    def __init__(self, name: str, role: str = "mixed", exit_on_die: bool = False) -> None:
        self.name = name
        self.role = role
        self.healthy = True
        self.exit_on_die = exit_on_die
        self.counts: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        # Every answer of this instance fails with this status (e.g. a broken prefill instance).
        self.fail_status: int | None = None
        self.cancelled = 0
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/load")
        async def load() -> JSONResponse:
            return JSONResponse({"server_load": self.in_flight})

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model",
                                                             "owned_by": self.name}]})

        @app.post("/switch_role")
        async def switch_role(body: dict[str, Any]) -> JSONResponse:
            while self.in_flight:
                await asyncio.sleep(0.01)
            previous, self.role = self.role, body["role"]
            return JSONResponse({"status": "ok", "role": self.role, "previous_role": previous})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._serve(request, "completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._serve(request, "chat")

        return app

    async def _serve(self, request: Request, kind: str) -> Response:
        body = await request.json()
        self.counts[kind] += 1
        self.bodies.append(body)
        status = body.get("fake_status") or self.fail_status
        if status:
            return JSONResponse({"error": {"message": f"fake error from {self.name}", "type": "BadRequestError",
                                           "param": None, "code": status}}, status_code=status)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1

        # Like the real server (with_cancellation), a client that goes away aborts the request.
        # A stream sends its headers first and waits inside the stream, as the real server does.
        deadline = time.monotonic() + (0 if body.get("stream") else float(body.get("fake_delay", 0)))
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                self.cancelled += 1
                release()
                return Response(status_code=499)
            await asyncio.sleep(0.02)
        text = f"served by {self.name}"
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            # A prefill instance: one token, the KV held for the decode instance to fetch.
            release()
            return JSONResponse({"id": body.get("request_id"), "object": "text_completion", "choices": [
                {"index": 0, "text": " first", "finish_reason": "length"}],
                "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                       "remote_engine_id": self.name, "remote_block_ids": [0, 1],
                                       "remote_request_id": body.get("request_id"), "remote_num_tokens": 5,
                                       "first_token_id": 42}})
        if kv.get("do_remote_prefill"):
            text = f"decoded by {self.name} from {kv.get('remote_engine_id')}"
        if not body.get("stream"):
            release()
            return JSONResponse({"id": "cmpl-fake", "object": "text_completion", "model": "fake-model",
                                 "choices": [{"index": 0, "text": text, "finish_reason": "stop"}]})
        return StreamingResponse(self._stream(body, text, release), media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any], text: str, release: Any):
        chunks = int(body.get("fake_chunks", 3))
        die_after = body.get("fake_die_after")
        try:
            await asyncio.sleep(float(body.get("fake_delay", 0)))
            for i in range(chunks):
                if die_after is not None and i >= int(die_after):
                    if self.exit_on_die:
                        os._exit(1)
                    raise RuntimeError("fake instance dies mid-stream")
                event = {"id": "cmpl-fake", "object": "text_completion", "choices": [
                    {"index": 0, "text": f"{text} #{i}", "finish_reason": None if i < chunks - 1 else "stop"}]}
                yield f"data: {json.dumps(event)}\n\n"
                await asyncio.sleep(float(body.get("fake_chunk_delay", 0.01)))
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            release()


class ServerThread:
    """A uvicorn server for ``app`` on a loopback port, in a daemon thread."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"Server on port {self.port} did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--role", default="mixed")
    args = parser.parse_args()
    fake = FakeInstance(args.name, args.role, exit_on_die=True)
    uvicorn.run(fake.app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
