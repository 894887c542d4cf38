"""Per-call time of the fp8 weight kernel (csrc/cpu/fp8_gemm.cc) against the bf16 linear kernel, one shape.

Every kernel path this CPU runs (``avx512-bf16`` with bf16-rounded activations, the fp32-FMA
paths) and the bf16 linear kernel (oneDNN or the panel kernel, as ``--dtype bfloat16`` packs it)
take turns call by call, so load from other work hits them alike; medians of ``--reps`` rounds.

    python benchmarks/benchmark_fp8_gemm.py --k 576 --n 1536 --m 1 16 256 --out fp8_gemm.json
"""

from __future__ import annotations

import argparse

from interleaved import interleaved_medians, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args()

    import numpy as np
    import paddle

    from fastdeploy import _C
    from fastdeploy import _custom_ops as ops
    from fastdeploy.model_executor.layers.quantization.fp8 import KERNEL_PATHS, pack_fp8, quantize_fp8
    from fastdeploy.platforms.cpu import fp8_kernel_paths

    control = _C.omp_thread_control()
    control.set_threads(args.threads)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((args.k, args.n)) * 0.05).astype(np.float32)
    codes, scales = quantize_fp8(w)
    weight = paddle.to_tensor(pack_fp8(codes, scales[None, :]))
    group = 2 * -(-args.k // 2)
    bf16 = ops.linear_pack(paddle.to_tensor(w), "bfloat16")
    rows = {}
    for m in args.m:
        x = paddle.to_tensor(rng.standard_normal((m, args.k)).astype(np.float32))
        calls = {"bf16-linear": lambda x=x: ops.linear(x, bf16, None, args.n, "bfloat16")}
        for path in fp8_kernel_paths():
            calls[f"fp8-{path}"] = lambda x=x, isa=KERNEL_PATHS[path]: ops.fp8_linear(
                x, weight, None, args.n, group, isa)
        inner = max(1, 2000 // (m * 10))  # calls per timing: ~ms-scale timings at every M
        med = interleaved_medians(calls, args.reps, inner)
        rows[f"M={m}"] = {f"{name}_us": round(v, 1) for name, v in med.items()} | {
            f"{name}_vs_bf16": round(v / med["bf16-linear"], 3) for name, v in med.items() if name != "bf16-linear"}
        print(f"M={m}: " + ", ".join(f"{n} {v:.1f} us" for n, v in med.items()), flush=True)
    write_result(args.out, {"k": args.k, "n": args.n, "threads": args.threads, "reps": args.reps, "rows": rows,
                            "weight_bytes": {"fp8": int(weight.numel()), "bf16": 2 * args.k * args.n}})


if __name__ == "__main__":
    main()
