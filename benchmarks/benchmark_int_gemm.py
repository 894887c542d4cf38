"""Per-call time of the integer weight kernel (csrc/cpu/int_gemm.cc) per kernel path, one shape, weights from DRAM.

wint4 (groups of 128) or wint8 weights of one ``[K, N]`` shape, packed by int_kernels.py, copied until
the copies exceed ``--weight-mb`` so that every call reads its weight from memory as a decode step does
(an MoE expert, a layer of a model larger than the caches); each call takes the next copy. Every
integer path this CPU runs takes turns round by round (interleaved.py); medians per call, and the rate
the weights stream at.

    python benchmarks/benchmark_int_gemm.py --k 2560 --n 3072 --m 1 2 16 256 --out int_gemm.json
"""

from __future__ import annotations

import argparse
import itertools

from interleaved import interleaved_medians, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=2560)
    parser.add_argument("--n", type=int, default=3072)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 16, 256])
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--weight-mb", type=float, default=300.0, help="bytes of weight copies to cycle through")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args()

    import numpy as np
    import paddle

    from fastdeploy import _C
    from fastdeploy import _custom_ops as ops
    from fastdeploy.model_executor.layers.quantization.int_kernels import (
        KERNEL_PATHS,
        linear_buffer,
        pack_int4,
        pack_int8,
        quantize_int4,
        quantize_int8,
    )
    from fastdeploy.platforms.cpu import int_kernel_paths
    from fastdeploy.platforms.huge_pages import back_with_huge_pages, tensor_buffers

    control = _C.omp_thread_control()
    control.set_threads(args.threads)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((args.k, args.n)) * 0.05).astype(np.float32)
    packed = linear_buffer(pack_int4(quantize_int4(w, 128)) if args.bits == 4 else pack_int8(*quantize_int8(w)))
    copies = max(2, int(args.weight_mb * 1e6 // packed.nbytes))
    weights = [paddle.to_tensor(packed) for _ in range(copies)]
    back_with_huge_pages(tensor_buffers(weights))  # as a served model's weights are (model_loader)
    paths = [p for p in int_kernel_paths() if p in KERNEL_PATHS]
    rows = {}
    for m in args.m:
        x = paddle.to_tensor(rng.standard_normal((m, args.k)).astype(np.float32))
        inner = max(1, min(copies, 2000 // m))  # calls per timing: each reads the next copy
        calls = {}
        for path in paths:
            cycle = itertools.cycle(weights)
            calls[path] = lambda x=x, cycle=cycle, isa=KERNEL_PATHS[path]: ops.int_linear(
                x, next(cycle), None, args.n, args.bits, 128, isa)
        med = interleaved_medians(calls, args.reps, inner)
        rows[f"M={m}"] = {f"{name}_us": round(v, 1) for name, v in med.items()} | {
            f"{name}_gb_per_s": round(packed.nbytes / v / 1e3, 1) for name, v in med.items()}
        print(f"M={m}: " + ", ".join(f"{n} {v:.1f} us" for n, v in med.items()), flush=True)
    write_result(args.out, {"k": args.k, "n": args.n, "bits": args.bits, "threads": args.threads, "reps": args.reps,
                            "weight_bytes": packed.nbytes, "copies": copies, "rows": rows})


if __name__ == "__main__":
    main()
