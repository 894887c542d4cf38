"""What each compatibility flag does: works, warns once at start-up naming itself, or is refused by name.

A flag that is accepted and silently does nothing makes its user believe something happened;
every such flag is covered here (README, "Flags that do nothing here").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fastdeploy.engine.arg_utils import EngineArgs, warn_ignored_flags
from fastdeploy.entrypoints.openai.cli_args import create_parser, validate_parsed_serve_args
from fastdeploy.metrics.loggers import PrometheusStatLogger
from fastdeploy.model_executor.guided_decoding.request import (
    forbid_additional_properties,
    get_structured_output_key,
)
from fastdeploy.platforms import current_platform
from fastdeploy.sampling_params import StructuredOutputsParams


@contextmanager
def warnings_logged() -> Iterator[list[str]]:
    """The fastdeploy warnings logged inside the block (the package logger does not propagate to caplog)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("fastdeploy")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def engine_config(*argv: str):
    return EngineArgs.from_cli_args(create_parser().parse_args(["--max-model-len", "256", *argv])
                                    ).create_engine_config()


# Flags with no effect in this engine (any platform) and on CPU, a value to set, a word of the reason.
NO_EFFECT = [
    (["--swap-space", "8"], "--swap-space", "recomputed"),
    (["--kv-cache-ratio", "0.5"], "--kv-cache-ratio", "one shared pool"),
    (["--cache-queue-port", "7100"], "--cache-queue-port", "no cache-transfer queue"),
    (["--enable-logprob"], "--enable-logprob", "always available"),
    (["--revision", "main"], "--revision", "local folders"),
]
CPU_IGNORED = [
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization", "VLLM_CPU_KVCACHE_SPACE"),
    (["--enforce-eager"], "--enforce-eager", "always runs eagerly"),
    (["--graph-optimization-config", '{"use_cudagraph": false}'], "--graph-optimization-config", "graph capture"),
]


@pytest.mark.parametrize(("argv", "flag", "reason"), NO_EFFECT + CPU_IGNORED)
def test_a_flag_without_effect_warns_once_naming_itself(argv, flag, reason):
    with warnings_logged() as messages:
        engine_config(*argv)
    named = [m for m in messages if m.startswith(flag + "=")]
    assert len(named) == 1, messages
    assert "has no effect" in named[0] and reason in named[0]


def test_defaults_warn_about_nothing():
    # LLM(...) passes gpu_memory_utilization=0.9 explicitly: the default is not "set".
    with warnings_logged() as messages:
        engine_config("--gpu-memory-utilization", "0.9", "--swap-space", "4")
    assert not [m for m in messages if "has no effect" in m], messages


def test_the_cpu_platform_names_the_flags_it_ignores():
    if not current_platform.is_cpu():
        pytest.skip("CPU platform only")
    assert set(current_platform.ignored_flags()) == {"gpu_memory_utilization", "enforce_eager",
                                                     "graph_optimization_config"}


def test_warn_ignored_flags_compares_with_the_default():
    table = {"a": (None, "why a"), "b": (False, "why b")}
    with warnings_logged() as messages:
        assert warn_ignored_flags({"a": 3, "b": False, "c": 1}, table) == ["a"]
    assert messages == ["--a=3 has no effect: why a."]


@pytest.mark.parametrize(("argv", "flag"), [
    (["--disable-frontend-multiprocessing"], "--disable-frontend-multiprocessing"),
    (["--disable-log-requests"], "--disable-log-requests"),
    (["--chat-template-content-format", "openai"], "--chat-template-content-format"),
])
def test_server_flags_without_effect_warn_at_validation(argv, flag):
    with warnings_logged() as messages:
        validate_parsed_serve_args(create_parser().parse_args(argv))
    assert len([m for m in messages if m.startswith(flag + "=")]) == 1, messages


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_is_refused_by_name(value):
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        engine_config("--kv-cache-dtype", value)


def test_kv_cache_dtype_must_be_the_compute_dtype():
    assert engine_config("--dtype", "float32", "--kv-cache-dtype", "auto").cache_config.cache_dtype == "auto"
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 .*float32"):
        engine_config("--dtype", "float32", "--kv-cache-dtype", "bfloat16")


def test_scheduling_policy_priority_is_refused_by_name():
    assert engine_config("--scheduling-policy", "fcfs").scheduler_config.policy == "fcfs"
    with pytest.raises(ValueError, match="--scheduling-policy"):
        engine_config("--scheduling-policy", "priority")


SCHEMA = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                           "c": {"type": "object", "additionalProperties": True}}}


def test_disable_additional_properties_closes_every_object_schema():
    closed = forbid_additional_properties(SCHEMA)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    # An object that says what it admits keeps it (vLLM's meaning: only where not set).
    assert closed["properties"]["c"]["additionalProperties"] is True
    assert "additionalProperties" not in SCHEMA  # the request's schema is not modified


def test_disable_additional_properties_reaches_the_compiled_schema():
    from fastdeploy.config import StructuredOutputsConfig

    open_key = get_structured_output_key(StructuredOutputsParams(json=SCHEMA))
    assert '"additionalProperties":false' not in open_key.spec
    per_request = get_structured_output_key(StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True))
    engine_wide = get_structured_output_key(StructuredOutputsParams(json=SCHEMA),
                                            StructuredOutputsConfig(disable_additional_properties=True))
    assert per_request == engine_wide and per_request.spec.count('"additionalProperties":false') == 2


def test_spec_decode_counters_are_not_registered_without_speculative_decoding():
    # As vLLM: they exist only with a speculative config (tests/spec_decode/test_metrics.py).
    registry = PrometheusStatLogger("m", 256, {}).registry
    names = {metric.name for metric in registry.collect()}
    assert not [n for n in names if "spec_decode" in n]
    assert "vllm:prompt_tokens" in names


def test_hidden_metrics_are_exported_only_with_show_hidden_metrics(monkeypatch):
    """--show-hidden-metrics-for-version brings back the metrics the followed vLLM release hides."""
    from prometheus_client import Gauge

    from fastdeploy.metrics import loggers

    monkeypatch.setattr(loggers, "HIDDEN_METRICS", [
        lambda registry, model: Gauge("vllm:deprecated_example", "A hidden metric.", ["model_name"],
                                      registry=registry).labels(model)])
    shown = {m.name for m in PrometheusStatLogger("m", 256, {}, show_hidden_metrics=True).registry.collect()}
    hidden = {m.name for m in PrometheusStatLogger("m", 256, {}).registry.collect()}
    assert "vllm:deprecated_example" in shown and "vllm:deprecated_example" not in hidden
