"""``fastdeploy router`` flags and the sub-command that runs the router.

Wiring into the ``fastdeploy`` command: add ``("fastdeploy.router.cli", "RouterSubcommand")`` to
``_SUBCOMMANDS`` in ``fastdeploy/entrypoints/cli/main.py`` (or call :func:`cmd_init`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from fastdeploy.entrypoints.cli.types import CLISubcommand
from fastdeploy.router.pd import PROTOCOLS
from fastdeploy.router.policies import POLICIES
from fastdeploy.router.router import RouterArgs

_D = RouterArgs()


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every router flag to ``parser``."""
    policies = list(POLICIES)
    parser.add_argument("--host", default=_D.host, help="Address to listen on.")
    parser.add_argument("--port", type=int, default=_D.port, help="Port to listen on.")
    parser.add_argument("--policy", choices=policies, default=_D.policy,
                        help="Load-balancing policy for mixed instances (and prefill/decode unless set below).")
    parser.add_argument("--prefill-policy", choices=policies, default=None,
                        help="Policy among prefill instances (default: --policy).")
    parser.add_argument("--decode-policy", choices=policies, default=None,
                        help="Policy among decode instances (default: --policy).")
    parser.add_argument("--pd-protocol", choices=PROTOCOLS, default=_D.pd_protocol,
                        help="How a prefill/decode pair is driven: 'sequential' (vLLM's proxy: prefill, then "
                             "decode with the returned kv_transfer_params) or 'concurrent' (FastDeploy's: both at "
                             "once, the prefill pushes its KV cache to the decode instance).")
    parser.add_argument("--splitwise", action="store_true",
                        help="Accepted for FastDeploy scripts; PD pairing starts once prefill and decode instances "
                             "register.")
    parser.add_argument("--instance", dest="instances", action="append", default=[], metavar="HOST:PORT",
                        help="A mixed instance to serve without registration (repeatable).")
    parser.add_argument("--prefill-instance", dest="prefill_instances", action="append", default=[],
                        metavar="HOST:PORT", help="A prefill instance to serve without registration (repeatable).")
    parser.add_argument("--decode-instance", dest="decode_instances", action="append", default=[],
                        metavar="HOST:PORT", help="A decode instance to serve without registration (repeatable).")
    parser.add_argument("--health-check-interval", type=float, default=_D.health_check_interval,
                        help="Seconds between GET /health probes of each instance.")
    parser.add_argument("--health-check-timeout", type=float, default=_D.health_check_timeout,
                        help="Seconds a probe may take before it counts as failed.")
    parser.add_argument("--health-failure-threshold", type=int, default=_D.health_failure_threshold,
                        help="Failed probes in a row before an instance stops getting work.")
    parser.add_argument("--unhealthy-removal-s", type=float, default=_D.unhealthy_removal_s,
                        help="Seconds an instance may stay unhealthy before it is dropped (it can re-register).")
    parser.add_argument("--request-timeout", "--request-timeout-secs", dest="request_timeout", type=float,
                        default=_D.request_timeout, help="Seconds an instance may take to answer a request.")
    parser.add_argument("--connect-timeout", type=float, default=_D.connect_timeout,
                        help="Seconds to connect to an instance.")
    parser.add_argument("--connect-retries", type=int, default=_D.connect_retries,
                        help="Other instances tried when one refuses a connection.")
    parser.add_argument("--cache-block-chars", type=int, default=_D.cache_block_chars,
                        help="cache_aware: prompt characters per hashed prefix block.")
    parser.add_argument("--cache-max-prefix-chars", type=int, default=_D.cache_max_prefix_chars,
                        help="cache_aware: prompt characters considered for affinity.")
    parser.add_argument("--cache-threshold", type=float, default=_D.cache_threshold,
                        help="cache_aware: share of the prompt a cached prefix must cover to win over load.")
    parser.add_argument("--balance-abs-threshold", type=int, default=_D.balance_abs_threshold,
                        help="cache_aware: in-flight gap (max - min) above which affinity yields to load.")
    parser.add_argument("--balance-rel-threshold", type=float, default=_D.balance_rel_threshold,
                        help="cache_aware: ... and the ratio max/min above which it does.")
    parser.add_argument("--uvicorn-log-level", default=_D.uvicorn_log_level,
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser


def router_args_from(args: argparse.Namespace) -> RouterArgs:
    """The RouterArgs of a parsed command line (extra attributes, like the sub-command's, are ignored)."""
    names = {f.name for f in dataclasses.fields(RouterArgs)}
    return RouterArgs(**{k: v for k, v in vars(args).items() if k in names})


def main(args: argparse.Namespace) -> int:
    """Run the router until stopped; a bad flag ends with a message and exit code 1."""
    from fastdeploy.router.app import run_router

    try:
        router_args = router_args_from(args)
        router_args.validate()
    except ValueError as e:
        print(f"fastdeploy router: error: {e}", file=sys.stderr)
        return 1
    return run_router(router_args)


class RouterSubcommand(CLISubcommand):
    """``fastdeploy router --port 9000 [--policy ...]``."""

    name = "router"

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(
            self.name, help="Start the router in front of mixed or prefill/decode instances.",
            usage="fastdeploy router [options]",
            description="Load-balancing router for FastDeploy instances (data parallel and prefill/decode "
                        "disaggregation). Instances register with POST /register (serve ... --router URL).")
        return add_cli_args(parser)

    def validate(self, args: argparse.Namespace) -> None:
        router_args_from(args).validate()

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        sys.exit(main(args))


def cmd_init() -> list[CLISubcommand]:
    """The sub-commands this module adds to ``fastdeploy`` (vLLM's ``cmd_init`` convention)."""
    return [RouterSubcommand()]
