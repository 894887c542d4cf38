"""The ngram and suffix proposers on hand-made token sequences."""

import numpy as np

from fastdeploy.spec_decode.ngram_proposer import NgramProposer
from fastdeploy.spec_decode.suffix_proposer import SuffixProposer, SuffixTree


def _rows(seqs, width=None):
    width = width or max(map(len, seqs)) + 4
    ids = np.full((len(seqs), width), 99, dtype=np.int64)  # garbage past each row's end
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    return ids, np.array([len(s) for s in seqs], dtype=np.int64)


def _reference(seq, k, lo, hi):
    """Longest tail n in [lo, hi] found earlier (earliest occurrence), the k tokens after it."""
    for n in range(min(hi, len(seq) - 1), lo - 1, -1):
        tail = seq[-n:]
        for start in range(0, len(seq) - n):
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []


def test_ngram_longest_earliest_match_batched():
    seqs = [
        [1, 2, 3, 4, 5, 1, 2, 3],          # tail 1 2 3 -> 4 5 1
        [7, 8, 9, 7, 8, 6, 7, 8],          # tail 7 8: earliest occurrence -> 9 7 8
        [1, 2, 3],                         # no repeat -> none
        [5, 5, 5, 5],                      # overlapping repeats
        [4, 1, 9, 2, 9, 2, 4, 1],          # tail 4 1 -> 9 2 9
    ]
    ids, n = _rows(seqs)
    got = NgramProposer(3, 2, 3).propose(ids, n)
    assert got == [_reference(s, 3, 2, 3) for s in seqs]
    assert got[0] == [4, 5, 1] and got[1] == [9, 7, 8] and got[2] == []


def test_ngram_random_sequences_match_the_reference():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 4, size=int(rng.integers(2, 40))).tolist() for _ in range(60)]
    ids, n = _rows(seqs)
    for lo, hi, k in [(1, 1, 2), (1, 4, 3), (2, 3, 5), (3, 5, 1)]:
        assert NgramProposer(k, lo, hi).propose(ids, n) == [_reference(s, k, lo, hi) for s in seqs]


def test_ngram_min_window_is_respected():
    ids, n = _rows([[3, 1, 2, 9, 2]])
    assert NgramProposer(2, 2, 3).propose(ids, n) == [[]]      # only a 1-token match exists
    assert NgramProposer(2, 1, 3).propose(ids, n) == [[9, 2]]


def test_suffix_tree_counts_and_uncounts():
    tree = SuffixTree(4)
    tree.add_sequence([1, 2, 3, 1, 2, 4])
    assert tree.root.children[1].count == 2 and tree.root.children[1].children[2].count == 2
    tree.add_sequence([1, 2, 3, 1, 2, 4], sign=-1)
    assert not tree.root.children


def test_suffix_tree_extend_equals_add():
    seq = [5, 1, 2, 5, 1, 3, 5, 1, 2, 2]
    a, b = SuffixTree(3), SuffixTree(3)
    a.add_sequence(seq)
    b.add_sequence(seq[:4])
    tails = b.extend(b.tail_nodes(seq[:4]), seq[4:])
    assert tails == b.tail_nodes(seq)

    def dump(node, prefix=()):
        out = {}
        for tok, child in node.children.items():
            out[prefix + (tok,)] = child.count
            out.update(dump(child, prefix + (tok,)))
        return out

    assert dump(a.root) == dump(b.root)


def test_suffix_proposer_uses_own_and_past_outputs():
    p = SuffixProposer(4, max_tree_depth=8, max_cached_requests=2, max_spec_factor=4.0, min_token_prob=0.1)
    # Its own repeated text.
    assert p.propose("a", [1, 2, 3, 4, 5, 1, 2]) == [3, 4, 5, 1]
    # A past request's output answers a new prompt ending the same way.
    p.finish("a", [10, 11, 12, 13, 14])
    assert p.propose("b", [7, 8, 10, 11]) == [12, 13, 14]
    # FIFO eviction takes the oldest output out of the global tree.
    p.finish("b", [20, 21])
    p.finish("c", [30, 31])
    assert p.propose("d", [10, 11]) == []
