"""How fast one core reads: by working-set size (L2, L3, memory) and by the size of scattered chunks.

What bounds the memory-bound kernels: a decode step streams every layer's weights and every
sequence's K/V cache once. ``benchmarks/read_rate/read_rate.cc`` (compiled with the system's g++,
``-march=native``, pinned to one core) sums 64-byte lines; ``sweep`` rereads a buffer of each size
(from whichever cache level holds it), ``chunks`` reads pairs of contiguous chunks at random places
of 1 GB, the pattern of paged attention's key and value blocks (16 keys x 128 bytes = 2 KB a kv
head and block with the default model). Best of ``--rounds`` rounds (other work on a shared
machine only ever slows a round down).

    python benchmarks/benchmark_read_rate.py --output benchmarks/results/read_rate_spr_2026-12-06.json
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from interleaved import write_result

SOURCE = Path(__file__).parent / "read_rate" / "read_rate.cc"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep-mb", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256, 1024])
    parser.add_argument("--chunk-bytes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--core", type=int, default=os.cpu_count() - 1, help="the core to pin to (default: the last)")
    parser.add_argument("--output", help="JSON file for the results")
    args = parser.parse_args()

    from fastdeploy.platforms.cpu_features import cpu_features, cpuinfo

    results: dict[str, dict[str, float]] = {"sweep_gb_per_s": {}, "chunks_gb_per_s": {}}
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "read_rate"
        subprocess.run(["g++", "-O3", "-march=native", "-std=c++17", str(SOURCE), "-o", str(exe)], check=True)

        def rate(mode: str, size: int) -> float:
            out = subprocess.run(["taskset", "-c", str(args.core), str(exe), mode, str(size), str(args.rounds)],
                                 check=True, capture_output=True, text=True).stdout
            return float(out.split()[0])

        for mb in args.sweep_mb:
            results["sweep_gb_per_s"][f"{mb} MB"] = rate("sweep", mb)
            print(f"sweep {mb:5d} MB: {results['sweep_gb_per_s'][f'{mb} MB']:6.1f} GB/s", flush=True)
        for size in args.chunk_bytes:
            results["chunks_gb_per_s"][f"{size} B"] = rate("chunks", size)
            print(f"chunks {size:6d} B: {results['chunks_gb_per_s'][f'{size} B']:6.1f} GB/s", flush=True)
    write_result(args.output, {"benchmark": "benchmarks/benchmark_read_rate.py", "cpu": cpuinfo("model name") or
                               platform.processor(), "features": cpu_features(), "core": args.core,
                               "rounds": args.rounds} | results)


if __name__ == "__main__":
    main()
