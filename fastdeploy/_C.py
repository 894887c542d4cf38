"""Build and load FastDeploy's C++ kernels (``csrc/cpu``) as one Paddle custom-op library.

The library is compiled with ``paddle.utils.cpp_extension`` the first time a process
needs it (``pip install -e .`` already runs ``python -m fastdeploy._C`` once, so a fresh
install normally finds it built) into ``<FD_CACHE_ROOT>/kernels/<key>/``. The key hashes
the sources, the compiler flags, the Paddle, Python and oneDNN-header versions and the
CPU's feature flags: editing a kernel or moving the cache to another CPU rebuilds
rather than loading a stale or ``-march=native``-incompatible binary.

The compiler runs in a child process under a file lock, so concurrent processes
(an engine and its server, parallel tests) build once and the parent never imports
half a library. A failed build leaves a ``FAILED`` marker with the log beside it,
logs one warning, and every caller falls back to plain Paddle ops; delete the
folder (or change anything in the key) to retry.

oneDNN: the headers come from ``onednn-devel==2025.0.1`` (oneDNN 3.6, the version of
the ``libdnnl.so.3`` inside Paddle's wheel, which is what the linear kernel links
against). Without matching headers the other kernels are still built, without
``fd_linear``.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from fastdeploy import envs, omp_runtime
from fastdeploy.logger import init_logger
from fastdeploy.platforms.cpu_features import cpu_flags_line

logger = init_logger(__name__)

LIB_NAME = "fastdeploy_ops"
CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc" / "cpu"
# The oneDNN kernels (and moe.cc, built on linear.cc's GEMM) need dnnl headers whose version matches
# Paddle's libdnnl.so.3.
ONEDNN_SOURCES = ("linear.cc", "decoder_layer.cc", "moe.cc")
CXX_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-DNDEBUG"]
# Without Paddle's Intel OpenMP (below), the kernels run on GCC's libgomp.
LD_FLAGS = ["-fopenmp"]
# Paddle's libdnnl.so.3 names libgomp, but inside Paddle its OpenMP calls bind to the libiomp5 that
# Paddle loads first (LD_DEBUG=bindings shows it): linked against libgomp, the kernels had a runtime
# of their own beside oneDNN's, two pools of threads spin-waiting on the same cores in turn, so
# that two threads computed a prefill slower than one. GCC's OpenMP code calls the GOMP_* entry
# points, which libiomp5 implements too: linked against it instead, every kernel, oneDNN and
# Paddle share one pool (as long as no other OpenMP came first: fastdeploy/omp_runtime.py).
ONEDNN_LD_FLAGS = ["-l:libdnnl.so.3"]


def _link_flags() -> list[str]:
    """The OpenMP runtime to link: Paddle's libiomp5 where its wheel has one (on the -L path and rpath
    Paddle's cpp_extension sets), else libgomp."""
    return [f"-l:{omp_runtime.IOMP_LIB}"] if omp_runtime.paddle_openmp_path() is not None else LD_FLAGS


def _onednn_include_dir() -> tuple[Path | None, str]:
    """(include folder with oneapi/dnnl/dnnl.hpp matching Paddle's libdnnl, reason when there is none)."""
    candidates = []
    try:  # where pip put the onednn-devel distribution's headers (venv, --user or system prefix)
        for f in importlib.metadata.files("onednn-devel") or []:
            if str(f).replace("\\", "/").endswith("oneapi/dnnl/dnnl.hpp"):
                candidates.append(Path(f.locate()).resolve().parent.parent.parent)
    except importlib.metadata.PackageNotFoundError:
        pass
    candidates += [Path(p) / "include" for p in (sys.prefix, sysconfig.get_paths()["data"], sys.base_prefix)]
    wanted = _paddle_onednn_version()
    seen = []
    for folder in dict.fromkeys(candidates):
        header = folder / "oneapi" / "dnnl" / "dnnl_version.h"
        if not header.is_file():
            continue
        text = header.read_text(encoding="utf-8", errors="replace")
        version = tuple(int(re.search(rf"DNNL_VERSION_{part} (\d+)", text).group(1)) for part in ("MAJOR", "MINOR"))
        seen.append(f"{folder} ({version[0]}.{version[1]})")
        if wanted is None or version == wanted:
            return folder, ""
    if seen:
        return None, (
            f"oneDNN headers {', '.join(seen)} do not match Paddle's libdnnl.so.3 "
            f"({'.'.join(map(str, wanted or ()))}); install onednn-devel==2025.0.1 with --no-deps"
        )
    return None, "no oneDNN headers found; install onednn-devel==2025.0.1 with --no-deps"


@cache
def _paddle_onednn_version() -> tuple[int, int] | None:
    """(major, minor) of the libdnnl.so.3 in Paddle's wheel, read from its dnnl_version()."""
    lib_dir = omp_runtime.paddle_lib_dir()
    if lib_dir is None or not (lib_dir / "libdnnl.so.3").is_file():
        return None

    class _Version(ctypes.Structure):
        _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int)]

    try:
        lib = ctypes.CDLL(str(lib_dir / "libdnnl.so.3"))
        lib.dnnl_version.restype = ctypes.POINTER(_Version)
        v = lib.dnnl_version().contents
        return v.major, v.minor
    except (OSError, AttributeError):
        return None


def _sources(with_onednn: bool) -> list[Path]:
    return [p for p in sorted(CSRC_DIR.glob("*.cc")) if with_onednn or p.name not in ONEDNN_SOURCES]


@cache
def _build_plan() -> dict:
    """Everything that decides the binary: sources, flags, include folders, versions; and the cache key."""
    onednn_include, onednn_missing = _onednn_include_dir()
    sources = _sources(onednn_include is not None)
    digest = hashlib.sha256()
    for path in sorted(CSRC_DIR.glob("*")):
        if path.suffix in (".cc", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    try:
        paddle_version = importlib.metadata.version("paddlepaddle")
    except importlib.metadata.PackageNotFoundError:
        paddle_version = "none"
    for part in (
        json.dumps([str(s.name) for s in sources]),
        " ".join(CXX_FLAGS + _link_flags()),
        paddle_version,
        platform.python_version(),
        str(onednn_include),
        cpu_flags_line(),
    ):
        digest.update(part.encode() + b"\0")
    return {
        "sources": [str(s) for s in sources],
        "onednn_include": str(onednn_include) if onednn_include else None,
        "onednn_missing": onednn_missing,
        "key": digest.hexdigest()[:16],
    }


def build_dir() -> Path:
    """Folder of the library built from the current sources on this machine."""
    return Path(envs.cache_root()) / "kernels" / f"{LIB_NAME}-{_build_plan()['key']}"


def _compile(out_dir: str) -> None:
    """Child-process entry: compile the library into ``out_dir`` and write its manifest."""
    from paddle.utils.cpp_extension import load

    plan = _build_plan()
    include = [plan["onednn_include"]] if plan["onednn_include"] else []
    ldflags = _link_flags() + (ONEDNN_LD_FLAGS if plan["onednn_include"] else [])
    load(
        name=LIB_NAME,
        sources=plan["sources"],
        extra_cxx_cflags=CXX_FLAGS,
        extra_ldflags=ldflags,
        extra_include_paths=include,
        build_directory=out_dir,
        verbose=False,
    )
    so = Path(out_dir) / LIB_NAME / f"{LIB_NAME}.so"
    shutil.copy2(so, Path(out_dir) / f"{LIB_NAME}.so")
    manifest = {"sources": [Path(s).name for s in plan["sources"]], "onednn_missing": plan["onednn_missing"]}
    (Path(out_dir) / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


def _run_compiler(target: Path) -> None:
    """Compile into a temporary folder beside ``target``, then move it into place (or mark failure)."""
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    log_path = tmp / "build.log"
    repo_root = Path(__file__).resolve().parent.parent
    # The child imports this module by name from the source tree, whatever sys.path the parent had.
    python_path = os.pathsep.join([str(repo_root)] + [p for p in [envs.python_path()] if p])
    env = envs.environment_with({"PYTHONPATH": python_path})
    logger.info("Building the C++ kernels (csrc/cpu) into %s; this takes about a minute, once.", target)
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "fastdeploy._C", "--compile-into", str(tmp)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(repo_root),
            env=env,
            check=False,
        )
    if proc.returncode == 0 and (tmp / f"{LIB_NAME}.so").is_file():
        shutil.rmtree(tmp / LIB_NAME, ignore_errors=True)  # the setuptools build tree
        os.rename(tmp, target)
        _prune_old_builds(keep=target)
        return
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy2(log_path, target / "build.log")
    (target / "FAILED").write_text(f"exit code {proc.returncode}\n", encoding="utf-8")
    shutil.rmtree(tmp, ignore_errors=True)


def _prune_old_builds(keep: Path, max_kept: int = 4) -> None:
    """Delete all but the newest few builds (each edit of a kernel makes a new key); never ``keep``."""
    builds = sorted(keep.parent.glob(f"{LIB_NAME}-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [b for b in builds if b != keep][max_kept - 1 :]:
        shutil.rmtree(old, ignore_errors=True)  # a process that mapped its .so keeps the mapping


def ensure_built() -> Path | None:
    """Path of the built library (building it first if needed), or None when it cannot be built.

    Does not import Paddle in this process. Returns None without trying when
    FD_CPU_KERNELS=0 or the sources are not installed.
    """
    if not envs.cpu_kernels_enabled() or not CSRC_DIR.is_dir():
        return None
    target = build_dir()
    so = target / f"{LIB_NAME}.so"
    if so.is_file():
        return so
    if (target / "FAILED").is_file():
        return None
    if shutil.which(envs.cxx()) is None:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if not so.is_file() and not (target / "FAILED").is_file():
            _run_compiler(target)
    return so if so.is_file() else None


def manifest() -> dict:
    """What the built library contains: {"sources": [...], "onednn_missing": reason or ""}."""
    path = build_dir() / "manifest.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def failure_reason() -> str:
    """Why the kernels are not available, for the fallback warning."""
    if not envs.cpu_kernels_enabled():
        return "FD_CPU_KERNELS=0"
    if not CSRC_DIR.is_dir():
        return f"the kernel sources ({CSRC_DIR}) are not installed"
    if shutil.which(envs.cxx()) is None:
        return "no C++ compiler (c++) on PATH"
    log = build_dir() / "build.log"
    if log.is_file():
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-15:]
        return f"the build failed (log: {log}):\n" + "\n".join(tail)
    return "the library did not build"


@cache
def load() -> frozenset[str]:
    """Register the kernels with Paddle once per process; returns the op names (empty: not available)."""
    so = ensure_built()
    if so is None:
        logger.warning("C++ kernels unavailable, using plain Paddle ops (slower): %s", failure_reason())
        return frozenset()
    try:
        from paddle.utils.cpp_extension import load_op_meta_info_and_register_op

        names = frozenset(load_op_meta_info_and_register_op(str(so)))
        # oneDNN's and the kernels' OpenMP: one runtime, or one thread in each.
        omp_runtime.compute_on_one_runtime()
    except Exception as e:  # noqa: BLE001 - any load error means: fall back, loudly, once
        logger.warning("C++ kernels failed to load from %s, using plain Paddle ops: %s", so, e)
        return frozenset()
    missing = manifest().get("onednn_missing")
    if missing:
        logger.warning("C++ kernels built without the oneDNN linear (no bf16 matmul): %s", missing)
    return names


@dataclass(frozen=True)
class OmpControl:
    """The OpenMP runtime the kernels and oneDNN run on, as the calling thread sets up its next teams.

    ``get_blocktime`` answers -1 where the runtime (libgomp) has no blocktime; setting it then does nothing.
    """

    get_threads: Callable[[], int]
    set_threads: Callable[[int], None]
    get_blocktime: Callable[[], int]
    set_blocktime: Callable[[int], None]


def omp_thread_control() -> OmpControl | None:
    """The kernels' OpenMP thread count and blocktime controls, or None without the kernels."""
    if not load():
        return None
    so = ensure_built()
    try:
        lib = ctypes.CDLL(str(so))
        functions = [getattr(lib, f"fd_omp_{name}") for name in
                     ("get_max_threads", "set_num_threads", "get_blocktime", "set_blocktime")]
    except (OSError, AttributeError) as e:
        logger.warning("C++ kernels at %s lack their thread control: %s", so, e)
        return None
    for f, getter in zip(functions, (True, False, True, False), strict=True):
        f.argtypes, f.restype = ([], ctypes.c_int) if getter else ([ctypes.c_int], None)
    return OmpControl(*functions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build FastDeploy's C++ kernels into the cache.")
    parser.add_argument("--compile-into", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_into:
        _compile(args.compile_into)
        return 0
    so = ensure_built()
    if so is None:
        print(f"FastDeploy kernels not built: {failure_reason()}", file=sys.stderr)
        return 1
    print(so)
    return 0


if __name__ == "__main__":
    sys.exit(main())
