"""FusedMoE with quantized experts: wint8 / wint4 (fd_int_fused_moe) and GGUF blocks (fd_gguf_fused_moe).

Each is checked against a reference on its own dequantized weights (fp32, per token), for token
counts that leave experts without tokens and give one expert many; a batch against each token
alone bit for bit; and a format that has no MoE method is refused by name.
"""

import numpy as np
import paddle
import pytest

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.fused_moe import FusedMoE
from fastdeploy.model_executor.layers.quantization.gguf import KERNEL_PATHS as GGUF_KERNEL_PATHS
from fastdeploy.model_executor.layers.quantization.gguf import GGUFConfig, GGUFFusedMoEMethod, random_blocks
from fastdeploy.model_executor.layers.quantization.int_kernels import KERNEL_PATHS as INT_KERNEL_PATHS
from fastdeploy.model_executor.layers.quantization.int_kernels import quantize_int4, quantize_int8
from fastdeploy.transformers_utils.gguf_utils import GGUFBlocks

# K-quant rows are 256 elements: H and I whole superblocks.
E, K, H, INTER = 8, 2, 256, 256
rng = np.random.default_rng(0)

def _runnable(paths, best):
    """The kernel paths up to the platform's choice ``best`` (the CPU runs those below it too)."""
    return {name: isa for name, isa in paths.items() if isa <= paths.get(best, -1)}


INT_PATHS = _runnable(INT_KERNEL_PATHS, "avx512" if get_op_backend().int_gemm == "onednn" else get_op_backend().int_gemm)
GGUF_PATHS = _runnable(GGUF_KERNEL_PATHS, get_op_backend().gguf)

pytestmark = pytest.mark.skipif(
    get_op_backend().int_gemm == "paddle" or get_op_backend().gguf == "paddle", reason="the C++ kernels are not built"
)


def _silu(x):
    return x / (1 + np.exp(-x))


def _reference(x, ids, weights, w13, w2):
    """Each token on its own, in float64: the weighted sum of its experts' SwiGLU outputs."""
    out = np.zeros(x.shape, dtype=np.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            h = w13[ids[t, k]].astype(np.float64) @ x[t]
            out[t] += weights[t, k] * (w2[ids[t, k]].astype(np.float64) @ (_silu(h[:INTER]) * h[INTER:]))
    return out


def _routings():
    """(name, ids [T, K], weights [T, K]): experts with no token, one expert shared by every token, larger batches.

    With two threads, "few", "spread" and "decode32" run each expert on one thread (moe_impl.h's expert tasks:
    <= 32 tokens, >= 2 experts per thread), "spread" with the shared experts of the tests below among the tasks
    and "decode32" with them split over the threads before; "one" (too few experts), "crowd" and "many" split
    every GEMM over the threads."""
    few = np.array([[1, 4], [4, 1], [1, 4], [6, 4], [3, 6]])  # experts 0, 2, 5, 7 get none
    spread = np.stack([np.arange(8), (np.arange(8) + 3) % E], axis=1)  # every expert, two tokens each
    crowd = np.stack([np.full(40, 5), rng.integers(0, E, 40)], axis=1)  # expert 5 in every token
    crowd[crowd[:, 1] == 5, 1] = 2
    many = np.stack([rng.permutation(E)[:K] for _ in range(96)])
    decode32 = np.stack([rng.permutation(E)[:K] for _ in range(32)])
    out = []
    for name, ids in (("one", few[:1]), ("few", few), ("spread", spread), ("decode32", decode32), ("crowd", crowd),
                      ("many", many)):
        w = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
        out.append((name, ids.astype(np.int64), w / w.sum(1, keepdims=True)))
    return out


ROUTINGS = _routings()


def _forward(layer, x, ids, weights):
    return layer.quant_method.apply(layer, paddle.to_tensor(x), paddle.to_tensor(weights), paddle.to_tensor(ids)).numpy()


def _check_batch_invariant(layer, x, ids, weights):
    batched = _forward(layer, x, ids, weights)
    alone = np.concatenate([_forward(layer, x[t : t + 1], ids[t : t + 1], weights[t : t + 1]) for t in range(len(x))])
    np.testing.assert_array_equal(batched, alone)
    return batched


def _int_layer(name, isa):
    from fastdeploy.model_executor.layers.quantization import get_quantization_config
    from fastdeploy.model_executor.layers.quantization.weight_only import IntFusedMoEMethod

    layer = FusedMoE(E, K, H, INTER, quant_config=get_quantization_config(name)(), prefix="model.layers.0.mlp.experts")
    assert isinstance(layer.quant_method, IntFusedMoEMethod)
    layer.quant_method.isa = isa  # every kernel path this CPU runs, not only the platform's choice
    w13 = (rng.standard_normal((E, 2 * INTER, H)) * 0.05).astype(np.float32)
    w2 = (rng.standard_normal((E, H, INTER)) * 0.05).astype(np.float32)
    for e in range(E):
        layer.weight_loader(layer.w13_weight, w13[e, :INTER], (e, "w1"))
        layer.weight_loader(layer.w13_weight, w13[e, INTER:], (e, "w3"))
        layer.weight_loader(layer.w2_weight, w2[e], (e, "w2"))
    assert layer.process_weights_after_loading("float32")
    assert layer.w13_weight is None and layer.w2_weight is None  # only the integers stay
    return layer, w13, w2


@pytest.mark.parametrize("isa", list(INT_PATHS.values()), ids=list(INT_PATHS))
@pytest.mark.parametrize("name", ["wint8", "wint4"])
def test_int_experts_match_their_dequantized_weights(name, isa):
    layer, w13, w2 = _int_layer(name, isa)
    dense13, dense2 = (t.numpy() for t in layer.dense_weights())

    # The experts hold exactly what the linear layers' quantization gives each expert's [in, out] weight.
    def quantized(w):
        return (quantize_int8(w.T) if name == "wint8" else quantize_int4(w.T, 128)).dequantize().T

    for e in (0, E - 1):
        np.testing.assert_allclose(dense13[e], quantized(w13[e]), rtol=0, atol=1e-7)
        np.testing.assert_allclose(dense2[e], quantized(w2[e]), rtol=0, atol=1e-7)
    assert np.abs(dense13 - w13).max() > 0  # quantized, not the fp32 weights
    for _, ids, weights in ROUTINGS:
        x = rng.standard_normal((len(ids), H)).astype(np.float32)
        got = _check_batch_invariant(layer, x, ids, weights)
        np.testing.assert_allclose(got, _reference(x, ids, weights, dense13, dense2), rtol=1e-4, atol=2e-5)


def _blocks(ggml_type, rows, k, name):
    return GGUFBlocks(name, ggml_type, (rows, k), random_blocks(ggml_type, rows, k, rng))


# (gate, up, down) ggml types: Q4_K_M files mix Q4_K with a Q6_K down projection.
GGUF_TYPES = {"Q8_0": (8, 8, 8), "Q4_0": (2, 2, 2), "Q4_K": (12, 12, 12), "Q4_K+Q6_K": (12, 12, 14)}


def _gguf_layer(types, isa):
    layer = FusedMoE(E, K, H, INTER, quant_config=GGUFConfig(), prefix="model.layers.0.mlp.experts")
    assert isinstance(layer.quant_method, GGUFFusedMoEMethod)
    layer.quant_method.isa = isa
    shards = {}
    for e in range(E):
        for shard, ggml_type, shape in zip(("w1", "w3", "w2"), types, ((INTER, H), (INTER, H), (H, INTER)),
                                           strict=True):
            shards[(e, shard)] = _blocks(ggml_type, *shape, f"blk.0.ffn_{shard}_exps.weight")
            layer.weight_loader(layer.w2_weight if shard == "w2" else layer.w13_weight, shards[(e, shard)], (e, shard))
    assert layer.process_weights_after_loading("float32")
    return layer, shards


def _gguf_dequantize(blocks):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(blocks.data, GGMLQuantizationType(blocks.ggml_type)), np.float32)


@pytest.mark.parametrize("isa", list(GGUF_PATHS.values()), ids=list(GGUF_PATHS))
@pytest.mark.parametrize("types", list(GGUF_TYPES.values()), ids=list(GGUF_TYPES))
def test_gguf_experts_match_the_block_kernel_and_their_dequantized_weights(types, isa):
    layer, shards = _gguf_layer(types, isa)
    dense13, dense2 = (t.numpy() for t in layer.dense_weights())
    # The packed experts hold the file's blocks: gguf-py's own dequantization of each shard.
    for e in (0, E - 1):
        np.testing.assert_array_equal(dense13[e, :INTER], _gguf_dequantize(shards[(e, "w1")]))
        np.testing.assert_array_equal(dense13[e, INTER:], _gguf_dequantize(shards[(e, "w3")]))
        np.testing.assert_array_equal(dense2[e], _gguf_dequantize(shards[(e, "w2")]))
    isa = layer.quant_method.isa
    for _, ids, weights in ROUTINGS:
        x = rng.standard_normal((len(ids), H)).astype(np.float32)
        got = _check_batch_invariant(layer, x, ids, weights)
        # Tight: each token through the same block kernel, expert by expert (fd_gguf_linear).
        want = np.zeros_like(got)
        for t in range(len(x)):
            for k in range(K):
                e = int(ids[t, k])
                gate_up = np.concatenate([shards[(e, "w1")].data, shards[(e, "w3")].data]).reshape(-1)
                w13 = ops.gguf_pack(paddle.to_tensor(gate_up), [types[0], INTER, types[1], INTER], H)
                w2 = ops.gguf_pack(paddle.to_tensor(shards[(e, "w2")].data.reshape(-1)), [types[2], H], INTER)
                h = ops.gguf_linear(paddle.to_tensor(x[t : t + 1]), w13, None, [types[0], INTER, types[1], INTER], isa)
                y = ops.gguf_linear(ops.silu_and_mul(h), w2, None, [types[2], H], isa)
                want[t] += weights[t, k] * y.numpy()[0]
        # (fp32 rounding of the weighted sum apart: the kernel may fuse its multiply-adds)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
        # Loose: against fp32 on the dequantized weights, the kernels' int8 activations being the difference.
        ref = _reference(x, ids, weights, dense13, dense2)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.03


@pytest.mark.parametrize("name", ["w8a8", "fp8", "awq", "gptq"])
def test_formats_without_an_moe_method_are_refused_by_name(name):
    from fastdeploy.model_executor.layers.quantization import get_quantization_config

    config = get_quantization_config(name)()
    with pytest.raises(ValueError, match=rf"quantization='{name}' has no method for the MoE experts "
                                         r"'model.layers.3.mlp.experts' \(FusedMoE\); MoE experts are quantized by: "
                                         r"gguf, wint4, wint8"):
        FusedMoE(E, K, H, INTER, quant_config=config, prefix="model.layers.3.mlp.experts")


SHARED_INTER = 512  # not the routed experts' I (K-quant rows are whole 256-value superblocks)


def _shared_experts(fmt, isa):
    """(SharedExperts in ``fmt``'s buffers, its SwiGLU as separate ops: x -> [T, H])."""
    from fastdeploy.model_executor.layers.quantization.int_kernels import linear_buffer, pack_int4

    if fmt == "wint4":
        bufs = [paddle.to_tensor(linear_buffer(pack_int4(quantize_int4(
            (rng.standard_normal(shape) * 0.05).astype(np.float32), 128)))) for shape in ((H, 2 * SHARED_INTER),
                                                                                       (SHARED_INTER, H))]
        segments = ([4, 128, isa], [4, 128, isa])
        shared = ops.SharedExperts(*bufs, SHARED_INTER, "int", *segments)

        def apart(x):
            h = ops.int_linear(x, bufs[0], None, 2 * SHARED_INTER, 4, 128, isa)
            return ops.int_linear(ops.silu_and_mul(h), bufs[1], None, H, 4, 128, isa)

        return shared, apart
    blocks = [random_blocks(12, 2 * SHARED_INTER, H, rng), random_blocks(14, H, SHARED_INTER, rng)]
    segments = ([12, 2 * SHARED_INTER], [14, H])
    bufs = [ops.gguf_pack(paddle.to_tensor(b.reshape(-1)), seg, k)
            for b, seg, k in zip(blocks, segments, (H, SHARED_INTER), strict=True)]
    shared = ops.SharedExperts(*bufs, SHARED_INTER, "gguf", *segments, isa)

    def apart(x):
        h = ops.gguf_linear(x, bufs[0], None, segments[0], isa)
        return ops.gguf_linear(ops.silu_and_mul(h), bufs[1], None, segments[1], isa)

    return shared, apart


@pytest.mark.parametrize("fmt", ["wint4", "gguf"])
def test_shared_experts_inside_the_op_add_what_their_own_ops_give(fmt):
    """The op's shared experts (among the expert tasks, or split over the threads before them: see _routings)
    add exactly what their own ops give, times a per-token gate where one is given; rows stay independent of
    the batch and of the thread count."""
    from fastdeploy._C import omp_thread_control

    if fmt == "wint4":
        isa = INT_PATHS[max(INT_PATHS, key=INT_PATHS.get)]
        layer, _, _ = _int_layer("wint4", isa)
    else:
        isa = GGUF_PATHS[max(GGUF_PATHS, key=GGUF_PATHS.get)]
        layer, _ = _gguf_layer(GGUF_TYPES["Q4_K"], isa)
    shared, apart = _shared_experts(fmt, isa)
    control = omp_thread_control()
    threads = control.get_threads()

    def forward(x, ids, weights, gate=None):
        return layer.quant_method.apply(layer, paddle.to_tensor(x), paddle.to_tensor(weights), paddle.to_tensor(ids),
                                        shared, None if gate is None else paddle.to_tensor(gate)).numpy()

    for _, ids, weights in ROUTINGS:
        x = rng.standard_normal((len(ids), H)).astype(np.float32)
        routed, alone = _forward(layer, x, ids, weights), apart(paddle.to_tensor(x)).numpy()
        assert np.abs(alone).max() > 0
        got = forward(x, ids, weights)
        np.testing.assert_array_equal(got, routed + alone)
        gate = rng.uniform(0.0, 1.0, len(ids)).astype(np.float32)
        gated = forward(x, ids, weights, gate)
        np.testing.assert_allclose(gated, routed + gate[:, None] * alone, rtol=1e-6, atol=1e-6 * np.abs(got).max())
        np.testing.assert_array_equal(forward(x[-1:], ids[-1:], weights[-1:], gate[-1:])[0], gated[-1])
        try:
            control.set_threads(1 if threads > 1 else 2)
            np.testing.assert_array_equal(forward(x, ids, weights, gate), gated)
        finally:
            control.set_threads(threads)


def test_shared_experts_of_a_format_the_op_does_not_run_are_refused():
    layer, _, _ = _int_layer("wint4", INT_PATHS[max(INT_PATHS, key=INT_PATHS.get)])
    shared, _ = _shared_experts("wint4", 0)
    x, ids, weights = (paddle.to_tensor(a) for a in (np.zeros((2, H), np.float32), ROUTINGS[1][1][:2],
                                                       ROUTINGS[1][2][:2]))
    for dtype in ("bfloat16", "fp8"):
        with pytest.raises(Exception, match=f"shared experts in '{dtype}' are not run by this op"):
            layer.quant_method.apply(layer, x, weights, ids, shared._replace(dtype=dtype))
    with pytest.raises(Exception, match=r"shared_w13 / shared_w2 are not \[H, 2S\] / \[S, H\]"):
        layer.quant_method.apply(layer, x, weights, ids, shared._replace(inter=SHARED_INTER // 2))
    with pytest.raises(Exception, match="shared_weights needs one weight per token"):
        layer.quant_method.apply(layer, x, weights, ids, shared, paddle.ones([3]))
    with pytest.raises(ValueError, match="no shared experts were given"):
        layer.quant_method.apply(layer, x, weights, ids, None, paddle.ones([2]))


def test_an_error_inside_the_expert_tasks_is_raised_and_the_op_runs_on():
    """At <= 32 tokens on two threads each expert runs on one thread of a parallel region; an error there
    (a kernel path no CPU has) comes back as the op's error instead of ending the process."""
    from fastdeploy._C import omp_thread_control

    layer, _, _ = _int_layer("wint4", INT_PATHS[max(INT_PATHS, key=INT_PATHS.get)])
    _, ids, weights = ROUTINGS[1]
    x = rng.standard_normal((len(ids), H)).astype(np.float32)
    inputs = [paddle.to_tensor(a) for a in (x, ids, weights)]
    control = omp_thread_control()
    threads = control.get_threads()
    try:
        control.set_threads(2)
        with pytest.raises(Exception, match="cannot run kernel path 99"):
            ops.int_fused_moe(*inputs, *layer._int_moe_args[:-1], 99)
        want = _forward(layer, x, ids, weights)
    finally:
        control.set_threads(threads)
    np.testing.assert_array_equal(_forward(layer, x, ids, weights), want)
