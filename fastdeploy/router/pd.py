"""Prefill/decode disaggregation, router side: how a request is split over a (prefill, decode) pair.

Both protocols carry vLLM's ``kv_transfer_params`` request field, so one instance-side
implementation serves both, and vLLM's own disaggregation proxies work against FastDeploy
instances unchanged.

``sequential`` (vLLM's disaggregated-prefill proxy; the default)
    1. The router sends the request to the prefill instance with ``max_tokens=1``,
       ``stream=false`` and ``kv_transfer_params = {"do_remote_decode": true, ...}`` (plus the
       chosen decode instance's KV endpoint, so a prefill instance may start pushing early).
    2. The prefill instance computes the prompt, samples the first token, keeps the request's
       KV blocks and answers with ``kv_transfer_params = {"do_remote_prefill": true,
       "remote_host", "remote_port", "remote_engine_id", "remote_request_id",
       "remote_block_ids", "remote_num_tokens", "first_token_id", ...}``.
    3. The router sends the original request to the decode instance with those parameters (and
       ``transfer_protocol``, chosen from the pair's topology). The decode instance
       pre-allocates blocks, fetches the KV cache over the connector, emits the prefill's first
       token and generates the rest; its answer (streamed or not) goes to the client.

``concurrent`` (FastDeploy's splitwise router)
    The router sends both requests at once: the decode instance gets
    ``{"do_remote_prefill": true, "remote_host": <prefill>, ...}`` and pre-allocates blocks; the
    prefill instance gets ``{"do_remote_decode": true, "remote_host": <decode>, ...}`` and
    pushes the KV blocks and the first token to the decode instance as soon as the prompt is
    done. The decode answer is streamed back while the prefill answer is watched: if the
    prefill fails, the decode request is abandoned (the decode instance frees its
    pre-allocated blocks on the disconnect) and the client gets the prefill's error.

In both, one ``request_id`` names the request on both instances (and in the connector).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response

from fastdeploy.distributed.kv_transfer.topology import select_transfer_protocol
from fastdeploy.logger import init_logger
from fastdeploy.router.errors import (
    ConnectFailed,
    RouterError,
    describe,
    error_message,
    failed_message,
    new_request_id,
)
from fastdeploy.router.instance import InstanceRole, InstanceState
from fastdeploy.router.policies import RequestFeatures

if TYPE_CHECKING:
    from fastdeploy.router.router import Router

logger = init_logger("fastdeploy.router.pd")

SEQUENTIAL = "sequential"
CONCURRENT = "concurrent"
PROTOCOLS = (SEQUENTIAL, CONCURRENT)


def pd_supported(body: dict[str, Any]) -> bool:
    """Whether a request can be split over a pair (one sequence, at least one token to decode).

    Several sequences (n > 1, best_of, a batch of prompts) would need several KV handoffs in one
    request, ``max_tokens=0`` (prompt scoring) has nothing to decode, and prompt logprobs (or
    echo) need the whole prompt computed on the answering instance; those are served whole by
    one instance instead.
    """
    if int(body.get("n") or 1) != 1 or int(body.get("best_of") or 1) != 1:
        return False
    if body.get("max_tokens") == 0:
        return False
    if body.get("echo") or body.get("prompt_logprobs") is not None:
        # Prompt logprobs need every prompt position computed where the answer is made.
        return False
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt)
                and len(prompt) > 1)


def transfer_protocol(prefill: InstanceState, decode: InstanceState) -> str:
    """Shared memory for a same-host pair, TCP otherwise (as FastDeploy picks IPC or RDMA)."""
    return select_transfer_protocol(prefill.info.host_id, decode.info.host_id, prefill.info.transfer_protocol,
                                    decode.info.transfer_protocol)


def _endpoint(instance: InstanceState) -> dict[str, Any]:
    return {"remote_engine_id": instance.id, "remote_host": instance.info.host,
            "remote_port": instance.info.connector_port, "remote_host_id": instance.info.host_id}


def prefill_body(body: dict[str, Any], request_id: str, decode: InstanceState, protocol: str,
                 mode: str) -> dict[str, Any]:
    """The prefill half: one token, not streamed, told to keep (or push) its KV for ``decode``."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, request_id=request_id)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": None,
                                 **_endpoint(decode), "remote_request_id": request_id,
                                 "transfer_protocol": protocol, "mode": mode}
    return out


def decode_body(body: dict[str, Any], request_id: str, params: dict[str, Any]) -> dict[str, Any]:
    """The decode half: the client's request as sent, plus where its KV cache comes from."""
    return {**body, "request_id": request_id, "kv_transfer_params": params}


async def handle_pd(router: Router, endpoint: str, body: dict[str, Any], headers: dict[str, str],
                    features: RequestFeatures) -> Response:
    """Serve a request with a (prefill, decode) pair using the router's ``--pd-protocol``."""
    if not pd_supported(body):
        # Served whole by one prefill instance (it runs any request without kv_transfer_params).
        return await router.forward(InstanceRole.PREFILL, endpoint, body, headers, features)
    request_id = str(body.get("request_id") or new_request_id())
    if router.args.pd_protocol == CONCURRENT:
        return await _concurrent(router, endpoint, body, headers, features, request_id)
    return await _sequential(router, endpoint, body, headers, features, request_id)


async def _sequential(router: Router, endpoint: str, body: dict[str, Any], headers: dict[str, str],
                      features: RequestFeatures, request_id: str) -> Response:
    decode = router.pick(InstanceRole.DECODE, features)
    # Booked now so concurrent requests see this decode instance as busy during the prefill.
    decode_lease = router.lease(decode, features)
    try:
        started = time.monotonic()
        prefill, status, content = await _run_prefill(router, endpoint, body, headers, features, request_id,
                                                      decode, SEQUENTIAL)
        router.metrics.prefill_seconds.observe(time.monotonic() - started)
        if status != 200:
            decode_lease.release()
            return Response(content=content, status_code=status, media_type="application/json")
        params = _returned_params(prefill, content)
        params.setdefault("transfer_protocol", transfer_protocol(prefill, decode))
    except BaseException:
        decode_lease.release()
        raise
    tried = {decode.id}
    while True:
        try:
            return await router.proxy(decode, endpoint, decode_body(body, request_id, params), headers, features,
                                      lease=decode_lease)
        except ConnectFailed as e:
            # The prefill instance holds the KV until it is fetched, so another decode instance can.
            if len(tried) > router.args.connect_retries:
                raise RouterError(str(e)) from None
            decode = router.pick(InstanceRole.DECODE, features, exclude=tried)
            tried.add(decode.id)
            params["transfer_protocol"] = transfer_protocol(prefill, decode)
            decode_lease = router.lease(decode, features)


async def _run_prefill(router: Router, endpoint: str, body: dict[str, Any], headers: dict[str, str],
                       features: RequestFeatures, request_id: str, decode: InstanceState,
                       mode: str) -> tuple[InstanceState, int, bytes]:
    """Send the prefill half, retrying a refused connection on another prefill instance."""
    tried: set[str] = set()
    while True:
        prefill = router.pick(InstanceRole.PREFILL, features, exclude=tried)
        tried.add(prefill.id)
        try:
            status, content = await _run_prefill_on(router, prefill, endpoint, body, headers, features, request_id,
                                                    decode, mode)
            return prefill, status, content
        except ConnectFailed as e:
            if len(tried) > router.args.connect_retries:
                raise RouterError(str(e)) from None


async def _run_prefill_on(router: Router, prefill: InstanceState, endpoint: str, body: dict[str, Any],
                          headers: dict[str, str], features: RequestFeatures, request_id: str,
                          decode: InstanceState, mode: str) -> tuple[int, bytes]:
    """The prefill half on ``prefill``: its status and body (ConnectFailed if refused)."""
    request = prefill_body(body, request_id, decode, transfer_protocol(prefill, decode), mode)
    lease = router.lease(prefill, features)
    failed = True
    try:
        resp = await router.open(prefill, endpoint, request, headers)
        try:
            content = await resp.aread()
        except Exception as e:  # the instance died after its headers
            router.fail_instance(prefill, describe(e))
            raise RouterError(failed_message(prefill, e)) from None
        finally:
            await resp.aclose()
        failed = False
        return resp.status_code, content
    finally:
        lease.release(failed=failed)


def _returned_params(prefill: InstanceState, content: bytes) -> dict[str, Any]:
    """The prefill answer's ``kv_transfer_params``, with the prefill's registered endpoint as fallback."""
    try:
        params = json.loads(content).get("kv_transfer_params")
    except (ValueError, AttributeError):
        params = None
    if not isinstance(params, dict):
        raise RouterError(f"Prefill instance {prefill.id} returned no kv_transfer_params; is it running with "
                          "--splitwise-role prefill (or kv_role kv_producer)?")
    params = dict(params)
    params.setdefault("do_remote_prefill", True)
    params["do_remote_decode"] = False
    for key, value in _endpoint(prefill).items():
        if params.get(key) is None:
            params[key] = value
    return params


async def _concurrent(router: Router, endpoint: str, body: dict[str, Any], headers: dict[str, str],
                      features: RequestFeatures, request_id: str) -> Response:
    decode = router.pick(InstanceRole.DECODE, features)
    decode_lease = router.lease(decode, features)
    try:
        prefill = router.pick(InstanceRole.PREFILL, features)
        protocol = transfer_protocol(prefill, decode)
    except BaseException:
        decode_lease.release()
        raise
    params = {"do_remote_prefill": True, "do_remote_decode": False, **_endpoint(prefill),
              "remote_request_id": request_id, "transfer_protocol": protocol, "mode": CONCURRENT}

    async def prefill_half() -> None:
        started = time.monotonic()
        # No retry elsewhere: the decode instance already waits for this very prefill instance.
        try:
            status, content = await _run_prefill_on(router, prefill, endpoint, body, headers, features, request_id,
                                                    decode, CONCURRENT)
        except ConnectFailed as e:
            raise RouterError(str(e)) from None
        router.metrics.prefill_seconds.observe(time.monotonic() - started)
        if status != 200:
            raise RouterError(f"Prefill instance {prefill.id} failed: {error_message(content)}", status,
                              "PrefillError")

    guard = asyncio.create_task(prefill_half(), name=f"prefill-{request_id}")
    guard.add_done_callback(_log_unobserved)
    try:
        response = await router.proxy(decode, endpoint, decode_body(body, request_id, params), headers, features,
                                      lease=decode_lease, guard=guard)
    except BaseException:
        guard.cancel()
        raise
    if response.status_code != 200:
        # The decode side refused (bad request, no room): the prefill work is moot.
        guard.cancel()
    return response


def _log_unobserved(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("Prefill half of %s ended with: %s", task.get_name(), task.exception())
