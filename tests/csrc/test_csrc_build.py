"""How the kernels are found, built and chosen: dtype resolution, and the plain-Paddle fallback."""

import os
import subprocess
import sys

import pytest

from fastdeploy import _C
from fastdeploy.platforms.cpu import CpuPlatform, bf16_linear_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_the_library_is_cached_under_a_key_of_its_inputs():
    so = _C.ensure_built()
    assert so is not None and so.parent == _C.build_dir()
    assert _C.build_dir().name.startswith(f"{_C.LIB_NAME}-")
    assert set(_C.manifest()["sources"]) >= {"attention.cc", "layernorm.cc", "pos_encoding.cc", "activation.cc"}


@pytest.mark.skipif(bf16_linear_path() is None, reason="the CPU has no AMX-BF16 / AVX512-BF16 / AVX2+FMA")
def test_auto_dtype_is_bf16_with_the_kernels():
    platform = CpuPlatform()
    assert platform.resolve_dtype("auto") == "bfloat16"
    assert platform.resolve_dtype("float32") == "float32"
    with pytest.raises(ValueError, match="float16"):
        platform.resolve_dtype("float16")


def test_kernels_off_means_fp32_on_plain_paddle():
    code = (
        "from fastdeploy import _custom_ops as ops; from fastdeploy.platforms.cpu import CpuPlatform, bf16_linear_path\n"
        "p = CpuPlatform(); print(ops.has(), p.resolve_dtype('auto'))\n"
        "try:\n    p.resolve_dtype('bfloat16')\nexcept ValueError as e:\n    print('refused:', e)\n"
    )
    out = _python(code, FD_CPU_KERNELS="0")
    assert out.returncode == 0, out.stderr
    assert "False float32" in out.stdout
    assert "refused:" in out.stdout and "FD_CPU_KERNELS=0" in out.stdout


def test_a_missing_compiler_falls_back_with_one_warning(tmp_path):
    code = "from fastdeploy import _custom_ops as ops; print(ops.has(), ops.has('fd_linear'))"
    out = _python(code, FD_CACHE_ROOT=str(tmp_path), CXX="/nonexistent/c++")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
    assert out.stderr.count("C++ kernels unavailable") == 1 and "no C++ compiler" in out.stderr


@pytest.mark.slow
def test_every_kernel_source_builds_for_a_plain_x86_64_cpu(tmp_path):
    """Each path carries its own target attributes, so every source compiles for a baseline x86-64 CPU
    (no -march=native) and the platform picks a path at run time. Code that only builds where the
    compiling CPU has AVX-512 (an intrinsic outside its target region, e.g. in a default member
    initializer) fails here on any machine, not only in the AVX2-only host's build. -O0: the
    intrinsics are always_inline, so a target mismatch is an error without optimizing."""
    import shutil
    import sysconfig
    from concurrent.futures import ThreadPoolExecutor

    import paddle

    include = os.path.join(os.path.dirname(paddle.__file__), "include")
    plan = _C._build_plan()
    flags = ["-O0", "-march=x86-64", "-fopenmp", "-std=c++17", f"-I{include}",
             f"-I{os.path.join(include, 'third_party')}", f"-I{sysconfig.get_paths()['include']}"]
    flags += [f"-I{plan['onednn_include']}"] if plan["onednn_include"] else []

    def compile_one(src: str) -> tuple[str, subprocess.CompletedProcess]:
        obj = tmp_path / (os.path.basename(src) + ".o")
        cmd = [shutil.which("c++") or "c++", *flags, "-c", src, "-o", str(obj)]
        return src, subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = {os.path.basename(src): out.stderr[-2000:] for src, out in pool.map(compile_one, plan["sources"])
                  if out.returncode != 0}
    assert not failed, failed
    symbols = {name: subprocess.run(["nm", "-C", str(tmp_path / f"{name}.o")], capture_output=True, text=True).stdout
               for name in ("gguf_gemm.cc", "int_gemm.cc")}
    assert "gguf_vnni::" in symbols["gguf_gemm.cc"] and "gguf_avx2::" in symbols["gguf_gemm.cc"]
    assert "int_avx512_bf16::" in symbols["int_gemm.cc"] and "int_avx2::" in symbols["int_gemm.cc"]


def test_the_kernels_and_onednn_share_one_openmp_runtime():
    """Widened through the kernels' thread control, oneDNN's linear and a kernel of ours use the same pool.

    Two runtimes (the kernels on libgomp, oneDNN on Paddle's libiomp5) would each keep a pool of
    spin-waiting threads, and the linear would not widen at all.
    """
    code = (
        "import os, paddle\n"
        "from fastdeploy import _C, _custom_ops as ops\n"
        "control = _C.omp_thread_control(); get_threads, set_threads = control.get_threads, control.set_threads\n"
        "tasks = lambda: len(os.listdir('/proc/self/task'))\n"
        "x, w = paddle.randn([256, 512]), paddle.randn([512, 2048])\n"
        "packed = ops.linear_pack(w, 'float32')\n"
        "ops.linear(x, packed, None, 2048, 'float32'); ops.rms_norm(x, paddle.ones([512]), 1e-6)\n"
        "before = tasks(); set_threads(2)\n"
        "ops.linear(x, packed, None, 2048, 'float32'); after_linear = tasks()\n"
        "ops.rms_norm(x, paddle.ones([512]), 1e-6); after_norm = tasks()\n"
        "bt = control.get_blocktime(); control.set_blocktime(3)\n"
        "print(get_threads(), after_linear - before, after_norm - before, bt, control.get_blocktime())\n"
    )
    out = _python(code, OMP_NUM_THREADS="1", KMP_BLOCKTIME="150")
    assert out.returncode == 0, out.stderr[-2000:]
    # Paddle's libiomp5 has a blocktime (KMP_BLOCKTIME), settable per team.
    assert out.stdout.split()[-5:] == ["2", "1", "1", "150", "3"]
