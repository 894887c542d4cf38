"""fastdeploy/omp_runtime.py: oneDNN, Paddle and the kernels run on one OpenMP runtime, whatever imports torch.

torch loads its own libgomp with RTLD_GLOBAL; imported before Paddle (transformers imports it with
the tokenizer), oneDNN's parallel regions bound to it while the kernels ran on Paddle's libiomp5,
and offline decode with two threads on two cores ran over ten times slower than with one. These
tests read which library the dynamic linker bound oneDNN's ``GOMP_parallel`` to (LD_DEBUG), not
timings.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastdeploy import omp_runtime

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(omp_runtime.paddle_openmp_path() is None, reason="Paddle's wheel has no libiomp5"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch (its own libgomp) is not installed"),
]


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "2", "LD_DEBUG": "bindings", "FD_LOGGING_LEVEL": "WARNING"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def _onednn_openmp(stderr: str) -> set[str]:
    """The libraries LD_DEBUG says libdnnl.so.3's GOMP_parallel was bound to."""
    found = re.findall(r"binding file \S*libdnnl\.so\.3 \[\d+\] to (\S+) \[\d+\]: normal symbol `GOMP_parallel'", stderr)
    return {os.path.realpath(path) for path in found}


def _threads_probe() -> str:
    """Code that prints the thread counts of the global OpenMP runtime and of Paddle's libiomp5."""
    return ("import ctypes; from fastdeploy import omp_runtime as o\n"
            "print('THREADS', ctypes.CDLL(None).omp_get_max_threads(),"
            " ctypes.CDLL(str(o.paddle_openmp_path())).omp_get_max_threads())\n")


def test_importing_fastdeploy_first_keeps_onednn_on_paddles_openmp() -> None:
    # The order of LLM(...): fastdeploy, then transformers (torch), then Paddle.
    out = _run("import fastdeploy, torch, paddle\nfrom fastdeploy import omp_runtime as o\n"
               "print('SPLIT', o.compute_on_one_runtime())\n" + _threads_probe())
    assert out.returncode == 0, out.stderr[-3000:]
    assert _onednn_openmp(out.stderr) == {os.path.realpath(omp_runtime.paddle_openmp_path())}
    assert "SPLIT False" in out.stdout
    assert "THREADS 2 2" in out.stdout  # OMP_NUM_THREADS is kept


def test_torch_imported_first_is_found_and_each_runtime_computes_on_one_thread() -> None:
    out = _run("import torch, fastdeploy, paddle\nfrom fastdeploy import omp_runtime as o\n"
               "print('FOREIGN', o.foreign_global_openmp())\nprint('SPLIT', o.compute_on_one_runtime())\n"
               + _threads_probe())
    assert out.returncode == 0, out.stderr[-3000:]
    bound = _onednn_openmp(out.stderr)
    assert len(bound) == 1 and "libgomp" in next(iter(bound))  # the split the first test guards against
    assert f"FOREIGN {next(iter(bound))}" in out.stdout
    assert "SPLIT True" in out.stdout and "THREADS 1 1" in out.stdout
    assert "computes on one thread" in out.stderr


def test_the_global_provider_is_paddles_libiomp5_after_import_fastdeploy() -> None:
    # This test process imported fastdeploy (conftest) before anything imported torch.
    if "torch" in sys.modules and omp_runtime.foreign_global_openmp() is not None:
        pytest.skip("torch was imported before fastdeploy in this test process")
    assert omp_runtime.global_openmp_provider() == os.path.realpath(omp_runtime.paddle_openmp_path())
