"""Suffix decoding (Oliaro et al., as Arctic Inference builds it): drafts from suffix trees.

Two trees of counted token paths, each at most ``max_tree_depth`` deep: one per request over its
prompt and output (grown a token at a time), and one global over the outputs of the last
``max_cached_requests`` finished requests (FIFO: the oldest output's counts are taken out
again). A draft follows the longest tail of the request's tokens found in a tree, then walks
the most frequent continuation while its estimated probability (child count / parent count,
multiplied along the path) stays at or above ``min_token_prob``, for at most
``min(k, max_spec_factor * match length)`` tokens. The longer of the two trees' drafts wins.

Arctic Inference's own package (``arctic-inference``) ships as a CUDA-built source
distribution, so this compact pure-Python tree is used on CPU.
"""

from __future__ import annotations

from collections import deque


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTree:
    """Counts of every token path of length <= ``depth`` in the sequences added to it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add_sequence(self, tokens: list[int], sign: int = 1) -> None:
        """Count (``sign=1``) or uncount (``-1``) every path of ``tokens`` up to ``depth`` long."""
        for start in range(len(tokens)):
            node = self.root
            for tok in tokens[start : start + self.depth]:
                child = node.children.get(tok)
                if child is None:
                    if sign < 0:
                        break
                    child = node.children[tok] = _Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[tok]
                    break
                node = child

    def _count(self, node: _Node, tok: int) -> _Node:
        child = node.children.get(tok)
        if child is None:
            child = node.children[tok] = _Node()
        child.count += 1
        return child

    def extend(self, active: list[_Node], tokens: list[int]) -> list[_Node]:
        """Count the paths ending in each of ``tokens`` (appended to a sequence already added).

        ``active[i]`` is the node of the sequence's last ``i + 1`` tokens (the paths a new token
        extends); the updated list is returned. O(depth) per token.
        """
        for tok in tokens:
            active = [self._count(self.root, tok)] + [self._count(n, tok) for n in active[: self.depth - 1]]
        return active

    def tail_nodes(self, tokens: list[int]) -> list[_Node]:
        """The ``active`` list of a sequence already added (its tails' nodes, shortest first)."""
        out = []
        for m in range(1, min(self.depth, len(tokens)) + 1):
            node = self._find(tokens[-m:])
            if node is None:
                break
            out.append(node)
        return out

    def _find(self, context: list[int]) -> _Node | None:
        node = self.root
        for tok in context:
            node = node.children.get(tok)
            if node is None:
                return None
        return node

    def speculate(self, context: list[int], max_tokens: int, max_spec_factor: float, min_token_prob: float,
                  tails: list[_Node] | None = None) -> list[int]:
        """Drafts after the longest tail of ``context`` in the tree (see the module doc).

        ``tails``: the nodes of the context's tails when the caller keeps them (saves the lookups).
        """
        for m in range(min(self.depth - 1, len(context)), 0, -1):
            node = (tails[m - 1] if m <= len(tails) else None) if tails is not None else self._find(context[-m:])
            if node is None or not node.children:
                continue
            limit = min(max_tokens, int(max_spec_factor * m), self.depth - m)
            out: list[int] = []
            prob = 1.0
            while len(out) < limit and node.children:
                tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
                prob *= child.count / max(node.count, sum(c.count for c in node.children.values()))
                if prob < min_token_prob:
                    break
                out.append(tok)
                node = child
            if out:
                return out
        return []


class SuffixProposer:
    """Per-request trees plus the global tree of recent outputs."""

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int, max_cached_requests: int,
                 max_spec_factor: float, min_token_prob: float) -> None:
        self.k = num_speculative_tokens
        self.depth = max_tree_depth
        self.max_cached = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_tree = SuffixTree(max_tree_depth)
        self._cached: deque[list[int]] = deque()
        # Per request: its tree, the tokens it holds and the nodes of their tails.
        self._local: dict[str, tuple[SuffixTree, list[int], list[_Node]]] = {}

    def propose(self, req_id: str, tokens: list[int]) -> list[int]:
        """Drafts for a request whose tokens (prompt + output) are ``tokens``."""
        entry = self._local.get(req_id)
        # A request's tokens only grow (a preempted one resumes with the same ones).
        if entry is None or len(entry[1]) > len(tokens):
            tree = SuffixTree(self.depth)
            tree.add_sequence(tokens)
            entry = (tree, list(tokens), tree.tail_nodes(tokens))
        else:
            tree, held, tails = entry
            new = tokens[len(held):]
            held.extend(new)
            entry = (tree, held, tree.extend(tails, new))
        self._local[req_id] = entry
        context = tokens[-self.depth:]
        args = (self.k, self.max_spec_factor, self.min_token_prob)
        local = entry[0].speculate(context, *args, tails=entry[2])
        glob = self.global_tree.speculate(context, *args) if self._cached else []
        return glob if len(glob) > len(local) else local

    def finish(self, req_id: str, output_tokens: list[int]) -> None:
        """Forget the request's tree; keep its output in the global tree."""
        self._local.pop(req_id, None)
        if self.max_cached == 0 or not output_tokens:
            return
        self.global_tree.add_sequence(output_tokens)
        self._cached.append(list(output_tokens))
        while len(self._cached) > self.max_cached:
            self.global_tree.add_sequence(self._cached.popleft(), sign=-1)
