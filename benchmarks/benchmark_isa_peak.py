"""Peak multiply-adds per second of one core, per dot-product instruction this CPU has.

What bounds a kernel's compute: the int8 dot products of the GGUF / w8a8 kernels (``vpdpbusd``
on VNNI, ``vpmaddubsw`` + ``vpmaddwd`` on AVX2), the bf16 ones of the bf16 linear, attention and
integer paths (``vdpbf16ps``), and fp32 FMAs. A prefill target such as "the integer path at 2x the
bf16 path" can only be met where the int8 peak is more than twice the bf16 rate the bf16 kernel
actually reaches. ``benchmarks/isa_peak/isa_peak.cc`` is compiled with the system's g++ (as the
kernels are) and each instruction runs 12 independent chains for 240M instructions, pinned to one
core, the instructions taking turns for ``--rounds`` rounds; the fastest round of each is its peak
(other work on a shared machine only ever slows a round down).

    python benchmarks/benchmark_isa_peak.py --output benchmarks/results/isa_peak.json
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from interleaved import write_result

SOURCE = Path(__file__).parent / "isa_peak" / "isa_peak.cc"
# Instruction -> the CPU flags it needs (/proc/cpuinfo spelling).
NEEDS = {
    "vpdpbusd_zmm": {"avx512f", "avx512bw", "avx512_vnni"},
    "vdpbf16ps_zmm": {"avx512f", "avx512bw", "avx512_bf16"},
    "vfmadd231ps_zmm": {"avx512f"},
    "vfmadd231ps_ymm": {"avx2", "fma"},
    "vpmaddubsw_ymm": {"avx2"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--core", type=int, default=os.cpu_count() - 1, help="the core to pin to (default: the last)")
    parser.add_argument("--output", help="JSON file for the results")
    args = parser.parse_args()

    from fastdeploy.platforms.cpu_features import cpu_features, cpu_flags, cpuinfo

    names = [n for n, flags in NEEDS.items() if flags <= cpu_flags()]
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "isa_peak"
        subprocess.run(["g++", "-O2", "-std=c++17", str(SOURCE), "-o", str(exe)], check=True)
        runs: dict[str, list[float]] = {n: [] for n in names}
        macs: dict[str, int] = {}
        for r in range(args.rounds):
            out = subprocess.run(["taskset", "-c", str(args.core), str(exe), *names], check=True, capture_output=True,
                                 text=True).stdout
            for line in out.splitlines():
                name, m, ns = line.split()
                runs[name].append(float(ns))
                macs[name] = int(m)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    results = {}
    for name in names:
        ns = min(runs[name])
        results[name] = {"macs_per_instruction": macs[name], "ns_per_instruction": round(ns, 4),
                         "gmacs_per_s": round(macs[name] / ns, 1)}
        print(f"{name:18s} {macs[name]:3d} MAC  {ns:.4f} ns  {macs[name] / ns:7.1f} GMAC/s")
    int8 = results.get("vpdpbusd_zmm") or results.get("vpmaddubsw_ymm")
    bf16 = results.get("vdpbf16ps_zmm")
    ratio = round(int8["gmacs_per_s"] / bf16["gmacs_per_s"], 2) if int8 and bf16 else None
    if ratio:
        print(f"int8 / bf16 peak: {ratio}x")
    write_result(args.output, {"benchmark": "benchmarks/benchmark_isa_peak.py", "cpu": cpuinfo("model name") or
                               platform.processor(), "features": cpu_features(), "core": args.core,
                               "results": results, "int8_over_bf16_peak": ratio})


if __name__ == "__main__":
    main()
