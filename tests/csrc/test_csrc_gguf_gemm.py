"""fd_gguf_linear / fd_gguf_embedding (csrc/cpu/gguf_gemm.cc) against gguf-py's dequantization.

The reference is what the kernel computes in exact arithmetic: the activations quantized per
32 elements (dx = max|x| / 127, q = round(x / dx)) and dequantized again, times the weights
dequantized by ``gguf.quants.dequantize``, in fp64. Every path this CPU can run is checked, on
the weights as ``fd_gguf_pack`` lays them out (tiles of 16 columns: N = 37 leaves a part-filled
tile, and the M values every row-tile height of every path and their remainders).
"""


import numpy as np
import paddle
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from fastdeploy import _C
from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers.quantization.gguf import GGUF_KERNEL_TYPES, KERNEL_PATHS
from fastdeploy.model_executor.layers.quantization.gguf import random_blocks as gguf_random_blocks
from fastdeploy.platforms.cpu import gguf_kernel_paths

rng = np.random.default_rng(0)
TYPES = [GGMLQuantizationType(t) for t in GGUF_KERNEL_TYPES]
PATHS = gguf_kernel_paths()  # every path this CPU runs
# K: several blocks, and two 256-element superblocks for the K-quants; N: no multiple of a column tile.
K, N = 512, 37


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int) -> np.ndarray:
    """``[n, bytes per row]`` random blocks: random quants, fp16 scales (and mins) of a plausible size."""
    return gguf_random_blocks(int(qtype), n, k, rng)


def as_kernel_sees(x: np.ndarray) -> np.ndarray:
    """``x`` quantized per 32 elements to int8 and back (the kernel's rounding: nearest, ties to even)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return (np.rint(blocks * inv) * d).reshape(m, k)


def pack(w: np.ndarray, segments: list[int], k: int = K) -> paddle.Tensor:
    return ops.gguf_pack(paddle.to_tensor(w.reshape(-1)), segments, k)


def linear(x, w, segments, path, bias=None):
    b = None if bias is None else paddle.to_tensor(bias)
    packed = pack(w, segments, x.shape[-1])
    return ops.gguf_linear(paddle.to_tensor(x), packed, b, segments, KERNEL_PATHS[path]).numpy()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matches_dequantized_weights_times_quantized_activations(qtype, path):
    w = random_blocks(qtype, N, K)
    wd = dequantize(w, qtype).astype(np.float64)
    for m in (1, 2, 3, 5, 7, 16, 33, 70):  # every row-tile height and remainder (70: AMX's tiles and VNNI's)
        x = rng.standard_normal((m, K)).astype(np.float32)
        got = linear(x, w, [int(qtype), N], path)
        want = as_kernel_sees(x).astype(np.float64) @ wd.T
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=f"M={m}")


# The bytes of a block that hold its quants, and the byte that makes every quant its largest magnitude
# (Q8_0: -128, whose |w| the AVX2 path multiplies).
QUANT_BYTES = {"Q8_0": (2, 34, 0x80), "Q4_0": (2, 18, 0xFF), "Q4_1": (4, 20, 0xFF), "Q5_0": (2, 22, 0xFF),
               "Q5_1": (4, 24, 0xFF), "Q4_K": (16, 144, 0xFF), "Q5_K": (16, 176, 0xFF), "Q6_K": (0, 192, 0xFF)}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_largest_quants_times_the_largest_activations_do_not_saturate(qtype, path):
    """Every quant at its largest magnitude times activations of +-127 (a constant row): the AVX2 path adds
    several groups' int16 pair sums before widening them, as many as cannot overflow for the format."""
    w = random_blocks(qtype, N, K)
    start, end, byte = QUANT_BYTES[qtype.name]
    w.reshape(N, -1, GGML_QUANT_SIZES[qtype][1])[:, :, start:end] = byte
    wd = dequantize(w, qtype).astype(np.float64)
    x = np.array([[1.0] * K, [-1.0] * K, [3.0] * K, [-0.5] * K, [2.0] * K], np.float32)
    got = linear(x, w, [int(qtype), N], path)
    want = as_kernel_sees(x).astype(np.float64) @ wd.T
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("blocks", [1, 15, 17, 18, 24, 33])
def test_activation_blocks_in_any_number(blocks, path):
    """The VNNI paths quantize a row's activations 16 blocks at a time: K of one block, of a part-filled
    last group (the default model's 576 = 18 blocks; 768 = 24 for the K-quants, whose terms use the
    half-block sums) and an all-zero block give the reference's values."""
    k = 32 * blocks
    for qtype in [t for t in TYPES if k % GGML_QUANT_SIZES[t][0] == 0]:
        w = random_blocks(qtype, N, k)
        wd = dequantize(w, qtype).astype(np.float64)
        x = (rng.standard_normal((5, k)) * np.array([[1e-3], [1.0], [40.0], [1.0], [7.0]])).astype(np.float32)
        x[3, -32:] = 0.0
        got = linear(x, w, [int(qtype), N], path)
        want = as_kernel_sees(x).astype(np.float64) @ wd.T
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=qtype.name)


@pytest.mark.parametrize("path", PATHS)
def test_segments_of_mixed_types_with_bias(path):
    """A fused layer of shards in different types (as Q4_K_M files have) is one call."""
    types = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0]
    rows = [24, 8, 13]
    parts = [random_blocks(t, r, K) for t, r in zip(types, rows, strict=True)]
    w = np.concatenate([p.reshape(-1) for p in parts])
    wd = np.concatenate([dequantize(p, t) for p, t in zip(parts, types, strict=True)]).astype(np.float64)
    bias = rng.standard_normal(sum(rows)).astype(np.float32)
    x = rng.standard_normal((5, K)).astype(np.float32)
    segments = [v for t, r in zip(types, rows, strict=True) for v in (int(t), r)]
    got = linear(x.reshape(5, 1, K), w, segments, path, bias)
    assert got.shape == (5, 1, sum(rows))
    want = as_kernel_sees(x).astype(np.float64) @ wd.T + bias
    np.testing.assert_allclose(got.reshape(5, -1), want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_is_independent_of_the_batch_and_the_thread_count(qtype, path):
    n = 300  # enough columns for every thread to take some
    w = random_blocks(qtype, n, K)
    x = rng.standard_normal((33, K)).astype(np.float32)
    batch = linear(x, w, [int(qtype), n], path)
    for r in (0, 5, 32):
        np.testing.assert_array_equal(linear(x[r : r + 1], w, [int(qtype), n], path)[0], batch[r])
    # The kernels' own OpenMP runtime (Paddle's libiomp5 where it has one, not a separately loaded libgomp).
    control = _C.omp_thread_control()
    threads = control.get_threads()
    try:
        control.set_threads(1 if threads > 1 else 2)
        np.testing.assert_array_equal(linear(x, w, [int(qtype), n], path), batch)
    finally:
        control.set_threads(threads)


@pytest.mark.skipif("amx-int8" not in PATHS, reason="this CPU has no AMX-INT8")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_amx_tiles_give_the_vnni_paths_bits(qtype):
    """amx-int8 multiplies 16-row tiles on AMX (a part-filled last one padded with zero rows) and the
    other rows on VNNI registers: every row is the VNNI path's bit for bit, so a row never depends on
    which unit computed it."""
    n = 45  # two full column tiles and a part-filled one
    w = random_blocks(qtype, n, K)
    bias = rng.standard_normal(n).astype(np.float32)
    # VNNI alone (1, 12); one padded tile (13, 15); whole tiles, the tail on VNNI (24, 65, 97) or padded (29, 63)
    for m in (1, 12, 13, 15, 16, 24, 29, 63, 64, 65, 80, 97):
        x = rng.standard_normal((m, K)).astype(np.float32)
        got = linear(x, w, [int(qtype), n], "amx-int8", bias)
        assert got.shape == (m, n)
        np.testing.assert_array_equal(got, linear(x, w, [int(qtype), n], "avx512-vnni", bias), err_msg=f"M={m}")


@pytest.mark.skipif("avx2" not in PATHS, reason="this CPU has no AVX2")
@pytest.mark.parametrize("blocks", [1, 9, 18, 48])
def test_the_avx2_path_gives_the_scalar_paths_bits(blocks):
    """The AVX2 path quantizes 8 activation blocks at a time and sums int16 pairs before widening;
    both are exact, so every output is the scalar path's bit for bit: 1 block, a part-filled group of
    8, the default model's K of 576 and 1536, an all-zero block and values at rounding ties."""
    k = 32 * blocks
    x = (rng.standard_normal((6, k)) * np.array([[1e-3], [1.0], [40.0], [1.0], [7.0], [1.0]])).astype(np.float32)
    x[3, -32:] = 0.0
    # A block whose scale is 1 with halves in it: x / dx lands on ties (nearest even)
    x[5, :32] = np.arange(-16, 16, dtype=np.float32) + np.float32(0.5)
    x[5, 0] = np.float32(127.0)
    for qtype in [t for t in TYPES if k % GGML_QUANT_SIZES[t][0] == 0]:
        w = random_blocks(qtype, N, k)
        got = linear(x, w, [int(qtype), N], "avx2")
        np.testing.assert_array_equal(got, linear(x, w, [int(qtype), N], "scalar"), err_msg=qtype.name)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embedding_rows_are_the_dequantized_rows(qtype):
    """Rows looked up in the packed table are gguf-py's dequantization bit for bit (the layout loses nothing)."""
    w = random_blocks(qtype, N, K)
    ids = np.array([[3, 0], [36, 3]], dtype=np.int64)
    got = ops.gguf_embedding(paddle.to_tensor(ids), pack(w, [int(qtype), N]), int(qtype), N, K).numpy()
    assert got.shape == (2, 2, K)
    np.testing.assert_array_equal(got, dequantize(w, qtype)[ids])


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0],
                         ids=lambda t: t.name)
def test_the_4_and_8_bit_formats_pack_into_their_own_bytes(qtype):
    w = random_blocks(qtype, 48, K)
    assert pack(w, [int(qtype), 48]).shape == [w.size]
    assert pack(w[:37], [int(qtype), 37]).shape == [w.size]  # a part-filled tile is padded to 16 columns


def test_bad_input_is_refused():
    raw = random_blocks(GGMLQuantizationType.Q8_0, 4, 64)
    w = pack(raw, [8, 4], 64)  # one tile: 16 columns x 2 sub-blocks x 544 bytes
    x = paddle.ones([1, 64])
    with pytest.raises(OSError, match="ggml type 1 has no kernel"):  # F16
        ops.gguf_linear(x, w, None, [1, 4], 0)
    with pytest.raises(OSError, match="not a multiple of its block"):
        ops.gguf_linear(paddle.ones([1, 48]), w, None, [8, 4], 0)
    with pytest.raises(OSError, match="the weight has 1088 bytes, its segments 2176"):
        ops.gguf_linear(x, w, None, [8, 17], 0)
    with pytest.raises(OSError, match="fd_gguf_pack: the weight has 272 bytes, its segments 340"):
        ops.gguf_pack(paddle.to_tensor(raw.reshape(-1)), [8, 5], 64)
    with pytest.raises(OSError, match="token id 4 is outside the table"):
        ops.gguf_embedding(paddle.to_tensor(np.array([4], np.int64)), w, 8, 4, 64)
    with pytest.raises(OSError, match="not a packed table of 40 rows"):
        ops.gguf_embedding(paddle.to_tensor(np.array([4], np.int64)), w, 8, 40, 64)
    assert ops.gguf_linear(paddle.zeros([0, 64]), w, None, [8, 4], 0).shape == [0, 4]
