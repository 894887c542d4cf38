"""Model-runner step times of the default model: plain Paddle vs the C++ kernels, fp32 and bf16.

The three configurations live in one process and take turns step by step, so load from
other work on the machine hits them alike (timings on a shared machine drift by 2x within
minutes; only an interleaved comparison is fair). A step is the engine's whole
``ModelRunner.execute_model``: inputs and metadata, forward, LM head on the sampled rows,
greedy sampling.

The first three dequantize the GGUF at load (``--quantization none``).

- ``paddle-fp32``: plain Paddle ops (the model is loaded and first run inside
  ``set_op_backend(OpBackend())``, which is what FD_CPU_KERNELS=0 gives a whole process);
- ``kernels-fp32``: the C++ kernels with fp32 weights (``--dtype float32``);
- ``kernels-bf16``: the C++ kernels with bf16 weights and KV cache (``--dtype auto`` where a
  bf16 kernel is built: oneDNN on AMX / AVX512-BF16, the panel kernel on AVX2);
- ``gguf``: ``--quantization gguf`` (a GGUF file's default), the file's Q4_1 / Q8_0 blocks multiplied by the block
  kernels (csrc/cpu/gguf_gemm.cc), bf16 KV cache where kernels-bf16 has one.
- ``hf-bf16``, ``wint8``, ``wint4``, ``w8a8``, ``fp8``: the same weights as a Hugging Face folder, in bf16
  and quantized at load by ``--quantization`` (csrc/cpu/int_gemm.cc; oneDNN's int8 matmul for w8a8;
  csrc/cpu/fp8_gemm.cc's e4m3 weights for fp8).

``NAME@PATH`` (``gguf``, ``wint8``, ``wint4``, ``fp8``) builds that format on another kernel path than the
platform's (FD_CPU_GGUF_KERNEL's / FD_CPU_INT_KERNEL's names, e.g. ``wint8@avx512-bf16`` beside ``wint8`` or
``gguf@avx512-vnni`` beside ``gguf`` on an AMX CPU), so two paths take turns in one process. ``NAME/per-layer`` runs a configuration with one ``fd_decoder_layers`` call per layer instead
of one for the whole model (how the fused layers ran before they took runs), e.g. ``gguf gguf/per-layer``
measures what the custom-op dispatch costs per layer.

Figures (medians): decode step at batch 1 and 16, each sequence with ``--context`` tokens of
context, and the prefill of one ``--prefill-len``-token prompt; one process per thread count.
Beside them, per GGUF format, the matmuls of one decode step (M = 1, LM head included) and of a
``--prefill-len``-token prefill (LM head excluded) at the default model's shapes, block kernel
against the bf16 linear kernel, and the peak RSS of each configuration's engine in a fresh process.
MoE rows (``--moe-only`` for just those): ``--moe-layers`` MoE layers at ERNIE-4.5-21B-A3B's and
Qwen3-30B-A3B's shapes on dummy weights against dense SwiGLU layers with the same active
parameters, batch 1 and 16, per expert format (``--moe-formats``: bf16, wint4, Q4_K; the dense
layer in the same format), with the weight bytes each step reads, the rate it reads them at, and
at batch 16 ``moe_floor_over_dense``: the MoE step's bytes at the best rate of the format's
batch-1 (memory-bound) layers, over the dense step.

    python benchmarks/benchmark_kernels.py --threads 1 2

``--vision`` measures instead the vision-language rows: the vision encoder on one 448x448 image
(256 placeholder tokens after the 2x2 merge) and the TTFT of one chat prompt with that image
(image processing in the API process's code path, encoder, prefill, first token) on dummy
weights at Qwen2.5-VL-3B's and PaddleOCR-VL-0.9B's real shapes, in ``--vision-dtype`` (bf16 by
default: the towers' and the decoder's projections on the packed linear kernel), each model in
its own process with its peak RSS and the encoder's per-module time. Qwen2.5-VL-3B's TTFT needs
the whole 3B model (~10 GB resident in bf16, 12 GB peak while loading), so it runs only with ``--vision-full-3b``; without it the
encoder runs alone.

    python benchmarks/benchmark_kernels.py --vision --vision-full-3b --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time

# name -> (dtype, quantization); "none": the GGUF file dequantized at load (without -q it is served in its blocks).
CONFIGS = {"paddle-fp32": ("float32", "none"), "kernels-fp32": ("float32", "none"), "kernels-bf16": ("bfloat16", "none"),
           "gguf": ("auto", "gguf"), "hf-bf16": ("bfloat16", None), "wint8": ("auto", "wint8"),
           "wint4": ("auto", "wint4"), "w8a8": ("auto", "w8a8"), "fp8": ("auto", "fp8")}
# Configurations of the default model's weights as a Hugging Face folder (the integer formats quantize it at
# load; hf-bf16 is their baseline).
HF_CONFIGS = ("hf-bf16", "wint8", "wint4", "w8a8", "fp8")


def hf_model() -> str:
    """The default model as a Hugging Face folder (converted once, cached by compare_vllm)."""
    from compare_vllm import ensure_hf_model

    from fastdeploy import envs

    return ensure_hf_model(envs.cache_root())


class Setup:
    """One configuration: a worker with its model and KV cache, and requests to drive it."""

    def __init__(self, name: str, dtype: str, quantization: str | None) -> None:
        from dataclasses import replace

        import numpy as np

        from fastdeploy.engine.arg_utils import EngineArgs
        from fastdeploy.model_executor.custom_op import get_op_backend, set_op_backend
        from fastdeploy.platforms.interface import OpBackend
        from fastdeploy.sampling_params import SamplingParams
        from fastdeploy.worker.worker import Worker

        self.name = name
        name, per_layer = _split_per_layer(name)
        base, _, path = name.partition("@")
        model = {"model": hf_model()} if base in HF_CONFIGS else {}
        if name == "paddle-fp32":
            backend = set_op_backend(OpBackend())
        elif path:  # another GGUF / integer / fp8 kernel path than the platform's, in the same process
            paths = {"gguf": path} if base == "gguf" else {"int_gemm": path, "fp8": path}
            backend = set_op_backend(replace(get_op_backend(), **paths))
        else:
            backend = contextlib.nullcontext()
        with backend:
            args = EngineArgs(dtype=dtype, quantization=quantization, max_model_len=2048,
                              kv_cache_memory_bytes=512 << 20, max_num_seqs=32, **model)
            self.config = args.create_engine_config()
            self.worker = Worker(self.config)
            self.worker.load_model()
            self.num_blocks = self.worker.determine_num_available_blocks()
            self.worker.initialize_cache(self.num_blocks)
            self.runner = self.worker.model_runner
            if per_layer:
                from fastdeploy.model_executor.models.fused_layers import plan_runs

                decoder = self.runner.model.model
                decoder._plan = plan_runs([layer._fused_args for layer in decoder.layers], max_layers=1)
            self.rng = np.random.default_rng(0)
            self.greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
            self.counter = 0
            self.live: list = []
            self.reset_blocks()
            self.prefill(8)

    def reset_blocks(self) -> None:
        self.free = iter(range(self.num_blocks))

    def new_request(self, prompt_len: int, total_len: int):
        from fastdeploy.engine.sched.output import NewRequestData

        bs = self.config.cache_config.block_size
        blocks = [next(self.free) for _ in range(-(-total_len // bs))]
        self.counter += 1
        tokens = self.rng.integers(100, 49000, prompt_len).tolist()
        return NewRequestData(f"r{self.counter}", tokens, prompt_len, self.greedy, blocks, 0)

    def run(self, so) -> float:
        t0 = time.perf_counter()
        self.runner.execute_model(so)
        return (time.perf_counter() - t0) * 1e3

    def prefill(self, prompt_len: int, batch: int = 1, total_len: int | None = None) -> float:
        """Drop the live requests, start ``batch`` new ones and run their prefill; returns its ms."""
        from fastdeploy.engine.sched.output import SchedulerOutput

        finished = {r.req_id for r in self.live}
        self.reset_blocks()
        self.live = [self.new_request(prompt_len, total_len or prompt_len + 1) for _ in range(batch)]
        n = {r.req_id: prompt_len for r in self.live}
        self.computed = prompt_len
        return self.run(SchedulerOutput(self.live, [], n, sum(n.values()), finished_req_ids=finished))

    def decode(self) -> float:
        from fastdeploy.engine.sched.output import CachedRequestData, SchedulerOutput

        cached = [CachedRequestData(r.req_id, [], self.computed) for r in self.live]
        n = {r.req_id: 1 for r in self.live}
        self.computed += 1
        return self.run(SchedulerOutput([], cached, n, len(self.live)))


def _split_per_layer(name: str) -> tuple[str, bool]:
    """``NAME/per-layer`` -> (NAME, True)."""
    base = name.removesuffix("/per-layer")
    return base, base != name


def _base_config(name: str) -> str:
    return _split_per_layer(name)[0].partition("@")[0]


def measure(configs: list[str], context: int, prefill_len: int, steps: int) -> dict:
    """Child process (one thread count): interleaved step times of every configuration."""
    import resource

    from fastdeploy.utils.gc_utils import freeze_gc_heap

    load_before = os.getloadavg()
    setups = [Setup(name, *CONFIGS[_base_config(name)]) for name in configs]
    # As the engine core does after start-up: otherwise Python's full collections walk the loaded
    # models' objects during the timed steps (~3% of a 256-token prefill here, none in the engine).
    freeze_gc_heap()
    times: dict[str, dict[str, list[float]]] = {s.name: {} for s in setups}
    for _ in range(max(3, steps // 4)):
        for s in setups:
            times[s.name].setdefault(f"prefill_{prefill_len}_ms", []).append(s.prefill(prefill_len))
    for batch in (1, 16):
        for s in setups:
            s.prefill(context, batch, context + steps + 4)
            s.decode()  # warm-up
        for _ in range(steps):
            for s in setups:
                times[s.name].setdefault(f"decode_b{batch}_ms", []).append(s.decode())
    result = {name: {k: round(statistics.median(v), 2) for k, v in by_key.items()} for name, by_key in times.items()}
    for name, by_key in times.items():
        result[name]["samples"] = {k: [round(x, 2) for x in v] for k, v in by_key.items()}
    result["peak_rss_mb_all_configs"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    # The 1-minute load average around the run: above the core count, other work shared the cores.
    result["load_average"] = [round(load_before[0], 1), round(os.getloadavg()[0], 1)]
    return result


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def default_model_matmuls() -> tuple[int, list[tuple[int, int]], tuple[int, int]]:
    """The default model's matmul shapes as (K, N): its layer count, one layer's projections (qkv, o,
    gate_up, down) and its LM head."""
    from fastdeploy.transformers_utils.config import get_hf_config
    from fastdeploy.transformers_utils.model_resolver import resolve_model

    cfg = get_hf_config(*resolve_model("SmolLM2-135M-Instruct"), False)
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    return cfg.num_hidden_layers, [(h, qkv), (h, h), (h, 2 * inter), (inter, h)], (h, cfg.vocab_size)


def measure_formats(prefill_len: int) -> dict:
    """Child process: per GGUF format, the default model's matmuls of a decode step and a prefill (ms)."""
    import numpy as np
    import paddle

    from fastdeploy import _custom_ops as ops
    from fastdeploy.model_executor.custom_op import get_op_backend
    from fastdeploy.model_executor.layers.quantization.gguf import GGUF_KERNEL_TYPES, KERNEL_PATHS, random_blocks

    num_layers, layer_shapes, head = default_model_matmuls()
    rng = np.random.default_rng(0)
    isa = KERNEL_PATHS[get_op_backend().gguf]
    xs: dict[tuple[int, int], paddle.Tensor] = {}

    def x_of(m: int, k: int) -> paddle.Tensor:
        if (m, k) not in xs:
            xs[m, k] = paddle.to_tensor(rng.standard_normal((m, k)).astype(np.float32))
        return xs[m, k]

    def step_ms(run) -> dict:
        """run(k, n, m) -> ms of one matmul; a decode step = layers x shapes + head, a prefill without the head."""
        decode = num_layers * sum(run(k, n, 1) for k, n in layer_shapes) + run(*head, 1)
        prefill = num_layers * sum(run(k, n, prefill_len) for k, n in layer_shapes)
        return {"decode_matmuls_ms": round(decode, 2), f"prefill_{prefill_len}_matmuls_ms": round(prefill, 2)}

    def bf16(k: int, n: int, m: int) -> float:
        packed = ops.linear_pack(paddle.to_tensor(rng.standard_normal((k, n)).astype(np.float32)), "bfloat16")
        return _median_ms(lambda: ops.linear(x_of(m, k), packed, None, n, "bfloat16"), 20 if m == 1 else 3)

    rows = {"bf16-linear": step_ms(bf16)}
    for ggml_type, type_name in GGUF_KERNEL_TYPES.items():
        block = 256 if type_name.endswith("_K") else 32

        def gguf(k: int, n: int, m: int, t: int = ggml_type, block: int = block) -> float:
            k = -(-k // block) * block  # K-quants need K in whole 256-superblocks (576 -> 768)
            w = ops.gguf_pack(paddle.to_tensor(random_blocks(t, n, k, rng).reshape(-1)), [t, n], k)
            return _median_ms(lambda: ops.gguf_linear(x_of(m, k), w, None, [t, n], isa), 20 if m == 1 else 3)

        rows[f"gguf-{type_name}"] = step_ms(gguf)
    note = "K-quant rows round K up to whole 256-element superblocks (576 -> 768): more work than the model's shapes"
    return {"kernel_path": get_op_backend().gguf, "rows": rows, "note": note}


# Real MoE layer shapes: (hidden, experts, top-k, expert intermediate, shared experts' intermediate).
MOE_SHAPES = {
    "ERNIE-4.5-21B-A3B": (2560, 64, 6, 1536, 2 * 1536),
    "Qwen3-30B-A3B": (2048, 128, 8, 768, 0),
}


# Expert weight formats of the MoE rows: the packed linear kernel's bf16, int_gemm.cc's wint4 (groups of
# 128) and gguf_gemm.cc's Q4_K; the dense layer of each row is in the same format.
MOE_FORMATS = ("bf16", "wint4", "q4_k")


def measure_moe(num_layers: int, reps: int, formats: tuple[str, ...] = MOE_FORMATS) -> dict:
    """Child process: MoE layers at real shapes on dummy weights vs a dense SwiGLU of the same active size.

    An MoE layer is the fp32 router matmul, softmax top-k, the fused MoE op of the format (``fd_fused_moe``,
    ``fd_int_fused_moe``, ``fd_gguf_fused_moe``) and the shared experts' SwiGLU (inside the quantized ops, as
    a served model runs them; after ``fd_fused_moe``); the dense layer has
    ``top_k * I (+ shared)`` intermediate columns, the parameters one token uses in the MoE layer, in the
    same format. Routing is random (uniform over experts: at batch 16 most experts are hit, the worst
    case for the weight reads). The two take turns rep by rep over ``num_layers`` layers; one format's
    layers are built, timed and freed before the next one's.
    """
    rows = {model: _moe_row(*shape, num_layers, reps, formats) for model, shape in MOE_SHAPES.items()}
    return {"rows": rows, "note": "median ms of the layers' forward per expert format, MoE and dense taking turns"}


class _MoeFormat:
    """One expert weight format for the MoE rows: dummy ``[K, N]`` matrices (``x @ W``), the dense linear and
    the fused MoE op on them. Quantized weights are random codes with small scales: timings do not depend
    on the values."""

    def __init__(self, fmt: str, rng) -> None:
        from fastdeploy.model_executor.custom_op import get_op_backend
        from fastdeploy.model_executor.layers.quantization import gguf
        from fastdeploy.model_executor.layers.quantization.weight_only import int_gemm_isa

        self.fmt, self.rng = fmt, rng
        if fmt == "wint4":
            self.isa = int_gemm_isa(get_op_backend().int_gemm, "benchmark")
        elif fmt == "q4_k":
            self.isa = gguf.KERNEL_PATHS[get_op_backend().gguf]
        elif fmt != "bf16":
            raise ValueError(f"--moe-formats: unknown format {fmt!r}; known: {', '.join(MOE_FORMATS)}.")

    def matrix(self, k: int, n: int, dense: bool = False):
        """A random ``[k, n]`` weight in this format; ``dense``: a linear layer's (wint4: one buffer) rather
        than an expert's (wint4: panels, scales, mins apart, stacked by :meth:`experts`)."""
        import numpy as np
        import paddle

        from fastdeploy import _custom_ops as ops
        from fastdeploy.model_executor.layers.quantization.gguf import pack_blocks, random_blocks
        from fastdeploy.model_executor.layers.quantization.int_kernels import int4_qweight_bytes, linear_buffer

        if self.fmt == "bf16":
            return ops.linear_pack(paddle.to_tensor((self.rng.standard_normal((k, n)) * 0.02).astype(np.float32)),
                                   "bfloat16")
        if self.fmt == "q4_k":
            return pack_blocks(random_blocks(12, n, k, self.rng), 12, n, k)
        panels, groups = -(-n // 16), -(-k // 128)
        scales = (self.rng.uniform(0.5, 1.5, panels * groups * 16) * 2e-3).astype(np.float32)
        parts = (self.rng.integers(0, 256, int4_qweight_bytes(k, n), dtype=np.uint8), scales, -8 * scales)
        return paddle.to_tensor(linear_buffer(parts)) if dense else tuple(paddle.to_tensor(a) for a in parts)

    def linear(self, x, w, n: int):
        from fastdeploy import _custom_ops as ops

        if self.fmt == "bf16":
            return ops.linear(x, w, None, n, "bfloat16")
        if self.fmt == "q4_k":
            return ops.gguf_linear(x, w, None, [12, n], self.isa)
        return ops.int_linear(x, w, None, n, 4, 128, self.isa)

    def experts(self, k: int, n: int, count: int):
        import paddle

        mats = [self.matrix(k, n) for _ in range(count)]  # expert by expert: no fp32 copy of a whole layer
        return tuple(paddle.stack(parts) for parts in zip(*mats, strict=True)) if self.fmt == "wint4" else paddle.stack(mats)

    def shared_experts(self, gate_up, down, h: int, inter: int):
        """The shared experts' dense matrices as the quantized MoE ops run them (as a served block hands them
        over, ``SparseMoeBlock.fuse_shared_experts``), or None for the format whose op does not (bf16)."""
        from fastdeploy import _custom_ops as ops

        if self.fmt == "bf16":
            return None
        if self.fmt == "q4_k":
            return ops.SharedExperts(gate_up, down, inter, "gguf", [12, 2 * inter], [12, h], self.isa)
        return ops.SharedExperts(gate_up, down, inter, "int", [4, 128, self.isa], [4, 128, self.isa])

    def moe(self, x, ids, weights, w13, w2, h: int, inter: int, shared=None):
        from fastdeploy import _custom_ops as ops

        if self.fmt == "bf16":
            return ops.fused_moe(x, ids, weights, w13, w2, inter, "bfloat16")
        if self.fmt == "q4_k":
            return ops.gguf_fused_moe(x, ids, weights, w13, w2, [12, 2 * inter], [12, h], self.isa, shared)
        return ops.int_fused_moe(x, ids, weights, w13[0], w13[1], w13[2], w2[0], w2[1], w2[2], inter, 4, 128, self.isa,
                                 shared)


def _moe_row(h: int, experts: int, top_k: int, inter: int, shared: int, num_layers: int, reps: int,
             formats: tuple[str, ...]) -> dict:
    import numpy as np
    import paddle

    from fastdeploy import _custom_ops as ops
    from fastdeploy.model_executor.custom_op import get_op_backend
    from fastdeploy.model_executor.layers.fused_moe import select_experts
    from fastdeploy.platforms.huge_pages import back_with_huge_pages, tensor_buffers

    rng = np.random.default_rng(0)
    dense_inter = top_k * inter + shared
    gates = [ops.linear_pack(paddle.to_tensor((rng.standard_normal((h, experts)) * 0.02).astype(np.float32)), "float32")
             for _ in range(num_layers)]
    xs = {batch: paddle.to_tensor(rng.standard_normal((batch, h)).astype(np.float32)) for batch in (1, 16)}

    routing_kernel = get_op_backend().uses_kernel("moe_routing")  # as FusedMoE routes

    def route(x: paddle.Tensor, gate: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        return select_experts(ops.linear(x, gate, None, experts, "float32"), top_k, True, use_kernel=routing_kernel)

    row: dict = {"hidden": h, "experts": experts, "top_k": top_k, "moe_intermediate": inter,
                 "shared_intermediate": shared, "dense_intermediate": dense_inter, "layers": num_layers}
    for batch, x in xs.items():
        # A step reads every hit expert's weights once: the bytes, not the FLOPs, set its time at small batch.
        hit = len(np.unique(route(x, gates[0])[1].numpy()))
        row[f"batch{batch}"] = {
            "routing_ms": round(_median_ms(lambda x=x: route(x, gates[0]), reps) * num_layers, 2),
            "experts_hit_per_layer": hit,
            "weight_bytes_over_dense": round((hit * 3 * inter + 3 * shared) / (3 * dense_inter), 2),
        }
    for fmt in formats:
        f = _MoeFormat(fmt, rng)

        def swiglu(x: paddle.Tensor, gate_up, down, n: int, f: _MoeFormat = f) -> paddle.Tensor:
            return f.linear(ops.silu_and_mul(f.linear(x, gate_up, 2 * n)), down, h)

        layers = [(gate, f.experts(h, 2 * inter, experts), f.experts(inter, h, experts),
                   (f.matrix(h, 2 * shared, True), f.matrix(shared, h, True)) if shared else None) for gate in gates]
        dense = [(f.matrix(h, 2 * dense_inter, True), f.matrix(dense_inter, h, True)) for _ in range(num_layers)]
        if get_op_backend().huge_pages:  # as a served model's weights are (model_loader)
            back_with_huge_pages(tensor_buffers([layers, dense]))
        # Weight bytes one step reads per layer (the hit experts', the shared experts', the dense layer's):
        # over the step's time, the rate it streams them at.
        _, w13, w2, shared_w = layers[0]
        dense_bytes = _nbytes(dense[0])
        moe_bytes = {batch: row[f"batch{batch}"]["experts_hit_per_layer"] * (_nbytes(w13) + _nbytes(w2)) / experts
                     + (_nbytes(shared_w) if shared_w else 0) for batch in xs}

        fused = [f.shared_experts(*shared_w, h, shared) if shared_w else None for _, _, _, shared_w in layers]

        def moe_step(x: paddle.Tensor, layers: list = layers, fused: list = fused, f: _MoeFormat = f,
                     swiglu=swiglu) -> None:
            for (gate, w13, w2, shared_w), fused_shared in zip(layers, fused, strict=True):
                weights, ids = route(x, gate)
                out = f.moe(x, ids, weights, w13, w2, h, inter, fused_shared)
                if shared_w is not None and fused_shared is None:
                    out = out + swiglu(x, *shared_w, shared)

        def dense_step(x: paddle.Tensor, dense: list = dense, swiglu=swiglu) -> None:
            for gate_up, down in dense:
                swiglu(x, gate_up, down, dense_inter)

        for batch, x in xs.items():
            moe_step(x), dense_step(x)  # warm-up (oneDNN primitives)
            times: dict[str, list[float]] = {"moe": [], "dense": []}
            for _ in range(reps):
                for name, step in (("moe", moe_step), ("dense", dense_step)):
                    t0 = time.perf_counter()
                    step(x)
                    times[name].append((time.perf_counter() - t0) * 1e3)
            moe_ms, dense_ms = statistics.median(times["moe"]), statistics.median(times["dense"])
            row[f"batch{batch}"][fmt] = {
                "moe_ms": round(moe_ms, 2), "dense_ms": round(dense_ms, 2), "moe_over_dense": round(moe_ms / dense_ms, 2),
                "moe_weight_mb_per_layer": round(moe_bytes[batch] / 1e6, 1),
                "dense_weight_mb_per_layer": round(dense_bytes / 1e6, 1),
                "moe_gb_per_s": round(moe_bytes[batch] * num_layers / moe_ms / 1e6, 1),
                "dense_gb_per_s": round(dense_bytes * num_layers / dense_ms / 1e6, 1)}
            if batch > 1:
                # The fastest the MoE step could be: its bytes at the best rate this format's batch-1
                # layers (memory-bound) streamed at, over the dense step.
                one = row["batch1"][fmt]
                floor_ms = moe_bytes[batch] * num_layers / max(one["moe_gb_per_s"], one["dense_gb_per_s"]) / 1e6
                row[f"batch{batch}"][fmt]["moe_floor_over_dense"] = round(floor_ms / dense_ms, 2)
        del layers, fused, dense, moe_step, dense_step  # free this format's weights before the next one's
    return row


def _nbytes(tensors) -> int:
    """Bytes of a tensor or of a (nested) tuple of tensors."""
    if isinstance(tensors, tuple | list):
        return sum(_nbytes(t) for t in tensors)
    return int(tensors.numel()) * tensors.element_size()


# Real shapes (the released config.json files).
_VL_SHAPES = {
    "Qwen2.5-VL-3B": dict(
        arch="Qwen2_5_VLForConditionalGeneration", tokens=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"),
        text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                  num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                  tie_word_embeddings=True),
        vision=dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, out_hidden_size=2048,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", tokens_per_second=2)),
    "PaddleOCR-VL-0.9B": dict(
        arch="PaddleOCRVLForConditionalGeneration",
        tokens=("<|IMAGE_START|>", "<|IMAGE_END|>", "<|IMAGE_PLACEHOLDER|>"),
        text=dict(vocab_size=103424, hidden_size=1024, intermediate_size=3072, num_hidden_layers=18,
                  num_attention_heads=16, num_key_value_heads=2, head_dim=128, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, use_bias=False, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [16, 24, 24]}),
        vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                    patch_size=14, image_size=384, spatial_merge_size=2, hidden_act="gelu_pytorch_tanh",
                    layer_norm_eps=1e-6)),
}


def _vl_checkpoint(name: str, folder: str) -> str:
    """A config-only folder (dummy weights) with SmolLM2's tokenizer plus the model's image tokens."""
    import transformers

    from fastdeploy.transformers_utils.model_resolver import resolve_model
    from fastdeploy.transformers_utils.tokenizer import get_tokenizer

    spec = _VL_SHAPES[name]
    start, end, image = spec["tokens"]
    tok = get_tokenizer(*resolve_model(None)[:1], gguf_file=resolve_model(None)[1])
    tok.add_special_tokens({"additional_special_tokens": list(spec["tokens"])})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}"
                         "{% if p['type'] == 'image' %}" + start + image + end + "{% else %}{{ p['text'] }}{% endif %}"
                         "{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    tok.save_pretrained(folder)
    config_cls = transformers.Qwen2_5_VLConfig if "Qwen" in name else transformers.PaddleOCRVLConfig
    ids = {t: tok.convert_tokens_to_ids(t) for t in spec["tokens"]}
    cfg = config_cls(text_config=spec["text"], vision_config=spec["vision"], image_token_id=ids[image],
                     vision_start_token_id=ids[start], tie_word_embeddings=spec["text"]["tie_word_embeddings"])
    cfg.architectures = [spec["arch"]]
    cfg.save_pretrained(folder)
    return folder


def measure_vision(name: str, run_lm: bool, dtype: str, reps: int) -> dict:
    """Child process: encoder ms and TTFT ms for one 448x448 image (medians of ``reps`` after a warm-up), peak RSS."""
    import resource

    import numpy as np
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (448, 448, 3), dtype=np.uint8))
    row = _vision_row(name, image, run_lm, dtype, reps)
    row["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return row


def module_times_ms(layer, *inputs) -> dict[str, float]:
    """One forward of ``layer`` with each sublayer's own time (its children's excluded), summed by class."""
    totals: dict[str, float] = {}
    stack: list[list] = []  # [class name, start, time spent in children]

    def pre(sub, _inputs):
        stack.append([type(sub).__name__, time.perf_counter(), 0.0])

    def post(_sub, _inputs, _out):
        name, t0, children = stack.pop()
        spent = time.perf_counter() - t0
        totals[name] = totals.get(name, 0.0) + (spent - children) * 1e3
        if stack:
            stack[-1][2] += spent

    hooks = [h for sub in layer.sublayers(include_self=True)
             for h in (sub.register_forward_pre_hook(pre), sub.register_forward_post_hook(post))]
    try:
        layer(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return {k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def _vision_row(name: str, image, run_lm: bool, dtype: str, reps: int) -> dict:
    import tempfile

    import numpy as np
    import paddle

    from fastdeploy import LLM, SamplingParams
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.layers.linear import process_linear_weights
    from fastdeploy.model_executor.model_loader.loader import initialize_dummy_weights
    from fastdeploy.model_executor.models.registry import ModelRegistry
    from fastdeploy.model_executor.utils import deferred_parameters
    from fastdeploy.multimodal.processing import MultiModalProcessor

    folder = _vl_checkpoint(name, tempfile.mkdtemp(prefix="vl-bench-"))
    t0 = time.perf_counter()
    if run_lm:
        llm = LLM(folder, load_format="dummy", dtype=dtype, max_model_len=2048, kv_cache_memory_bytes=256 << 20,
                  max_num_seqs=4)
        runner = llm.llm_engine.engine_core.worker.model_runner
        visual = runner.model.visual
        processor = llm.llm_engine.processor.mm_processor()
    else:  # the vision tower alone, at its real shape
        model_config = ModelConfig(model=folder)
        with deferred_parameters():  # storage arrives layer by layer with the dummy values
            visual = ModelRegistry.resolve(model_config.architectures).build_vision_tower(model_config.hf_config)
        with paddle.no_grad():
            initialize_dummy_weights(visual, pack_dtype=dtype)
            process_linear_weights(visual, dtype)
        processor = MultiModalProcessor(model_config, None)
    load_s = time.perf_counter() - t0
    _, (feature,) = processor.process([processor.image_token_id], {"image": image})
    pixels, grid = paddle.to_tensor(feature.pixel_values.to_array()), np.asarray([feature.grid_thw])
    with paddle.no_grad():
        row = {"dtype": dtype, "load_s": round(load_s, 1), "image_tokens": feature.length,
               "grid_thw": feature.grid_thw, "vision_encoder_ms": round(_median_ms(lambda: visual(pixels, grid), reps), 1),
               "vision_encoder_ms_by_module": module_times_ms(visual, pixels, grid)}
    if not run_lm:
        row["ttft_ms"] = None
        row["ttft_note"] = "not measured: run with --vision-full-3b for the whole model's TTFT"
        return row
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "Describe the image."}]}]
    encoder_cache = runner.mm_state.encoder_cache

    def first_token() -> None:
        llm.reset_prefix_cache()  # every run prefills the whole prompt
        llm.chat(messages, params, use_tqdm=False)

    before = encoder_cache.num_encoded
    row["ttft_ms"] = round(_median_ms(first_token, reps), 1)
    # Each TTFT run encodes its image (nothing is served from an earlier request's encoder output).
    row["encoder_runs_per_ttft"] = (encoder_cache.num_encoded - before) / (reps + 1)
    row["prompt_tokens"] = len(llm.chat(messages, params, use_tqdm=False)[0].prompt_token_ids)
    return row


def measure_rss(name: str) -> dict:
    """Child process: peak RSS (MB) of one configuration's worker, model and KV cache, built alone."""
    import resource

    Setup(name, *CONFIGS[_base_config(name)])
    return {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def run_child(threads: int, args: argparse.Namespace, *extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "FD_LOGGING_LEVEL": "WARNING"}
    cmd = [
        sys.executable, __file__, "--child", "--configs", *args.configs, "--context", str(args.context),
        "--prefill-len", str(args.prefill_len), "--decode-steps", str(args.decode_steps), *extra,
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{threads} threads failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _config_name(name: str) -> str:
    base, _, path = _split_per_layer(name)[0].partition("@")
    if base not in CONFIGS or (path and base not in ("gguf", "wint8", "wint4", "fp8")):
        raise argparse.ArgumentTypeError(f"{name!r}: a configuration is one of {', '.join(CONFIGS)}, and only "
                                         "gguf / wint8 / wint4 / fp8 take @PATH; any may end in /per-layer")
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), type=_config_name,
                        help=f"of {', '.join(CONFIGS)}; NAME@PATH runs gguf / an integer / fp8 format on that kernel "
                             "path (FD_CPU_GGUF_KERNEL's / FD_CPU_INT_KERNEL's names, e.g. wint8@avx512-bf16) beside "
                             "the platform's")
    parser.add_argument("--context", type=int, default=256, help="context tokens of each decoding sequence")
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results", "kernels.json"))
    parser.add_argument("--moe-layers", type=int, default=2, help="layers of each MoE / dense row (~1.5 GB each)")
    parser.add_argument("--moe-reps", type=int, default=10, help="timed MoE / dense steps per row; 0 leaves the rows out")
    parser.add_argument("--moe-formats", nargs="+", default=list(MOE_FORMATS), choices=list(MOE_FORMATS),
                        help="expert weight formats of the MoE rows (each with its dense layer in that format)")
    parser.add_argument("--moe-only", action="store_true", help="only the MoE-vs-dense rows (results/kernels_moe.json)")
    parser.add_argument("--vision", action="store_true", help="measure the vision-language rows instead")
    parser.add_argument("--vision-full-3b", action="store_true", help="with --vision: Qwen2.5-VL-3B's TTFT too")
    parser.add_argument("--vision-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="with --vision: the models' compute dtype")
    parser.add_argument("--vision-reps", type=int, default=3, help="with --vision: timed runs after the warm-up")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-task", default="steps", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        # Before any paddle import: fastdeploy puts Paddle's OpenMP runtime first, else oneDNN binds to libgomp
        # and the process computes on one thread whatever OMP_NUM_THREADS says (fastdeploy/omp_runtime.py).
        import fastdeploy  # noqa: F401

        if args.child_task == "moe":
            print(json.dumps(measure_moe(args.moe_layers, args.moe_reps, tuple(args.moe_formats))))
        elif args.child_task.startswith("vision:"):
            _, name, run_lm = args.child_task.split(":")
            print(json.dumps(measure_vision(name, run_lm == "lm", args.vision_dtype, args.vision_reps)))
        elif args.child_task == "formats":
            print(json.dumps(measure_formats(args.prefill_len)))
        elif args.child_task.startswith("rss:"):
            print(json.dumps(measure_rss(args.child_task[4:])))
        else:
            print(json.dumps(measure(args.configs, args.context, args.prefill_len, args.decode_steps)))
        return

    moe_args = ["--moe-layers", str(args.moe_layers), "--moe-reps", str(args.moe_reps), "--moe-formats",
                *args.moe_formats, "--child-task", "moe"]
    if args.moe_only:
        moe = {str(t): run_child(t, args, *moe_args) for t in args.threads}
        print(f"moe: {json.dumps(moe)}", flush=True)
        output = args.output.replace("kernels.json", "kernels_moe.json")
        os.makedirs(os.path.dirname(output), exist_ok=True)
        with open(output, "w", encoding="utf-8") as f:
            json.dump({"benchmark": "benchmarks/benchmark_kernels.py", "command": " ".join(["python"] + sys.argv),
                       "machine": {"cpu": _cpu_name(), "cores": os.cpu_count()}, "moe_by_threads": moe}, f, indent=2)
        return
    if args.vision:
        # One process per model, so each peak RSS is that model's alone.
        by_threads = {str(t): {name: run_child(t, args, "--vision-dtype", args.vision_dtype, "--vision-reps",
                                               str(args.vision_reps), "--child-task",
                                               f"vision:{name}:{'lm' if args.vision_full_3b or 'Qwen' not in name else 'tower'}")
                               for name in _VL_SHAPES} for t in args.threads}
        print(json.dumps(by_threads, indent=1), flush=True)
        output = args.output.replace("kernels.json", "kernels_vision.json")
        with open(output, "w", encoding="utf-8") as f:
            json.dump({"benchmark": "benchmarks/benchmark_kernels.py --vision", "command": " ".join(["python"] + sys.argv),
                       "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "load_average": os.getloadavg()[0]},
                       "note": "dummy weights at the real shapes; one 448x448 image; median ms of --vision-reps after a warm-up; "
                               "vision_encoder_ms_by_module: one forward, each module's own time (children excluded)",
                       "results_by_threads": by_threads}, f, indent=2)
        return
    results = {}
    for threads in args.threads:
        res = run_child(threads, args)
        base = res.get("paddle-fp32")
        for name in args.configs:
            if base and name != "paddle-fp32":
                figures = [k for k in res[name] if k.endswith("_ms")]
                res[name]["speedup_vs_paddle_fp32"] = {k: round(base[k] / res[name][k], 2) for k in figures}
        res["gguf_formats"] = run_child(threads, args, "--child-task", "formats")
        if args.moe_reps > 0:
            res["moe_vs_dense"] = run_child(threads, args, *moe_args)
        results[str(threads)] = res
        summary = {n: {k: v for k, v in r.items() if k != "samples"} for n, r in res.items() if isinstance(r, dict)}
        print(f"threads={threads}: {json.dumps(summary)}", flush=True)
    rss = {name: run_child(args.threads[0], args, "--child-task", f"rss:{name}")["peak_rss_mb"] for name in args.configs}
    print(f"peak RSS (MB): {json.dumps(rss)}", flush=True)
    report = {
        "benchmark": "benchmarks/benchmark_kernels.py",
        "command": " ".join(["python"] + sys.argv),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 + Q8_0 embedding; dequantized, or in its blocks with gguf)",
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "settings": {
            "context": args.context,
            "prefill_len": args.prefill_len,
            "decode_steps": args.decode_steps,
            "block_size": 16,
        },  # fmt: skip
        "note": "median ms per ModelRunner.execute_model step; configurations interleaved step by step in one process",
        "results_by_threads": results,
        "peak_rss_mb_by_config": rss,
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
