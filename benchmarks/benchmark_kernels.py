"""Model-runner step times of the default model: plain Paddle vs the C++ kernels, fp32 and bf16.

The three configurations live in one process and take turns step by step, so load from
other work on the machine hits them alike (timings on a shared machine drift by 2x within
minutes; only an interleaved comparison is fair). A step is the engine's whole
``ModelRunner.execute_model``: inputs and metadata, forward, LM head on the sampled rows,
greedy sampling.

- ``paddle-fp32``: plain Paddle ops (the model is loaded and first run inside
  ``set_op_backend(OpBackend())``, which is what FD_CPU_KERNELS=0 gives a whole process);
- ``kernels-fp32``: the C++ kernels with fp32 weights (``--dtype float32``);
- ``kernels-bf16``: the C++ kernels with bf16 weights and KV cache (``--dtype auto`` where a
  bf16 kernel is built: oneDNN on AMX / AVX512-BF16, the panel kernel on AVX2);
- ``gguf``: ``--quantization gguf``, the file's Q4_1 / Q8_0 blocks multiplied by the block
  kernels (csrc/cpu/gguf_gemm.cc), bf16 KV cache where kernels-bf16 has one.
- ``hf-bf16``, ``wint8``, ``wint4``, ``w8a8``: the same weights as a Hugging Face folder, in bf16
  and quantized at load by ``--quantization`` (csrc/cpu/int_gemm.cc; oneDNN's int8 matmul for w8a8).

Figures (medians): decode step at batch 1 and 16, each sequence with ``--context`` tokens of
context, and the prefill of one ``--prefill-len``-token prompt; one process per thread count.
Beside them, per GGUF format, the matmuls of one decode step (M = 1, LM head included) and of a
``--prefill-len``-token prefill (LM head excluded) at the default model's shapes, block kernel
against the bf16 linear kernel, and the peak RSS of each configuration's engine in a fresh process.

    python benchmarks/benchmark_kernels.py --threads 1 2
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

# name -> (dtype, quantization)
CONFIGS = {"paddle-fp32": ("float32", None), "kernels-fp32": ("float32", None), "kernels-bf16": ("bfloat16", None),
           "gguf": ("auto", "gguf"), "hf-bf16": ("bfloat16", None), "wint8": ("auto", "wint8"),
           "wint4": ("auto", "wint4"), "w8a8": ("auto", "w8a8")}
# Configurations of the default model's weights as a Hugging Face folder (the integer formats quantize it at
# load; hf-bf16 is their baseline).
HF_CONFIGS = ("hf-bf16", "wint8", "wint4", "w8a8")


def hf_model() -> str:
    """The default model as a Hugging Face folder (converted once, cached by compare_vllm)."""
    from compare_vllm import ensure_hf_model

    from fastdeploy import envs

    return ensure_hf_model(envs.cache_root())


class Setup:
    """One configuration: a worker with its model and KV cache, and requests to drive it."""

    def __init__(self, name: str, dtype: str, quantization: str | None) -> None:
        import numpy as np

        from fastdeploy.engine.arg_utils import EngineArgs
        from fastdeploy.model_executor.custom_op import set_op_backend
        from fastdeploy.platforms.interface import OpBackend
        from fastdeploy.sampling_params import SamplingParams
        from fastdeploy.worker.worker import Worker

        self.name = name
        model = {"model": hf_model()} if name in HF_CONFIGS else {}
        args = EngineArgs(dtype=dtype, quantization=quantization, max_model_len=2048, kv_cache_memory_bytes=512 << 20,
                          max_num_seqs=32, **model)
        self.config = args.create_engine_config()
        baseline = set_op_backend(OpBackend()) if name == "paddle-fp32" else contextlib.nullcontext()
        with baseline:
            self.worker = Worker(self.config)
            self.worker.load_model()
            self.num_blocks = self.worker.determine_num_available_blocks()
            self.worker.initialize_cache(self.num_blocks)
            self.runner = self.worker.model_runner
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


def measure(configs: list[str], context: int, prefill_len: int, steps: int) -> dict:
    """Child process (one thread count): interleaved step times of every configuration."""
    import resource

    load_before = os.getloadavg()
    setups = [Setup(name, *CONFIGS[name]) for name in configs]
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


def measure_formats(prefill_len: int) -> dict:
    """Child process: per GGUF format, the default model's matmuls of a decode step and a prefill (ms)."""
    import numpy as np
    import paddle

    from fastdeploy import _custom_ops as ops
    from fastdeploy.model_executor.custom_op import get_op_backend
    from fastdeploy.model_executor.layers.quantization.gguf import GGUF_KERNEL_TYPES, KERNEL_PATHS, random_blocks
    from fastdeploy.transformers_utils.config import get_hf_config
    from fastdeploy.transformers_utils.model_resolver import resolve_model

    cfg = get_hf_config(*resolve_model("SmolLM2-135M-Instruct"), False)
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    layer_shapes = [(h, qkv), (h, h), (h, 2 * inter), (inter, h)]  # (K, N): qkv, o, gate_up, down
    head = (h, cfg.vocab_size)
    rng = np.random.default_rng(0)
    isa = KERNEL_PATHS[get_op_backend().gguf]
    xs: dict[tuple[int, int], paddle.Tensor] = {}

    def x_of(m: int, k: int) -> paddle.Tensor:
        if (m, k) not in xs:
            xs[m, k] = paddle.to_tensor(rng.standard_normal((m, k)).astype(np.float32))
        return xs[m, k]

    def step_ms(run) -> dict:
        """run(k, n, m) -> ms of one matmul; a decode step = layers x shapes + head, a prefill without the head."""
        layers = cfg.num_hidden_layers
        decode = layers * sum(run(k, n, 1) for k, n in layer_shapes) + run(*head, 1)
        prefill = layers * sum(run(k, n, prefill_len) for k, n in layer_shapes)
        return {"decode_matmuls_ms": round(decode, 2), f"prefill_{prefill_len}_matmuls_ms": round(prefill, 2)}

    def bf16(k: int, n: int, m: int) -> float:
        packed = ops.linear_pack(paddle.to_tensor(rng.standard_normal((k, n)).astype(np.float32)), "bfloat16")
        return _median_ms(lambda: ops.linear(x_of(m, k), packed, None, n, "bfloat16"), 20 if m == 1 else 3)

    rows = {"bf16-linear": step_ms(bf16)}
    for ggml_type, type_name in GGUF_KERNEL_TYPES.items():
        block = 256 if type_name.endswith("_K") else 32

        def gguf(k: int, n: int, m: int, t: int = ggml_type, block: int = block) -> float:
            k = -(-k // block) * block  # K-quants need K in whole 256-superblocks (576 -> 768)
            w = paddle.to_tensor(random_blocks(t, n, k, rng).reshape(-1))
            return _median_ms(lambda: ops.gguf_linear(x_of(m, k), w, None, [t, n], isa), 20 if m == 1 else 3)

        rows[f"gguf-{type_name}"] = step_ms(gguf)
    note = "K-quant rows round K up to whole 256-element superblocks (576 -> 768): more work than the model's shapes"
    return {"kernel_path": get_op_backend().gguf, "rows": rows, "note": note}


def measure_rss(name: str) -> dict:
    """Child process: peak RSS (MB) of one configuration's worker, model and KV cache, built alone."""
    import resource

    Setup(name, *CONFIGS[name])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--context", type=int, default=256, help="context tokens of each decoding sequence")
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results", "kernels.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-task", default="steps", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child_task == "formats":
            print(json.dumps(measure_formats(args.prefill_len)))
        elif args.child_task.startswith("rss:"):
            print(json.dumps(measure_rss(args.child_task[4:])))
        else:
            print(json.dumps(measure(args.configs, args.context, args.prefill_len, args.decode_steps)))
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
