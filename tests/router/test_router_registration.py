"""The instance side: registering with the router from server flags, role switching, the CLI."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest
from fake_llm_instance import FakeInstance, ServerThread
from fastapi import FastAPI

from fastdeploy.router.cli import RouterSubcommand, add_cli_args, cmd_init, router_args_from
from fastdeploy.router.instance import InstanceRole
from fastdeploy.router.registration import InstanceHooks, instance_info_from_args, role_from_args
from fastdeploy.utils.argparse_utils import FlexibleArgumentParser


def serve_args(port: int, router_url: str, **extra) -> argparse.Namespace:
    values = dict(host="127.0.0.1", port=port, router=router_url, splitwise_role="mixed", kv_transfer_config=None,
                  pd_comm_port=None, cache_transfer_protocol=None, metrics_port=None, served_model_name=None,
                  model="SmolLM2", tensor_parallel_size=1)
    values.update(extra)
    return argparse.Namespace(**values)


def test_roles_and_info_from_server_flags():
    assert role_from_args(argparse.Namespace(splitwise_role="prefill")) is InstanceRole.PREFILL
    assert role_from_args(argparse.Namespace(splitwise_role="mixed",
                                             kv_transfer_config={"kv_role": "kv_consumer"})) is InstanceRole.DECODE
    info = instance_info_from_args(serve_args(8000, "http://127.0.0.1:9000", host="0.0.0.0", splitwise_role="decode",
                                              pd_comm_port=[8201], cache_transfer_protocol="ipc,rdma"),
                                   "http://127.0.0.1:9000")
    # A wildcard bind address is replaced by the address that routes to the router.
    assert info["host"] == "127.0.0.1" and info["role"] == "decode"
    assert info["connector_port"] == 8201 and info["transfer_protocol"] == ["shm", "tcp"] and info["host_id"]


def test_instance_registers_switches_role_and_unregisters(make_router):
    router = make_router(policy="round_robin")
    # The fake stands in for the engine; the hooks add the real /switch_role and /role routes to its app.
    fake = FakeInstance("hooked")
    app = FastAPI()
    app.state.server_load_metrics = 0
    applied = []

    async def apply_role(role: str) -> None:
        applied.append(role)

    server_holder = {}

    async def scenario() -> None:
        port = server_holder["port"]
        hooks = InstanceHooks.from_args(serve_args(port, router.url), app, apply_role=apply_role, interval_s=0.3)
        await hooks.start()
        await asyncio.wait_for(hooks.registration.registered.wait(), 20)
        async with httpx.AsyncClient(base_url=router.url, trust_env=False, timeout=20) as client:
            listed = (await client.get("/instances")).json()["instances"]
            assert [(i["port"], i["role"], i["healthy"]) for i in listed] == [(port, "mixed", True)]
            resp = await client.post("/switch_role", json={"host": "127.0.0.1", "port": port, "role": "prefill"})
            assert resp.status_code == 200, resp.text
            assert applied == ["prefill"]
            listed = (await client.get("/instances")).json()["instances"]
            assert listed[0]["role"] == "prefill"
            # The periodic refresh keeps the new role (it re-registers with it).
            await asyncio.sleep(0.8)
            assert (await client.get("/instances")).json()["instances"][0]["role"] == "prefill"
        await hooks.stop()
        async with httpx.AsyncClient(base_url=router.url, trust_env=False) as client:
            assert (await client.get("/instances")).json()["instances"] == []

    app.mount("/fake", fake.app)

    @app.get("/health")
    async def health() -> dict:
        return {}

    server = ServerThread(app)
    server_holder["port"] = server.port
    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_role_switch_without_engine_support_is_refused():
    from fastdeploy.router.registration import RoleController

    controller = RoleController(InstanceRole.MIXED, in_flight=lambda: 0)
    resp = asyncio.run(controller.switch("decode"))
    assert resp.status_code == 501
    assert asyncio.run(controller.switch("mixed")).status_code == 200  # no change needed
    assert asyncio.run(controller.switch("teacher")).status_code == 400


def test_cli_parses_and_validates():
    parser = FlexibleArgumentParser(prog="fastdeploy")
    subparsers = parser.add_subparsers(dest="subparser")
    [command] = cmd_init()
    assert isinstance(command, RouterSubcommand) and command.name == "router"
    command.subparser_init(subparsers)
    args = parser.parse_args(["router", "--port", "9100", "--policy", "cache_aware", "--decode-policy", "request_num",
                              "--instance", "127.0.0.1:8001", "--instance", "127.0.0.1:8002",
                              "--pd-protocol", "concurrent", "--request-timeout-secs", "60"])
    command.validate(args)
    router_args = router_args_from(args)
    assert router_args.port == 9100 and router_args.policy == "cache_aware"
    assert router_args.decode_policy == "request_num" and router_args.prefill_policy is None
    assert router_args.instances == ["127.0.0.1:8001", "127.0.0.1:8002"] and router_args.request_timeout == 60
    with pytest.raises(SystemExit):
        add_cli_args(argparse.ArgumentParser()).parse_args(["--policy", "fastest"])
