"""Load-balancing policies: pick one instance among the available ones for a request.

Every policy sees the same inputs: the candidate instances (healthy, not draining, of the
wanted role) and a :class:`RequestFeatures` summary of the request. Loads are the router's own
counts of what it has in flight on each instance, which are exact for traffic that goes
through the router and never stale (a polled figure would lag a burst of requests).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastdeploy.router.instance import InstanceState

# Used when the text of a prompt stands in for its token count (about 4 characters a token
# for English with a BPE tokenizer); the router does not load the model's tokenizer.
CHARS_PER_TOKEN = 4


@dataclass
class RequestFeatures:
    """What the policies need to know about a request."""

    prefix_text: str = ""
    num_prompt_tokens: int = 0

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> RequestFeatures:
        """Prompt text (for prefix affinity) and an estimate of its token count."""
        text, tokens = _prompt_text_and_tokens(body)
        return cls(prefix_text=text, num_prompt_tokens=tokens)


def _prompt_text_and_tokens(body: dict[str, Any]) -> tuple[str, int]:
    if "messages" in body:
        parts = []
        for message in body.get("messages") or []:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                # Multi-part content: only its text parts carry a prefix worth hashing.
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{message.get('role', '')}>{content or ''}")
        text = "".join(parts)
        return text, max(1, len(text) // CHARS_PER_TOKEN)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        # Token ids: exact length; the ids themselves are the prefix.
        return ",".join(map(str, prompt)), len(prompt)
    if isinstance(prompt, list):
        # A batch of prompts goes to one instance; the first decides affinity, all count for load.
        texts = [",".join(map(str, p)) if isinstance(p, list) else str(p) for p in prompt]
        tokens = sum(len(p) if isinstance(p, list) else max(1, len(str(p)) // CHARS_PER_TOKEN) for p in prompt)
        return (texts[0] if texts else ""), tokens
    text = str(prompt)
    return text, max(1, len(text) // CHARS_PER_TOKEN)


class LoadBalancePolicy:
    """Chooses an instance; ``on_routed`` lets stateful policies learn where a request went."""

    name: str = ""

    def select(self, candidates: Sequence[InstanceState], features: RequestFeatures) -> InstanceState:
        raise NotImplementedError

    def on_routed(self, instance: InstanceState, features: RequestFeatures) -> None:
        """Called once the request has been sent to ``instance``."""

    def forget(self, instance_id: str) -> None:
        """Drop what the policy remembers about an instance that left."""


class RoundRobinPolicy(LoadBalancePolicy):
    """Each instance in turn (in registration order), whatever its load."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, candidates: Sequence[InstanceState], features: RequestFeatures) -> InstanceState:
        return candidates[next(self._counter) % len(candidates)]


class RandomPolicy(LoadBalancePolicy):
    """A uniformly random instance."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, candidates: Sequence[InstanceState], features: RequestFeatures) -> InstanceState:
        return self._rng.choice(list(candidates))


class _LeastLoaded(LoadBalancePolicy):
    """The instance with the smallest ``load``; ties rotate so equal instances share the work."""

    def __init__(self) -> None:
        self._tie_counter = itertools.count()

    @staticmethod
    def load(instance: InstanceState) -> float:
        raise NotImplementedError

    def select(self, candidates: Sequence[InstanceState], features: RequestFeatures) -> InstanceState:
        return least_loaded(candidates, self.load, next(self._tie_counter))


def least_loaded(candidates: Sequence[InstanceState], load: Any, tie_break: int = 0) -> InstanceState:
    """The least loaded candidate; ``tie_break`` rotates among equally loaded ones."""
    best = min(load(c) for c in candidates)
    tied = [c for c in candidates if load(c) == best]
    return tied[tie_break % len(tied)]


class RequestNumPolicy(_LeastLoaded):
    """Fewest requests in flight (join the shortest queue)."""

    name = "request_num"

    @staticmethod
    def load(instance: InstanceState) -> float:
        return instance.in_flight


class ProcessTokensPolicy(_LeastLoaded):
    """Fewest prompt tokens in flight: long prompts weigh more than short ones."""

    name = "process_tokens"

    @staticmethod
    def load(instance: InstanceState) -> float:
        return instance.in_flight_tokens


class PowerOfTwoPolicy(LoadBalancePolicy):
    """Two random instances, the less loaded wins: near least-loaded balance at O(1) cost."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, candidates: Sequence[InstanceState], features: RequestFeatures) -> InstanceState:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        if a.in_flight == b.in_flight:
            return a
        return a if a.in_flight < b.in_flight else b


class CacheAwarePolicy(LoadBalancePolicy):
    """Prefix affinity: a request goes where the longest prefix of its prompt was sent before.

    The prompt text is cut into ``block_chars`` blocks (up to ``max_prefix_chars``) and each
    block gets a chained hash (the hash of everything up to it), as the engine's prefix cache
    hashes full KV blocks. The table maps each chained hash to the instance that last served
    it, so requests that share a system prompt but differ later still meet on one instance.
    While the load is balanced the deepest match wins if it covers at least ``cache_threshold``
    of the prompt (a few shared characters, like a common greeting, are not worth piling
    requests on one instance); otherwise the request goes to the least loaded instance. When the load is imbalanced (max - min in flight above
    ``balance_abs_threshold`` *and* max above ``balance_rel_threshold`` x min) affinity is
    dropped for that request and the least loaded instance takes it, so one hot prefix cannot
    pile every request onto one instance.
    """

    name = "cache_aware"

    def __init__(self, block_chars: int = 64, max_prefix_chars: int = 4096, max_entries: int = 200_000,
                 cache_threshold: float = 0.5, balance_abs_threshold: int = 8,
                 balance_rel_threshold: float = 1.5) -> None:
        if block_chars < 1:
            raise ValueError("block_chars must be at least 1.")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1].")
        self.block_chars = block_chars
        self.cache_threshold = cache_threshold
        self.max_prefix_chars = max_prefix_chars
        self.max_entries = max_entries
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        # chained prefix hash -> instance id, oldest first (evicted first when full).
        self._table: OrderedDict[bytes, str] = OrderedDict()
        self._tie_counter = itertools.count()
        self.hits = 0
        self.misses = 0

    def prefix_hashes(self, text: str) -> list[bytes]:
        """Chained hashes of the prompt's blocks; a short last block counts too."""
        text = text[: self.max_prefix_chars]
        hashes = []
        digest = b""
        for start in range(0, len(text), self.block_chars):
            block = text[start:start + self.block_chars].encode("utf-8", "surrogatepass")
            digest = hashlib.blake2b(digest + block, digest_size=16).digest()
            hashes.append(digest)
        return hashes

    def _imbalanced(self, candidates: Sequence[InstanceState]) -> bool:
        loads = [c.in_flight for c in candidates]
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold

    def select(self, candidates: Sequence[InstanceState], features: RequestFeatures) -> InstanceState:
        least = least_loaded(candidates, lambda c: c.in_flight, next(self._tie_counter))
        if len(candidates) == 1 or self._imbalanced(candidates):
            return least
        by_id = {c.id: c for c in candidates}
        hashes = self.prefix_hashes(features.prefix_text)
        considered = min(len(features.prefix_text), self.max_prefix_chars)
        for depth in range(len(hashes), 0, -1):
            owner = by_id.get(self._table.get(hashes[depth - 1], ""))
            if owner is not None:
                if min(depth * self.block_chars, considered) >= self.cache_threshold * considered:
                    self.hits += 1
                    return owner
                break
        self.misses += 1
        return least

    def on_routed(self, instance: InstanceState, features: RequestFeatures) -> None:
        for digest in self.prefix_hashes(features.prefix_text):
            self._table[digest] = instance.id
            self._table.move_to_end(digest)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)

    def forget(self, instance_id: str) -> None:
        for digest in [d for d, owner in self._table.items() if owner == instance_id]:
            del self._table[digest]


POLICIES: dict[str, type[LoadBalancePolicy]] = {
    cls.name: cls
    for cls in (RoundRobinPolicy, RandomPolicy, PowerOfTwoPolicy, RequestNumPolicy, ProcessTokensPolicy,
                CacheAwarePolicy)
}


def make_policy(name: str, **options: Any) -> LoadBalancePolicy:
    """A policy by name; ``options`` are passed to the policies that take them (cache_aware's)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"Unknown load-balancing policy {name!r}; choose one of {', '.join(POLICIES)}.") from None
    if cls is CacheAwarePolicy:
        return cls(**{k: v for k, v in options.items() if v is not None})
    return cls()
