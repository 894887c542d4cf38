"""Speculative decoding metrics: vLLM's Prometheus counters and the periodic acceptance log line.

``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens`` (exported
with prometheus_client's ``_total`` suffix) and ``vllm:spec_decode_num_accepted_tokens_per_pos``
with a ``position`` label, registered only when speculative decoding is configured, as in vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

from fastdeploy.spec_decode.scheduling import SpecDecodingStats


class SpecDecodingProm:
    """The four counters, under the engine's ``model_name`` / ``engine`` labels."""

    def __init__(self, family: Callable[..., Any], labels: list[str], values: tuple[str, ...],
                 num_spec_tokens: int) -> None:
        # ``family`` registers a metric family once per registry, so every data-parallel engine's
        # logger writes its own ``engine`` label of the same counters.
        def counter(name: str, doc: str) -> Counter:
            return family(Counter, name, doc, labels).labels(*values)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        per_pos = family(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                         "Accepted tokens per draft position.", [*labels, "position"])
        self.per_pos = [per_pos.labels(*values, str(pos)) for pos in range(num_spec_tokens)]

    def observe(self, stats: SpecDecodingStats) -> None:
        self.num_drafts.inc(stats.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        for counter, value in zip(self.per_pos, stats.num_accepted_tokens_per_pos, strict=False):
            counter.inc(value)


class SpecDecodingTotals:
    """Draft counts summed over an interval (the log line) or a whole run (``LLM``'s totals)."""

    def __init__(self, num_spec_tokens: int) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.reset()

    def reset(self) -> None:
        self.stats = SpecDecodingStats(self.num_spec_tokens)
        self.start = time.monotonic()

    def observe(self, stats: SpecDecodingStats) -> None:
        s = self.stats
        s.num_drafts += stats.num_drafts
        s.num_draft_tokens += stats.num_draft_tokens
        s.num_accepted_tokens += stats.num_accepted_tokens
        for i, v in enumerate(stats.num_accepted_tokens_per_pos[: self.num_spec_tokens]):
            s.num_accepted_tokens_per_pos[i] += v

    @property
    def acceptance_rate(self) -> float:
        s = self.stats
        return s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        """Per draft position: the share of drafts whose token there was accepted."""
        n = self.stats.num_drafts
        return [v / n if n else float("nan") for v in self.stats.num_accepted_tokens_per_pos]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified draft, the bonus token included (vLLM's convention)."""
        s = self.stats
        return 1 + s.num_accepted_tokens / s.num_drafts if s.num_drafts else float("nan")

    def log_line(self) -> str | None:
        """vLLM's ``SpecDecoding metrics:`` line for the interval, then a fresh interval; None without drafts."""
        s = self.stats
        if not s.num_drafts:
            self.reset()
            return None
        elapsed = max(time.monotonic() - self.start, 1e-9)
        line = (f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
                f"Accepted throughput: {s.num_accepted_tokens / elapsed:.2f} tokens/s, "
                f"Drafted throughput: {s.num_draft_tokens / elapsed:.2f} tokens/s, "
                f"Accepted: {s.num_accepted_tokens} tokens, Drafted: {s.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {', '.join(f'{p:.3f}' for p in self.per_position_acceptance)}, "
                f"Avg Draft acceptance rate: {self.acceptance_rate * 100:.1f}%")
        self.reset()
        return line
