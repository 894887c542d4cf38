"""fd_paged_attention (csrc/cpu/attention.cc, attention_bf16.cc) against PagedAttention's plain Paddle path.

Mixed batches (decodes of different lengths, a fresh prefill, a later chunk over cached
context, a prefill longer than one work tile), GQA, block sizes 4 and 16, the generic
and the specialized head sizes, fp32 and bf16 caches, on the fp32 path (attn_isa 0) and, where
the CPU has AVX512-BF16, the bf16 dot-product path (attn_isa 1), and where it has AMX, that path
with the scores on AMX tiles (attn_isa 2); and batch invariance: a sequence gets bit-identical
outputs alone or batched.
"""

import numpy as np
import paddle
import pytest

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers.attention.metadata import build_attention_metadata
from fastdeploy.model_executor.custom_op import set_op_backend
from fastdeploy.model_executor.layers.attention.paged_attention import PagedAttention
from fastdeploy.platforms.cpu import attention_kernel_paths
from fastdeploy.platforms.interface import ATTN_PREFETCH_L2, OpBackend
from tests.csrc.conftest import bf16_round

H, KVH = 6, 2
# (tokens already cached, new tokens) per sequence; decodes first.
SCHEDULE = [(20, 1), (0, 1), (37, 1), (0, 9), (13, 5), (0, 45)]


class Batch:
    """Random K/V for every context position in shuffled blocks, queries for the new tokens."""

    def __init__(self, d, block_size, schedule, cache_dtype="float32", seed=0, heads=(H, KVH)):
        self.h, self.kvh = heads
        rng = np.random.default_rng(seed)
        self.schedule = schedule
        seq_lens = np.array([c + n for c, n in schedule])
        blocks_per_seq = -(-seq_lens // block_size)
        num_blocks = int(blocks_per_seq.sum()) + 3
        order = rng.permutation(num_blocks)
        self.block_tables = np.zeros((len(schedule), int(blocks_per_seq.max())), np.int64)
        used = 0
        for i, nb in enumerate(blocks_per_seq):
            self.block_tables[i, :nb] = order[used : used + nb]
            used += nb
        kv = rng.standard_normal((2, num_blocks, block_size, self.kvh, d)).astype(np.float32)
        if cache_dtype == "bfloat16":
            kv = bf16_round(kv)
        self.kv_fp32 = kv
        self.caches = (paddle.to_tensor(kv[0]).astype(cache_dtype), paddle.to_tensor(kv[1]).astype(cache_dtype))
        self.md, _ = build_attention_metadata(
            self.block_tables, np.array([n for _, n in schedule]), seq_lens, block_size
        )
        t = self.md.num_tokens
        # Wider than H * D, like the fused QKV buffer the model passes: the kernel reads the first H * D columns.
        self.query = rng.standard_normal((t, (self.h + 2 * self.kvh) * d)).astype(np.float32)
        self.d = d

    def kernel(self, attn_isa=0):
        md = self.md
        k, v = self.caches
        out = ops.paged_attention(
            paddle.to_tensor(self.query), k, v, md.block_tables, md.query_start_loc, md.seq_lens, self.h, self.d**-0.5,
            attn_isa,
        )
        return out.numpy()

    def paddle_reference(self):
        """The plain-Paddle path on fp32 caches (re-writing this step's K/V, which are already there)."""
        with set_op_backend(OpBackend()):
            attn = PagedAttention(self.h, self.d, self.d**-0.5, self.kvh)
        caches = (paddle.to_tensor(self.kv_fp32[0]), paddle.to_tensor(self.kv_fp32[1]))
        slots = self.md.slot_mapping.numpy()
        k = self.kv_fp32[0].reshape(-1, self.kvh, self.d)[slots]
        v = self.kv_fp32[1].reshape(-1, self.kvh, self.d)[slots]
        q = paddle.to_tensor(self.query[:, : self.h * self.d])
        return attn(q, paddle.to_tensor(k), paddle.to_tensor(v), caches, self.md).numpy()


@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_matches_paddle(d, block_size):
    batch = Batch(d, block_size, SCHEDULE)
    np.testing.assert_allclose(batch.kernel(), batch.paddle_reference(), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("d", [16, 64])
def test_bf16_cache_matches_paddle_on_the_same_values(d):
    batch = Batch(d, 16, SCHEDULE, cache_dtype="bfloat16")
    np.testing.assert_allclose(batch.kernel(), batch.paddle_reference(), rtol=1e-5, atol=2e-6)


needs_bf16 = pytest.mark.skipif("avx512-bf16" not in attention_kernel_paths(), reason="no AVX512-BF16 on this CPU")
needs_amx = pytest.mark.skipif("amx-bf16" not in attention_kernel_paths(), reason="no AMX-BF16 on this CPU")
# The bf16 paths: dot products only (1), and the scores on AMX tiles (2).
BF16_ISAS = [pytest.param(1, marks=needs_bf16), pytest.param(2, marks=needs_amx)]
ATTN_ISAS = [0, *BF16_ISAS]


@pytest.mark.parametrize("bf16_isa", BF16_ISAS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_bf16_dot_products_match_paddle_within_bf16_rounding(d, block_size, bf16_isa):
    """The bf16 path rounds the scaled queries and the probabilities to bf16 (8 bits of mantissa):
    its rows stay within that rounding of the fp32 reference, and a wrong key, lane or block would
    be off by the size of the outputs themselves."""
    batch = Batch(d, block_size, SCHEDULE, cache_dtype="bfloat16")
    ref = batch.paddle_reference()
    out = batch.kernel(attn_isa=bf16_isa)
    assert np.abs(out - ref).max() < 1e-2 * np.abs(ref).max()
    np.testing.assert_allclose(out, ref, rtol=5e-2, atol=5e-3)
    # Not the fp32 path under another name: the bf16 rounding shows.
    assert np.abs(out - batch.kernel(attn_isa=0)).max() > 1e-6


@pytest.mark.parametrize("isa", [0, *BF16_ISAS])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_l2_prefetch_changes_no_output(isa, cache_dtype):
    """ATTN_PREFETCH_L2 only moves where the next rows are fetched to: the same path, bit for bit."""
    batch = Batch(64, 16, SCHEDULE, cache_dtype=cache_dtype)
    l1 = batch.kernel(attn_isa=isa)
    np.testing.assert_array_equal(batch.kernel(attn_isa=isa + ATTN_PREFETCH_L2), l1)
    if isa and cache_dtype == "bfloat16":  # the flag did not send the bf16 path's rows to the fp32 path
        assert np.abs(l1 - batch.kernel(attn_isa=ATTN_PREFETCH_L2)).max() > 1e-6


@pytest.mark.parametrize("bf16_isa", BF16_ISAS)
def test_bf16_path_leaves_other_head_dims_and_fp32_caches_to_the_fp32_path(bf16_isa):
    bf16_d16 = Batch(16, 16, SCHEDULE, cache_dtype="bfloat16")
    np.testing.assert_array_equal(bf16_d16.kernel(attn_isa=bf16_isa), bf16_d16.kernel(attn_isa=0))
    fp32_d64 = Batch(64, 16, SCHEDULE)
    np.testing.assert_array_equal(fp32_d64.kernel(attn_isa=bf16_isa), fp32_d64.kernel(attn_isa=0))


def assert_matches_paddle(batch, attn_isa):
    """The fp32 path (0) within fp32 rounding of the reference, the bf16 ones within bf16 rounding."""
    tol = {"rtol": 5e-2, "atol": 5e-3} if attn_isa else {"rtol": 1e-5, "atol": 2e-6}
    np.testing.assert_allclose(batch.kernel(attn_isa=attn_isa), batch.paddle_reference(), **tol)


@pytest.mark.parametrize("attn_isa", ATTN_ISAS)
@pytest.mark.parametrize("block_size", [12, 16])
def test_long_context_decode(attn_isa, block_size):
    """Decodes over 300-700 cached tokens (many key tiles; with block size 12 blocks are crossed mid-tile,
    which the AMX path copies together, with 16 each full tile loads in place)."""
    schedule = [(300, 1), (517, 1), (700, 1), (0, 33)]
    assert_matches_paddle(Batch(64, block_size, schedule, cache_dtype="bfloat16", seed=3), attn_isa)


@needs_amx
def test_amx_scores_change_only_the_scores_summation():
    """The AMX path sums each score in another order than the dot products: its outputs differ from
    attn_isa 1's by at most that rounding (a wrong key, row or tile would be off by the outputs' size)."""
    batch = Batch(64, 16, [(300, 1), (517, 1), (0, 33)], cache_dtype="bfloat16", seed=3, heads=(12, 2))
    amx, dots = batch.kernel(attn_isa=2), batch.kernel(attn_isa=1)
    assert np.abs(amx - dots).max() < 2e-3 * np.abs(dots).max()


@pytest.mark.parametrize("attn_isa", ATTN_ISAS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (9, 3), (8, 2), (12, 2)])
def test_every_group_of_rows(d, heads, attn_isa):
    """Query heads per kv head 1, 2, 3, 4 and 6: a decode's rows (and a prefill tile's last rows) are 1 to 4
    at a time, each count its own compiled case; outputs match the reference and do not depend on the
    rest of the batch."""
    batch = Batch(d, 16, SCHEDULE, cache_dtype="bfloat16", seed=5, heads=heads)
    assert_matches_paddle(batch, attn_isa)
    assert_each_sequence_alone_equal(lambda: Batch(d, 16, SCHEDULE, cache_dtype="bfloat16", seed=5, heads=heads),
                                     attn_isa)


@pytest.mark.parametrize("attn_isa", ATTN_ISAS)
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_outputs_do_not_depend_on_the_rest_of_the_batch(cache_dtype, attn_isa):
    """Each sequence alone gives bit-identical rows to the same sequence in the mixed batch."""
    assert_each_sequence_alone_equal(lambda: Batch(64, 16, SCHEDULE, cache_dtype, seed=5), attn_isa)


def assert_each_sequence_alone_equal(make_batch, attn_isa):
    """``make_batch()`` run whole and each of its sequences run alone give bit-identical rows."""
    batch = make_batch()
    together = batch.kernel(attn_isa)
    start = 0
    for i, (_, n) in enumerate(batch.schedule):
        alone = make_batch()
        seq_lens = alone.md.host.seq_lens[i : i + 1]
        alone.md, _ = build_attention_metadata(alone.block_tables[i : i + 1], np.array([n]), seq_lens, 16)
        alone.query = batch.query[start : start + n]
        np.testing.assert_array_equal(alone.kernel(attn_isa), together[start : start + n], err_msg=f"sequence {i}")
        start += n


def test_bad_metadata_is_an_error():
    batch = Batch(16, 4, [(3, 2)])
    md = batch.md
    with pytest.raises(Exception, match="seq_lens"):
        ops.paged_attention(
            paddle.to_tensor(batch.query), *batch.caches, md.block_tables, md.query_start_loc,
            paddle.to_tensor(np.array([1], np.int64)), H, 0.25, 0,
        )  # fmt: skip
