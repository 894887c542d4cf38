"""The platform chooses the kernel paths once; layers built on a backend run that backend and no other."""

import os
import subprocess
import sys

import numpy as np
import pytest

from fastdeploy import _custom_ops
from fastdeploy.model_executor.custom_op import get_op_backend, set_op_backend
from fastdeploy.model_executor.layers.attention.cpu_attn import CpuPagedAttentionImpl
from fastdeploy.model_executor.layers.attention.paddle_attn import PaddleAttentionImpl
from fastdeploy.platforms import current_platform
from fastdeploy.platforms.cpu import cpu_flags, cpu_has_avx512, gguf_kernel_path
from fastdeploy.platforms.interface import ATTN_PREFETCH_L2, OpBackend
from tests.call_counter import count_calls
from tests.model_executor.utils import PagedRunner, build_tiny_checkpoint, load_our_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Every kernel entry point a layer may call.
KERNEL_OPS = ("linear", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rope_and_cache", "paged_attention",
              "decoder_layers")


def _run_steps(model) -> np.ndarray:
    """A prefill beside nothing, then a decode beside a chunked prefill: the logits of every step."""
    runner = PagedRunner(model, num_blocks=32, block_size=4, seed=1)
    runner.add("a", list(range(5, 20)))
    runner.add("b", list(range(40, 49)))
    out = [runner.step([("a", 15)]).numpy()]
    runner.append("a", 7)
    out.append(runner.step([("a", 1), ("b", 9)]).numpy())
    return np.concatenate(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of each kernel entry point."""
    return count_calls(monkeypatch, _custom_ops, KERNEL_OPS)


def test_the_platform_decides_once():
    assert current_platform.get_op_backend() is current_platform.get_op_backend()
    assert get_op_backend() is current_platform.get_op_backend()
    assert current_platform.get_attn_backend_cls() == current_platform.get_op_backend().attn_backend_cls


@pytest.mark.skipif(not _custom_ops.has(), reason="the C++ kernels are not built (FD_CPU_KERNELS=0)")
def test_kernel_backend_layers_run_the_kernels(checkpoint, kernel_calls):
    backend = current_platform.get_op_backend()
    fp32_path = "paged-avx512" if cpu_has_avx512() else "paged-avx2"
    bf16 = "avx512_bf16" in cpu_flags()
    amx = bf16 and {"amx_tile", "amx_bf16"} <= cpu_flags()
    assert backend.attention == ("paged-amx-bf16" if amx else "paged-avx512-bf16" if bf16 else fp32_path)
    assert backend.attn_isa == (2 if amx else 1 if bf16 else 0) + (ATTN_PREFETCH_L2 if backend.attention_prefetch == "l2" else 0)
    model = load_our_model(checkpoint)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.attn.impl, CpuPagedAttentionImpl)
    assert layer.input_layernorm.uses_kernel and layer.mlp.act_fn.uses_kernel
    assert layer.self_attn.qkv_proj.is_packed and model.lm_head.is_packed
    assert (layer._fused_args is not None) == backend.decoder_layer
    _run_steps(model)
    assert kernel_calls["linear"] > 0  # the LM head, at least
    if backend.decoder_layer:
        assert kernel_calls["decoder_layers"] == 2  # every layer in one call, in each of the two steps
    else:
        assert kernel_calls["paged_attention"] == 2 * model.num_layers


def test_plain_backend_layers_never_call_a_kernel(checkpoint, monkeypatch):
    reference = _run_steps(load_our_model(checkpoint))
    for name in KERNEL_OPS:
        monkeypatch.setattr(_custom_ops, name, lambda *a, _n=name, **k: pytest.fail(f"kernel {_n} was called"))
    with set_op_backend(OpBackend()):
        model = load_our_model(checkpoint)
    layer = model.model.layers[0]
    assert type(layer.self_attn.attn.impl) is PaddleAttentionImpl
    assert not layer.input_layernorm.uses_kernel and not layer.mlp.act_fn.uses_kernel
    assert not layer.self_attn.qkv_proj.is_packed and layer._fused_args is None
    # The layers keep their backend after the block that built them is left.
    np.testing.assert_allclose(_run_steps(model), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels", ["0", "1"])
def test_fd_cpu_kernels_picks_the_backend_and_the_log_names_it(kernels, checkpoint):
    code = (
        "from fastdeploy.platforms import current_platform\n"
        "from tests.model_executor.utils import load_our_model\n"
        f"load_our_model({checkpoint!r})\n"
        "print('BACKEND', current_platform.get_op_backend().describe())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FD_CPU_KERNELS": kernels}, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("BACKEND"))
    if kernels == "0":
        assert "linear: paddle-fp32" in line and "attention: paddle" in line and "decoder layer: per-op" in line
        assert "sampler: numpy" in line
        assert "gguf: paddle, huge pages: " in line
    else:
        assert ("attention: paged-avx" in line or "attention: paged-amx" in line) and "rms_norm: csrc" in line and "sampler: csrc" in line
        assert f"gguf: {gguf_kernel_path()}, huge pages: " in line
    # The loader logs the chosen paths once, as the model is built.
    logged = [x for x in out.stderr.splitlines() if "Kernel paths:" in x]
    assert len(logged) == 1 and line.removeprefix("BACKEND ") in logged[0]


def test_describe_names_each_path():
    backend = OpBackend(linear="panel", rms_norm="csrc", silu_and_mul="csrc", attention="paged-avx2",
                        decoder_layer=True, isa="AVX2", gguf="avx2", sampler="csrc", moe_routing="csrc")
    assert backend.describe("bfloat16") == ("linear: panel-bf16 (AVX2), attention: paged-avx2, rms_norm: csrc, "
                                            "silu_and_mul: csrc, fused_moe: paddle (routing: csrc), "
                                            "decoder layer: fused, "
                                            "sampler: csrc, gguf: avx2, huge pages: off")
    assert OpBackend(paddle_fused_rms_norm=True, huge_pages=True).describe() == (
        "linear: paddle-fp32, attention: paddle, rms_norm: paddle-fused, silu_and_mul: paddle, "
        "fused_moe: paddle (routing: paddle), decoder layer: per-op, sampler: numpy, gguf: paddle, huge pages: on")


def test_attention_prefetch_level_is_the_platforms_choice(monkeypatch):
    import fastdeploy.platforms.cpu as cpu

    for vendor, level in [("AuthenticAMD", "l2"), ("GenuineIntel", "l1"), (None, "l1")]:
        monkeypatch.setattr(cpu, "cpuinfo", lambda key, v=vendor: v if key == "vendor_id" else None)
        assert cpu.attention_prefetch_level("avx512-bf16") == level
        for wanted in ("l1", "l2"):
            monkeypatch.setenv("FD_CPU_ATTENTION_PREFETCH", wanted)
            assert cpu.attention_prefetch_level("avx512-bf16") == wanted
        monkeypatch.delenv("FD_CPU_ATTENTION_PREFETCH")
    monkeypatch.setenv("FD_CPU_ATTENTION_PREFETCH", "l3")
    with pytest.raises(ValueError, match="FD_CPU_ATTENTION_PREFETCH must be auto, l1 or l2, got 'l3'"):
        cpu.attention_prefetch_level("avx512-bf16")
    # Paddle's attention and the plain-C++ path prefetch nothing: the setting is moot there, and says so.
    warned = []
    monkeypatch.setattr(cpu.logger, "warning", lambda msg, *args: warned.append(msg % args))
    monkeypatch.setenv("FD_CPU_ATTENTION_PREFETCH", "l2")
    assert cpu.attention_prefetch_level(None) == "l1" and cpu.attention_prefetch_level("scalar") == "l1"
    assert len(warned) == 2 and "FD_CPU_ATTENTION_PREFETCH=l2 does nothing" in warned[0] and "scalar" in warned[1]
    monkeypatch.delenv("FD_CPU_ATTENTION_PREFETCH")
    assert cpu.attention_prefetch_level(None) == "l1" and len(warned) == 2
    # The kernels get it as a flag on attn_isa, and the start-up line names it.
    l2 = OpBackend(attention="paged-avx512-bf16", attention_prefetch="l2")
    assert l2.attn_isa == 1 + ATTN_PREFETCH_L2 and OpBackend(attention="paged-avx512-bf16").attn_isa == 1
    assert "attention: paged-avx512-bf16 (L2 prefetch), " in l2.describe()
    assert OpBackend(attention="paged-avx2", attention_prefetch="l2").attn_isa == ATTN_PREFETCH_L2


def test_fd_cpu_attention_kernel_picks_the_attention_path(monkeypatch):
    from fastdeploy.platforms.cpu import attention_kernel_path, attention_kernel_paths

    paths = attention_kernel_paths()
    assert paths[-1] in ("avx512", "avx2", "scalar") and attention_kernel_path() == paths[0]
    assert ("avx512-bf16" in paths) == ("avx512_bf16" in cpu_flags())
    assert ("amx-bf16" in paths) == ("avx512-bf16" in paths and {"amx_tile", "amx_bf16"} <= cpu_flags())
    for path in paths:
        monkeypatch.setenv("FD_CPU_ATTENTION_KERNEL", path)
        assert attention_kernel_path() == path
        assert OpBackend(attention=f"paged-{path}").attn_isa == {"avx512-bf16": 1, "amx-bf16": 2}.get(path, 0)
    monkeypatch.setenv("FD_CPU_ATTENTION_KERNEL", "avx9")
    with pytest.raises(ValueError,
                       match="FD_CPU_ATTENTION_KERNEL must be auto, amx-bf16, avx512-bf16, avx512, avx2 or scalar"):
        attention_kernel_path()
    import fastdeploy.platforms.cpu as cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setattr(cpu, "cpu_has_avx512", lambda: False)
    monkeypatch.setattr(cpu, "cpu_has_avx2_fma", lambda: True)
    assert attention_kernel_paths() == ["avx2"]
    monkeypatch.setenv("FD_CPU_ATTENTION_KERNEL", "avx512-bf16")
    with pytest.raises(ValueError, match="FD_CPU_ATTENTION_KERNEL=avx512-bf16 cannot run on this CPU; it runs: avx2"):
        attention_kernel_path()


def test_fd_cpu_gguf_kernel_picks_the_gguf_path(monkeypatch):
    from fastdeploy.platforms.cpu import gguf_kernel_paths

    paths = gguf_kernel_paths()
    assert paths[-1] == "scalar" and gguf_kernel_path() == paths[0]
    for path in paths:
        monkeypatch.setenv("FD_CPU_GGUF_KERNEL", path)
        assert gguf_kernel_path() == path
    monkeypatch.setenv("FD_CPU_GGUF_KERNEL", "avx9")
    with pytest.raises(ValueError, match="FD_CPU_GGUF_KERNEL must be auto, amx-int8, avx512-vnni, avx2 or scalar"):
        gguf_kernel_path()
    # A path this CPU cannot run, whatever CPU runs the test: an AVX2-only one is made up.
    import fastdeploy.platforms.cpu as cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setattr(cpu, "cpu_has_avx2_fma", lambda: True)
    assert gguf_kernel_paths() == ["avx2", "scalar"]
    # AMX-INT8 comes first where the CPU has it, with VNNI after it (it runs the rows AMX leaves).
    vnni = {"avx2", "fma", "f16c", "avx512_vnni", "avx512bw", "avx512vl"}
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(vnni | {"amx_tile", "amx_int8"}))
    assert gguf_kernel_paths() == ["amx-int8", "avx512-vnni", "avx2", "scalar"]
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(vnni | {"amx_tile", "amx_bf16"}))
    assert gguf_kernel_paths() == ["avx512-vnni", "avx2", "scalar"]
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setenv("FD_CPU_GGUF_KERNEL", "avx512-vnni")
    with pytest.raises(ValueError, match="FD_CPU_GGUF_KERNEL=avx512-vnni cannot run on this CPU; it runs: avx2, scalar"):
        gguf_kernel_path()


def test_fd_cpu_int_kernel_picks_the_integer_paths(monkeypatch):
    import fastdeploy.platforms.cpu as cpu

    paths = cpu.int_kernel_paths()
    assert paths[-1] == "scalar" and cpu.int_kernel_path() == paths[0]
    built = {"fd_int_linear", "fd_w8a8_linear", "fd_w8a8_linear_portable"}
    assert cpu.w8a8_kernel(built)[0] == "onednn" and cpu.w8a8_kernel(built - {"fd_w8a8_linear"})[0] == "scalar"
    for path in paths:
        monkeypatch.setenv("FD_CPU_INT_KERNEL", path)
        assert cpu.int_kernel_path() == path
    assert cpu.w8a8_kernel(built) == ("scalar", 127)  # FD_CPU_INT_KERNEL=scalar: the portable W8A8 too
    monkeypatch.setenv("FD_CPU_INT_KERNEL", "avx9")
    with pytest.raises(ValueError,
                       match="FD_CPU_INT_KERNEL must be auto, amx-bf16, avx512-bf16, onednn, avx512, avx2 or scalar"):
        cpu.int_kernel_path()
    # int_gemm.cc's bf16 dot products by default on AVX512-BF16, oneDNN's weight decompression on request.
    monkeypatch.setattr(cpu, "cpu_flags",
                        lambda: frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}))
    monkeypatch.setattr(cpu, "cpu_has_avx2_fma", lambda: True)
    monkeypatch.setenv("FD_CPU_INT_KERNEL", "auto")
    assert cpu.int_kernel_paths() == ["avx512-bf16", "avx512", "onednn", "avx2", "scalar"]
    assert cpu.int_kernel_choice(built | {"fd_weight_only_linear"}) == "avx512-bf16"
    # AMX tiles first where the CPU has them (Sapphire Rapids), for the fp8 weights too.
    amx = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(amx))
    assert cpu.int_kernel_paths() == ["amx-bf16", "avx512-bf16", "avx512", "onednn", "avx2", "scalar"]
    assert cpu.fp8_kernel_paths() == ["amx-bf16", "avx512-bf16", "avx512", "avx2", "scalar"]
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(amx - {"amx_bf16"}))
    assert cpu.int_kernel_paths()[0] == "avx512-bf16" and cpu.fp8_kernel_paths()[0] == "avx512-bf16"
    monkeypatch.setattr(cpu, "cpu_flags",
                        lambda: frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}))
    monkeypatch.setenv("FD_CPU_INT_KERNEL", "onednn")
    assert cpu.int_kernel_choice(built | {"fd_weight_only_linear"}) == "onednn"
    with pytest.raises(ValueError, match="FD_CPU_INT_KERNEL=onednn: the kernels were built without oneDNN"):
        cpu.int_kernel_choice(built)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512bw"}))
    with pytest.raises(ValueError, match="FD_CPU_INT_KERNEL=onednn cannot run on this CPU; it runs: avx512, avx2"):
        cpu.int_kernel_path()
    # An AVX2-only CPU (made up, whatever CPU runs the test): no AVX-512 path, and 7-bit W8A8 weights without VNNI.
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setattr(cpu, "cpu_has_avx2_fma", lambda: True)
    monkeypatch.setenv("FD_CPU_INT_KERNEL", "auto")
    assert cpu.int_kernel_paths() == ["avx2", "scalar"] and cpu.w8a8_kernel(built) == ("onednn", 63)
    monkeypatch.setenv("FD_CPU_INT_KERNEL", "avx512")
    with pytest.raises(ValueError, match="FD_CPU_INT_KERNEL=avx512 cannot run on this CPU; it runs: avx2, scalar"):
        cpu.int_kernel_path()
