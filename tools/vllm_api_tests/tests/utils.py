"""Stand-in for vLLM's tests/utils.py: RemoteOpenAIServer starts `fastdeploy serve` instead of `vllm serve`.

Harness code (not vLLM's). The test's model is served by FastDeploy's default model
(SmolLM2-135M-Instruct, embedded) under the test's model name (--served-model-name), so
requests naming the test's model reach it. The server gets the test's flags unchanged,
except LoRA flags (FastDeploy has no LoRA: they are dropped and the LoRA tests skipped, see
tests/conftest.py).
"""

from __future__ import annotations

import os
import sys

import openai
from remote_server import RemoteOpenAIServer as FastDeployServer  # FastDeploy's own test server
from vllm._model import FD_MODEL
from vllm.utils.network_utils import get_open_port

# Flags of LoRA serving, with the number of values each takes (None: one or more).
_LORA_FLAGS = {"--enable-lora": 0, "--lora-modules": None, "--max-lora-rank": 1, "--max-cpu-loras": 1,
               "--max-loras": 1}


def _drop_lora_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """The args without LoRA flags, and the LoRA module names that were asked for."""
    kept: list[str] = []
    lora_names: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i].split("=", 1)[0]
        if flag not in _LORA_FLAGS:
            kept.append(args[i])
            i += 1
            continue
        nvalues = _LORA_FLAGS[flag]
        i += 1
        if "=" in args[i - 1]:
            continue
        if nvalues is None:
            while i < len(args) and not args[i].startswith("--"):
                lora_names.append(args[i].split("=", 1)[0])
                i += 1
        else:
            i += nvalues
    return kept, lora_names


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


class RemoteOpenAIServer(FastDeployServer):
    """`python -m fastdeploy.entrypoints.cli.main serve` with vLLM's constructor, ready once /health answers 200."""

    DUMMY_API_KEY = "token-abc123"  # as vLLM's: the server needs no key unless the test sets one

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 override_hf_configs: dict | None = None) -> None:
        args = list(vllm_serve_args)
        if auto_port:
            if "-p" in args or "--port" in args:
                raise ValueError("You have manually specified the port when `auto_port=True`.")
            args += ["--port", str(get_open_port())]
        if seed is not None:
            args += ["--seed", str(seed)]
        args, self.lora_names = _drop_lora_flags(args)
        # Opt-in (supplementary runs only): FastDeploy refuses --dtype float16 on CPU, which stops the
        # tests that start with it before they test anything else; this reruns them in another dtype.
        if os.environ.get("VLLM_TESTS_FLOAT16_AS"):
            args = [os.environ["VLLM_TESTS_FLOAT16_AS"] if a in ("float16", "half") else a for a in args]
        if _flag_value(args, "--served-model-name") is None:
            args += ["--served-model-name", model]
        self.host = _flag_value(args, "--host") or "127.0.0.1"
        self.port = int(_flag_value(args, "--port"))
        self.show_hidden_metrics = _flag_value(args, "--show-hidden-metrics-for-version") is not None
        env = os.environ.copy()
        # As vLLM's CPU CI does: a small KV cache (GiB), the 2-core test machine is shared.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if env_dict is not None:
            env.update(env_dict)
        self.api_key = None
        self.cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", FD_MODEL, *args]
        print(f"Launching RemoteOpenAIServer (fastdeploy) with: {' '.join(self.cmd)}")
        self.launch(self.cmd, env)
        self.wait_for_health(max_wait_seconds or 240)

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def get_client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)
