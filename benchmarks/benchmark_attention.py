"""Per-call time of the paged-attention kernel paths (csrc/cpu/attention*.cc) on a bf16 cache.

Every path this CPU runs (``amx-bf16``: the scores on AMX tiles; ``avx512-bf16``: bf16 dot products;
the build's fp32 path) takes
turns call by call on the same batch, so load from other work hits them alike; medians of
``--reps`` rounds. The batches are decodes over a cached context and one fresh prefill, in
random blocks of the cache, at the default model's heads (9 query / 3 KV heads of 64); the
JSON also records how far each path's output is from the fp32 path's. A decode is timed twice:
on one cache, which then sits in the CPU's caches, and ``_streamed`` over ``--layers`` caches in
turn, as a model step reads them (for 16 sequences they exceed a 32 MB L3 and come from memory;
one sequence's stay in L3). ``--prefetch l1 l2`` runs each path twice, fetching the rows it reads next
into L1 (the path's plain name) and into L2 (``PATH/l2``; FD_CPU_ATTENTION_PREFETCH picks one for serving).

    python benchmarks/benchmark_attention.py --out benchmarks/results/attention_avx512bf16.json
"""

from __future__ import annotations

import argparse

from interleaved import interleaved_medians, write_result

# (name, sequences, cached context, new tokens per sequence)
CASES = [("decode 16 x 330", 16, 330, 1), ("decode 1 x 330", 1, 330, 1), ("decode 16 x 1000", 16, 1000, 1),
         ("prefill 256", 1, 0, 256)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=30, help="caches a streamed decode cycles through")
    parser.add_argument("--prefetch", nargs="+", choices=["l1", "l2"], default=["l1", "l2"],
                        help="where the kernels fetch the rows ahead: each level is a column per path")
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args()

    import numpy as np
    import paddle

    from fastdeploy import _C
    from fastdeploy import _custom_ops as ops
    from fastdeploy.model_executor.layers.attention.metadata import build_attention_metadata
    from fastdeploy.platforms.cpu import attention_kernel_paths
    from fastdeploy.platforms.interface import OpBackend

    _C.omp_thread_control().set_threads(args.threads)
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    def column(path: str, level: str) -> str:
        return path if level == "l1" else f"{path}/{level}"

    paths = {column(path, level): OpBackend(attention=f"paged-{path}", attention_prefetch=level).attn_isa
             for path in attention_kernel_paths() for level in args.prefetch}
    fp32_path = column(attention_kernel_paths()[-1], args.prefetch[0])
    rng = np.random.default_rng(0)
    rows = {}
    for name, seqs, cached, new in CASES:
        seq_lens = np.full(seqs, cached + new, np.int64)
        blocks = -(-(cached + new) // bs)
        num_blocks = seqs * blocks + 8
        table = rng.permutation(num_blocks)[: seqs * blocks].reshape(seqs, blocks).astype(np.int64)
        layers = args.layers if new == 1 else 1
        caches = [[paddle.to_tensor(rng.standard_normal((num_blocks, bs, kvh, d)).astype(np.float32)).astype("bfloat16")
                   for _ in range(2)] for _ in range(layers)]
        md, _ = build_attention_metadata(table, np.full(seqs, new, np.int64), seq_lens, bs)
        query = paddle.to_tensor(rng.standard_normal((seqs * new, (h + 2 * kvh) * d)).astype(np.float32))

        def call(isa: int, layer: int = 0, query=query, caches=caches, md=md) -> paddle.Tensor:
            key, value = caches[layer]
            return ops.paged_attention(query, key, value, md.block_tables, md.query_start_loc, md.seq_lens,
                                       h, d**-0.5, isa)

        def streamed(isa: int, layers=layers) -> None:
            for layer in range(layers):
                call(isa, layer)

        outputs = {path: call(isa).numpy() for path, isa in paths.items()}
        med = interleaved_medians({path: lambda isa=isa: call(isa) for path, isa in paths.items()}, args.reps)
        ref = outputs[fp32_path]
        rows[name] = {f"{path}_us": round(v, 1) for path, v in med.items()} | {
            f"{path}_speedup": round(med[fp32_path] / v, 2) for path, v in med.items() if path != fp32_path} | {
            f"{path}_max_rel_diff": float(f"{np.abs(outputs[path] - ref).max() / np.abs(ref).max():.2e}")
            for path in paths if path != fp32_path}
        line = ", ".join(f"{p} {v:.0f} us" for p, v in med.items())
        if layers > 1:
            per_layer = {path: v / layers for path, v in interleaved_medians(
                {path: lambda isa=isa: streamed(isa) for path, isa in paths.items()}, max(3, args.reps // 4)).items()}
            cache_bytes = seqs * (cached + new) * kvh * d * 2 * 2  # keys and values read, bf16
            rows[name] |= {f"{path}_streamed_us": round(v, 1) for path, v in per_layer.items()} | {
                f"{path}_streamed_gb_per_s": round(cache_bytes / v / 1e3, 1) for path, v in per_layer.items()}
            line += "; streamed over " + f"{layers} caches: " + ", ".join(f"{p} {v:.0f} us" for p, v in per_layer.items())
        print(f"{name}: {line}", flush=True)
    write_result(args.out, {"heads": h, "kv_heads": kvh, "head_dim": d, "block_size": bs, "threads": args.threads,
                            "reps": args.reps, "layers": args.layers, "prefetch": args.prefetch,
                            "fp32_path": fp32_path, "rows": rows})


if __name__ == "__main__":
    main()
