"""How much 4-bit weight rounding costs the default model, rule by rule (a transformers fp32 simulation).

wint4 quantizes a bf16 checkpoint at load in groups of 128 input rows; its perplexity target is
within 4% of bf16. The only bf16 checkpoint here is the default model's GGUF dequantized, whose
weights already lie on Q4_1's grids (32 values each, their own scale and min). This script swaps
each projection of that checkpoint (transformers, fp32) for its 4-bit rounding under several
rules and reports the perplexity relative to the unrounded model on ShareGPT text:

- ``rtn-g128`` / ``g64`` / ``g32``: wint4's own rule (:func:`quantize_int4`, min/max to 0..15 with an
  integer zero) in groups of 128, 64, 32 rows;
- ``float-min-g128`` / ``g32``: Q4_1's rule (the group's float min as the offset, no integer zero); in
  groups of 32 it finds the file's own grids again (the check that they are what the weights are);
- ``gptq-g128``: GPTQ (error feedback through the inverse Hessian of each layer's inputs,
  calibrated on other ShareGPT text than the evaluated windows) on wint4's grid;
- ``rtn-g128-keep-1pct``: wint4's rule with the 1% of input rows that see the largest activations
  left unrounded (an upper bound for activation-aware scaling such as AWQ).

Writes ``benchmarks/results/int4_rounding.json``. Needs torch and transformers (the test
requirements); about 10 minutes on two cores.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from benchmark_perplexity import english_text, token_windows, write_report  # noqa: E402


def perplexity(model, windows: list[list[int]]) -> float:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            total -= logprobs.gather(1, ids[0, 1:, None]).sum().item()
            count += len(w) - 1
    return math.exp(total / count)


def input_statistics(model, windows: list[list[int]]) -> dict[str, np.ndarray]:
    """Each projection's ``X^T X`` over the calibration windows (float64), keyed by its weight's name."""
    import torch

    hessians: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def accumulate(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            hessians[name] = hessians.get(name, 0) + x.T @ x
        return accumulate

    handles = [m.register_forward_hook(hook(f"{n}.weight")) for n, m in model.named_modules() if n.endswith("_proj")]
    with torch.no_grad():
        for w in windows:
            model(torch.tensor([w]))
    for h in handles:
        h.remove()
    return {n: h.numpy() for n, h in hessians.items()}


def _grid(wg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """wint4's scale and integer zero of each row of ``wg [N, group]`` (range widened to hold 0)."""
    lo, hi = wg.min(1, keepdims=True).clip(max=0), wg.max(1, keepdims=True).clip(min=0)
    scale = (hi - lo) / 15
    scale[scale == 0] = 1
    return scale, np.clip(np.rint(-lo / scale), 0, 15)


def gptq(w: np.ndarray, hessian: np.ndarray, group: int = 128, damp: float = 0.1) -> np.ndarray:
    """GPTQ on wint4's grid: ``w [out, in]`` rounded column by column, each error spread over the columns after it."""
    w = w.astype(np.float64).copy()
    h = hessian.copy()
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * np.mean(np.diag(h)) * np.eye(len(h))
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T
    out = np.zeros_like(w)
    for i in range(w.shape[1]):
        if i % group == 0:
            scale, zero = _grid(w[:, i:i + group])
        q = scale[:, 0] * (np.clip(np.rint(w[:, i] / scale[:, 0]) + zero[:, 0], 0, 15) - zero[:, 0])
        out[:, i] = q
        w[:, i + 1:] -= np.outer((w[:, i] - q) / hinv[i, i], hinv[i, i + 1:])
    return out.astype(np.float32)


def float_min(w: np.ndarray, group: int = 128) -> np.ndarray:
    """Q4_1's rule on ``w [out, in]``: ``min + scale * q`` per group of ``group`` input rows."""
    out = np.empty_like(w)
    for g in range(0, w.shape[1], group):
        wg = w[:, g:g + group]
        lo, hi = wg.min(1, keepdims=True), wg.max(1, keepdims=True)
        scale = (hi - lo) / 15
        scale[scale == 0] = 1
        out[:, g:g + group] = lo + scale * np.clip(np.rint((wg - lo) / scale), 0, 15)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=4096, help="evaluated tokens (windows of 512)")
    parser.add_argument("--calibration-tokens", type=int, default=16384, help="GPTQ / activation statistics")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results", "int4_rounding.json"))
    args = parser.parse_args()

    import torch
    from compare_vllm import cpu_description, ensure_hf_model
    from transformers import AutoModelForCausalLM

    from fastdeploy import envs
    from fastdeploy.model_executor.layers.quantization.int_kernels import quantize_int4
    from fastdeploy.transformers_utils.tokenizer import get_tokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    text, source = english_text("auto")
    tokenizer = get_tokenizer(None)
    windows = token_windows(tokenizer, text, 512, args.max_tokens)
    # Calibration from the second half of the text: none of the evaluated windows.
    calibration = token_windows(tokenizer, text[len(text) // 2:], 512, args.calibration_tokens)
    model = AutoModelForCausalLM.from_pretrained(ensure_hf_model(envs.cache_root()), dtype=torch.float32).eval()
    original = {n: p.detach().numpy().copy() for n, p in model.named_parameters() if n.endswith("_proj.weight")}
    params = dict(model.named_parameters())
    base = perplexity(model, windows)
    print(f"unrounded: {base:.4f}", flush=True)
    hessians = input_statistics(model, calibration)

    def rtn(group: int) -> Callable[[str, np.ndarray], np.ndarray]:
        return lambda name, w: quantize_int4(w.T, group).dequantize().T

    def keep_top(name: str, w: np.ndarray) -> np.ndarray:
        energy = np.diag(hessians[name])
        top = np.argsort(energy)[::-1][: max(1, len(energy) // 100)]
        out = rtn(128)(name, w)
        out[:, top] = w[:, top]
        return out

    rules: dict[str, Callable[[str, np.ndarray], np.ndarray]] = {
        "rtn-g128": rtn(128), "rtn-g64": rtn(64), "rtn-g32": rtn(32),
        "float-min-g128": lambda name, w: float_min(w), "float-min-g32": lambda name, w: float_min(w, 32),
        "gptq-g128": lambda name, w: gptq(w, hessians[name]),
        "rtn-g128-keep-1pct": keep_top,
    }
    results = {}
    for rule, fn in rules.items():
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, w in original.items():
                params[name].copy_(torch.from_numpy(np.ascontiguousarray(fn(name, w))))
        ppl = perplexity(model, windows)
        results[rule] = {"perplexity": round(ppl, 4), "relative": round(ppl / base - 1, 4),
                         "seconds": round(time.perf_counter() - t0, 1)}
        print(rule, results[rule], flush=True)
    report = {
        "benchmark": "benchmarks/benchmark_int4_rounding.py",
        "command": "python benchmarks/benchmark_int4_rounding.py " + " ".join(sys.argv[1:]),
        "model": "SmolLM2-135M-Instruct (the GGUF's Q4_1 weights dequantized, transformers fp32)",
        "cpu": cpu_description(),
        "text": source,
        "evaluated_tokens": sum(len(w) for w in windows),
        "calibration_tokens": sum(len(w) for w in calibration),
        "unrounded_perplexity": round(base, 4),
        "results": results,
    }
    write_report(report, args.output)


if __name__ == "__main__":
    main()
