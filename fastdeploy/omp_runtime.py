"""One OpenMP runtime per process: Paddle's Intel OpenMP (libiomp5), global before any other.

Paddle, its oneDNN (``libdnnl.so.3``, which names libgomp) and FastDeploy's kernels (linked
against libiomp5, _C.py) must run their parallel regions on one runtime: with two, each keeps
a pool of worker threads that spin-wait (libiomp5 for KMP_BLOCKTIME, 200 ms; libgomp for
GOMP_SPINCOUNT) on the same cores while the other pool computes.

torch, which transformers imports with the tokenizer (``fastdeploy.engine.llm_engine``), loads
its own libgomp with RTLD_GLOBAL. Imported before Paddle, it put libgomp first in the process's
global symbol scope, and libdnnl.so.3 (linked with BIND_NOW) bound its GOMP_* calls there when
Paddle loaded: oneDNN's matmuls ran on libgomp's pool, everything else on libiomp5's. Offline
decode of the default model with two threads on two cores was then more than ten times slower
than with one (tens of seconds for 8 tokens against 0.1 s per token, on a busy machine).

``import fastdeploy`` therefore loads Paddle's libiomp5 with RTLD_GLOBAL before anything can
import torch (:func:`make_paddle_openmp_global`): every library loaded after it, oneDNN and
torch included, binds the GOMP_* and omp_* entry points (libiomp5 implements libgomp's) to it.
Where something loaded another OpenMP first (torch imported before fastdeploy), the platform
finds it at start-up (:func:`foreign_global_openmp`) and computes on one thread.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

IOMP_LIB = "libiomp5.so"
# A GOMP entry point every OpenMP parallel region of GCC-compiled code calls (oneDNN's included).
PROBE_SYMBOL = "GOMP_parallel"


def paddle_lib_dir() -> Path | None:
    """Paddle's ``libs`` folder (libiomp5, libdnnl.so.3), found without importing Paddle."""
    spec = importlib.util.find_spec("paddle")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "libs"


def paddle_openmp_path() -> Path | None:
    """Paddle's libiomp5.so, or None where its wheel has none (the kernels then link libgomp)."""
    lib_dir = paddle_lib_dir()
    return lib_dir / IOMP_LIB if lib_dir is not None and (lib_dir / IOMP_LIB).is_file() else None


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def global_openmp_provider() -> str | None:
    """The file of the library that a library loaded now would bind ``GOMP_parallel`` to (None: no OpenMP yet)."""
    try:
        address = ctypes.cast(getattr(ctypes.CDLL(None), PROBE_SYMBOL), ctypes.c_void_p).value
    except AttributeError:
        return None
    info = _DlInfo()
    if not ctypes.CDLL(None).dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(os.fsdecode(info.dli_fname))


def make_paddle_openmp_global() -> None:
    """Load Paddle's libiomp5 with RTLD_GLOBAL unless an OpenMP is global already (then the check reports it).

    Loading it starts no thread: the runtime initializes at its first parallel region, after
    ``import fastdeploy`` has set OMP_NUM_THREADS.
    """
    path = paddle_openmp_path()
    if path is None or global_openmp_provider() is not None:
        return
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def foreign_global_openmp() -> str | None:
    """The other OpenMP runtime oneDNN binds to instead of Paddle's libiomp5, or None when there is one runtime."""
    path = paddle_openmp_path()
    provider = global_openmp_provider()
    if path is None or provider is None or provider == os.path.realpath(path):
        return None
    return provider


def compute_on_one_runtime() -> bool:
    """At start-up of a computing process: with two OpenMP runtimes, compute on one thread in each.

    One thread per team starts no worker thread in either runtime, so neither pool spins while
    the other computes: as fast as OMP_NUM_THREADS=1, rather than several times slower. Returns
    whether it had to (a warning names the runtime and the way out).
    """
    foreign = foreign_global_openmp()
    if foreign is None:
        return False
    from fastdeploy.logger import init_logger

    init_logger(__name__).warning(
        "oneDNN runs on the OpenMP runtime %s, not on Paddle's %s like the other kernels: it was loaded "
        "before fastdeploy was imported (torch brings its own libgomp). Two pools of threads would spin on the "
        "same cores, so this process computes on one thread; import fastdeploy before torch or transformers "
        "(or start with LD_PRELOAD=%s) to compute on OMP_NUM_THREADS threads.",
        foreign, IOMP_LIB, paddle_openmp_path())
    ctypes.CDLL(None).omp_set_num_threads(1)  # the global one, which oneDNN calls
    ctypes.CDLL(str(paddle_openmp_path())).omp_set_num_threads(1)  # Paddle's and the kernels'
    return True
