"""PagedAttention against a dense numpy reference: writes, decodes, prefills, chunked prefills, mixes."""

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata, PrefillSeqMetadata
from fastdeploy.model_executor.layers.attention.paged_attention import PagedAttention

H, KVH, D, BS, NUM_BLOCKS = 6, 2, 8, 4, 32
SCALE = D**-0.5


def ref_attention(q, k, v, offset):
    """q [Lq, H, D], k/v [Lc, KVH, D]; query i sees keys 0 .. offset + i."""
    g = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("qhd,khd->hqk", q, kk) * SCALE
    lq, lc = q.shape[0], k.shape[0]
    s = s + np.triu(np.full((lq, lc), -np.inf, dtype=np.float32), k=offset + 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, vv).reshape(lq, -1)


class Harness:
    """Sequences with histories of K/V and shuffled blocks; builds metadata like a model runner."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.blocks = [int(b) for b in self.rng.permutation(NUM_BLOCKS)]
        shape = [NUM_BLOCKS, BS, KVH, D]
        # A sentinel in every slot shows which ones get written.
        self.cache = (paddle.full(shape, 7.0), paddle.full(shape, 7.0))
        self.seqs = {}

    def slots(self, sid, positions):
        table = np.asarray(self.seqs[sid]["blocks"])
        return table[positions // BS] * BS + positions % BS

    def step(self, attn, schedule, causal_mask=False, heads_layout=False):
        """schedule: [(seq_id, n_new)], decodes (n=1) first. Returns (ours, reference)."""
        qs, ks, vs, refs, slot_mapping = [], [], [], [], []
        dec_slots, prefills, row = [], [], 0
        for sid, n in schedule:
            seq = self.seqs.setdefault(sid, {"blocks": [], "k": np.zeros((0, KVH, D), np.float32)})
            seq.setdefault("v", np.zeros((0, KVH, D), np.float32))
            start = len(seq["k"])
            while len(seq["blocks"]) * BS < start + n:
                seq["blocks"].append(self.blocks.pop())
            q = self.rng.standard_normal((n, H, D)).astype(np.float32)
            k = self.rng.standard_normal((n, KVH, D)).astype(np.float32)
            v = self.rng.standard_normal((n, KVH, D)).astype(np.float32)
            seq["k"], seq["v"] = np.concatenate([seq["k"], k]), np.concatenate([seq["v"], v])
            refs.append(ref_attention(q, seq["k"], seq["v"], start))
            qs.append(q), ks.append(k), vs.append(v)
            pos = np.arange(start, start + n)
            slot_mapping += self.slots(sid, pos).tolist()
            ctx = np.arange(start + n)
            if n == 1:
                dec_slots.append(self.slots(sid, ctx))
            else:
                mask = None
                if causal_mask:
                    mask = paddle.to_tensor(np.triu(np.full((n, start + n), -np.inf, np.float32), k=start + 1))
                prefills.append(PrefillSeqMetadata(row, n, start + n, paddle.to_tensor(self.slots(sid, ctx)), mask))
            row += n
        md = AttentionMetadata(num_tokens=row, slot_mapping=paddle.to_tensor(slot_mapping, dtype="int64"))
        md.num_decodes, md.prefills = len(dec_slots), prefills
        if dec_slots:
            width = max(len(s) for s in dec_slots)
            padded = np.zeros((len(dec_slots), width), np.int64)  # padding -> slot 0, masked
            mask = np.full((len(dec_slots), 1, 1, width), -np.inf, np.float32)
            for i, s in enumerate(dec_slots):
                padded[i, : len(s)], mask[i, ..., : len(s)] = s, 0.0
            md.decode_slots, md.decode_mask = paddle.to_tensor(padded), paddle.to_tensor(mask)
        q = paddle.to_tensor(np.concatenate(qs).reshape(row, H * D))
        k = paddle.to_tensor(np.concatenate(ks).reshape(row, KVH * D))
        v = paddle.to_tensor(np.concatenate(vs).reshape(row, KVH * D))
        if heads_layout:
            q, k, v = q.reshape([row, H, D]), k.reshape([row, KVH, D]), v.reshape([row, KVH, D])
        out = attn(q, k, v, self.cache, md)
        return out.numpy(), np.concatenate(refs)

    def check_cache(self):
        """Every written slot holds its K/V; every other slot still holds the sentinel."""
        k_cache = self.cache[0].numpy().reshape(-1, KVH, D)
        v_cache = self.cache[1].numpy().reshape(-1, KVH, D)
        written = np.zeros(len(k_cache), bool)
        for sid, seq in self.seqs.items():
            s = self.slots(sid, np.arange(len(seq["k"])))
            np.testing.assert_array_equal(k_cache[s], seq["k"])
            np.testing.assert_array_equal(v_cache[s], seq["v"])
            written[s] = True
        assert (k_cache[~written] == 7.0).all() and (v_cache[~written] == 7.0).all()


@pytest.fixture
def attn():
    return PagedAttention(H, D, SCALE, KVH)


@pytest.mark.parametrize("causal_mask", [False, True])
def test_prefill_then_decodes(attn, causal_mask):
    h = Harness()
    ours, ref = h.step(attn, [("a", 9)], causal_mask=causal_mask)
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    for _ in range(6):
        ours, ref = h.step(attn, [("a", 1)])
        np.testing.assert_allclose(ours, ref, atol=1e-5)
    h.check_cache()


@pytest.mark.parametrize("causal_mask", [False, True])
def test_mixed_batch_with_chunked_prefill(attn, causal_mask):
    h = Harness(seed=1)
    ours, ref = h.step(attn, [("a", 7), ("c", 6)], causal_mask=causal_mask)
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    # 2 decodes of different lengths + a new prefill + the second chunk of "c" over its cached context.
    h.step(attn, [("b", 3)])
    ours, ref = h.step(attn, [("a", 1), ("b", 1), ("d", 5), ("c", 4)], causal_mask=causal_mask)
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    ours, ref = h.step(attn, [("a", 1), ("b", 1), ("c", 1), ("d", 1)])
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    h.check_cache()


def test_single_token_prompt_as_decode(attn):
    h = Harness(seed=2)
    ours, ref = h.step(attn, [("a", 1)])
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_heads_layout_inputs(attn):
    """q/k/v may come as [T, heads, D] (the models pass the split of a stacked tensor)."""
    ours_2d, ref = Harness(seed=3).step(attn, [("a", 5)])
    ours_3d, _ = Harness(seed=3).step(attn, [("a", 5)], heads_layout=True)
    np.testing.assert_allclose(ours_2d, ref, atol=1e-5)
    np.testing.assert_array_equal(ours_3d, ours_2d)


def test_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="multiple"):
        PagedAttention(6, 8, 1.0, 4)
