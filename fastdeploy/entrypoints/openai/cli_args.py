"""Flags of the OpenAI-compatible server (vLLM's frontend flags plus FastDeploy's --metrics-port)."""

from __future__ import annotations

import argparse
import json

from fastdeploy import envs
from fastdeploy.engine.arg_utils import AsyncEngineArgs, warn_ignored_flags
from fastdeploy.entrypoints.openai.chat_parsing import ChatParserConfig
from fastdeploy.transformers_utils.model_resolver import DEFAULT_MODEL_NAME
from fastdeploy.utils.argparse_utils import FlexibleArgumentParser

# Frontend flags whose feature this build lacks: rejected at start-up, naming the flag.
_UNBUILT_FRONTEND_FLAGS = {
    "tool_parser_plugin": "--tool-parser-plugin (plugins)",
    "lora_modules": "--lora-modules (LoRA adapters)",
}

# Frontend flags accepted for vLLM compatibility that change nothing here: dest -> (default, why).
# Setting one logs the reason once at start-up (warn_ignored_flags).
_NO_EFFECT_FRONTEND_FLAGS: dict[str, tuple[object, str]] = {
    "disable_frontend_multiprocessing": (False, "the server always runs the engine client in its own process and "
                                                "the engine core in another (vLLM V1's layout)"),
    "disable_log_requests": (False, "deprecated (as in vLLM): requests are logged only with --enable-log-requests"),
    "chat_template_content_format": ("auto", "message content is always given to the chat template as one string "
                                             "(the models served are text-only)"),
}


def _json_list(value: str) -> list[str]:
    parsed = json.loads(value)
    if not isinstance(parsed, list):
        raise argparse.ArgumentTypeError(f"expected a JSON list, got {value!r}")
    return parsed


def add_frontend_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The HTTP server's own flags."""
    g = parser.add_argument_group("Frontend")
    g.add_argument("--host", type=str, default=None, help="Host name to bind (default: all interfaces).")
    g.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="FastDeploy: also serve /metrics (only) on this port.")
    g.add_argument("--uvicorn-log-level", type=str, default="info",
                   choices=["debug", "info", "warning", "error", "critical", "trace"], help="Log level of uvicorn.")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="Disable uvicorn's access log.")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS: allowed origins (JSON list).")
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS: allowed methods (JSON list).")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS: allowed headers (JSON list).")
    g.add_argument("--api-key", type=str, nargs="+", default=None,
                   help="Require one of these keys in 'Authorization: Bearer' (also VLLM_API_KEY / FD_API_KEY).")
    g.add_argument("--lora-modules", type=str, nargs="+", default=None, help="LoRA modules (not built yet).")
    g.add_argument("--chat-template", type=str, default=None, help="Chat template: a file path or the template.")
    g.add_argument("--chat-template-content-format", type=str, default="auto", choices=["auto", "string", "openai"],
                   help="How message content is given to the chat template (always a string here: "
                        "text-only models; warns when set).")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="Accepted for vLLM compatibility; requests may always pass chat_template.")
    g.add_argument("--response-role", type=str, default="assistant",
                   help="Role of the answer when add_generation_prompt is true.")
    g.add_argument("--ssl-keyfile", type=str, default=None, help="SSL key file.")
    g.add_argument("--ssl-certfile", type=str, default=None, help="SSL certificate file.")
    g.add_argument("--ssl-ca-certs", type=str, default=None, help="SSL CA certificates file.")
    g.add_argument("--root-path", type=str, default=None, help="FastAPI root_path behind a path-based proxy.")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="Spell tokens as 'token_id:<id>' in logprobs.")
    g.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="Accepted for vLLM compatibility (the engine always runs in its own process; warns).")
    g.add_argument("--enable-request-id-headers", action="store_true", help="Return X-Request-Id headers.")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='Let the model call tools on its own (tool_choice="auto"); needs --tool-call-parser.')
    g.add_argument("--tool-call-parser", type=str, default=None,
                   help="Parser of the model's tool-call format (hermes, llama3_json, qwen3_xml, ernie45, ...).")
    g.add_argument("--tool-parser-plugin", type=str, default=None, help="Tool parser plugin (not built yet).")
    g.add_argument("--reasoning-parser", type=str, default=None,
                   help="Parser splitting the model's reasoning into message.reasoning (qwen3, deepseek_r1, ...).")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="Most prompt characters and token ids printed per request by --enable-log-requests.")
    g.add_argument("--disable-fastapi-docs", action="store_true", help="Disable /docs, /redoc and /openapi.json.")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="Report usage.prompt_tokens_details.cached_tokens.")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="Accepted for vLLM compatibility; /load always reports in-flight requests.")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="Usage on every streamed chunk and a final usage chunk, whatever stream_options say.")
    g.add_argument("--enable-per-request-metrics", action=argparse.BooleanOptionalAction, default=False,
                   help="Add the request's timings (queue, time to first token, generation, mean ITL, tokens/s) "
                        "to responses as 'metrics' (one prompt, n = 1; streams: on the final usage chunk).")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true", help="Serve GET /tokenizer_info.")
    return parser


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Frontend and engine flags of ``fastdeploy serve`` / the api_server module."""
    add_frontend_args(parser)
    AsyncEngineArgs.add_cli_args(parser)
    # Without a model: FD_DEFAULT_MODEL, else the embedded default model under its Hugging Face name.
    parser.set_defaults(model=envs.default_model() or DEFAULT_MODEL_NAME)
    return parser


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    """Reject flags of features this build lacks, and contradictory settings; raises ValueError."""
    for attr, flag in _UNBUILT_FRONTEND_FLAGS.items():
        if getattr(args, attr, None):
            raise ValueError(f"{flag} is not supported by this FastDeploy build yet.")
    warn_ignored_flags(vars(args), _NO_EFFECT_FRONTEND_FLAGS)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    # Unknown parser names fail here, before the model loads.
    ChatParserConfig.from_names(args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice)
    if args.enable_per_request_metrics and args.disable_log_stats:
        # vLLM's rule and wording: the timings come from the engine's request statistics.
        raise ValueError("--enable-per-request-metrics requires engine statistics logging; remove "
                         "--disable-log-stats to enable per-request metrics.")
    if args.metrics_port is not None and args.metrics_port == args.port:
        raise ValueError(f"--metrics-port ({args.metrics_port}) must differ from --port.")


def create_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(description="FastDeploy OpenAI-compatible API server.")
    return make_arg_parser(parser)  # type: ignore[return-value]
