"""GGUF block matmuls by batch rows on each kernel path this CPU runs, the weights streamed as a step streams them.

A decode step of M sequences multiplies M activation rows by every layer's weights once. Here the
default model's 30 layers of Q4_1 projections (qkv, o, gate_up, down, each layer its own weights:
66 MB, far more than L2, so each call reads them from L3 or memory as a model step does; one layer
repeated would sit in L2) and its Q8_0 LM head (49152 x 576) are multiplied for each row count on
every GGUF kernel path (``amx-int8`` rows a part-filled tile per its threshold, see
csrc/cpu/gguf_gemm_amx.h), the paths taking turns round by round; medians of ``--reps`` rounds, ms
per step (Python's per-call cost included, the same on every path).

    python benchmarks/benchmark_gguf_rows.py --out benchmarks/results/gguf_rows_spr_2026-12-06.json
"""

from __future__ import annotations

import argparse

from benchmark_kernels import default_model_matmuls
from interleaved import interleaved_medians, write_result

import fastdeploy  # noqa: F401  (before paddle's import, which brings torch's OpenMP runtime first otherwise)

Q4_1, Q8_0 = 3, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 13, 14, 16, 24, 28, 32, 48])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args()

    import numpy as np
    import paddle

    from fastdeploy import _C
    from fastdeploy import _custom_ops as ops
    from fastdeploy.model_executor.layers.quantization.gguf import KERNEL_PATHS, random_blocks
    from fastdeploy.platforms.cpu import gguf_kernel_paths

    _C.omp_thread_control().set_threads(args.threads)
    num_layers, layer_shapes, head_shape = default_model_matmuls()
    rng = np.random.default_rng(0)

    def packed(ggml_type: int, k: int, n: int) -> tuple[paddle.Tensor, list[int], int]:
        blocks = random_blocks(ggml_type, n, k, rng).reshape(-1)
        return ops.gguf_pack(paddle.to_tensor(blocks), [ggml_type, n], k), [ggml_type, n], k

    layers = [[packed(Q4_1, k, n) for k, n in layer_shapes] for _ in range(num_layers)]
    head = packed(Q8_0, *head_shape)
    paths = {path: KERNEL_PATHS[path] for path in gguf_kernel_paths() if path != "scalar"}
    rows = {}
    for m in args.rows:
        xs = {k: paddle.to_tensor(rng.standard_normal((m, k)).astype(np.float32)) for k, _ in layer_shapes}

        def body(isa: int, xs=xs) -> None:
            for layer in layers:
                for w, segments, k in layer:
                    ops.gguf_linear(xs[k], w, None, segments, isa)

        def lm_head(isa: int, xs=xs) -> None:
            ops.gguf_linear(xs[head_shape[0]], head[0], None, head[1], isa)

        body_ms = interleaved_medians({p: lambda isa=isa: body(isa) for p, isa in paths.items()}, args.reps)
        head_ms = interleaved_medians({p: lambda isa=isa: lm_head(isa) for p, isa in paths.items()}, args.reps * 3)
        rows[m] = {f"{p}_q4_1_layers_ms": round(v / 1e3, 2) for p, v in body_ms.items()} | {
            f"{p}_q8_0_lm_head_ms": round(v / 1e3, 3) for p, v in head_ms.items()}
        print(f"M={m}: " + ", ".join(f"{p} {body_ms[p] / 1e3:.2f} + {head_ms[p] / 1e3:.2f} ms" for p in paths), flush=True)
    write_result(args.out, {"threads": args.threads, "reps": args.reps, "layers": num_layers,
                            "paths": list(paths), "rows": rows})


if __name__ == "__main__":
    main()
