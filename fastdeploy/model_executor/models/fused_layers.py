"""Runs of consecutive Llama-style decoder layers executed by one ``fd_decoder_layers`` call.

Paddle charges ~8 us per custom-op call plus ~0.4 us per argument, so one call per layer cost
~15 us x 30 layers of a ~5 ms GGUF decode step at batch 1; a run of layers with the same shapes
and settings goes through the dispatcher once. Layers the kernel cannot run (an MoE block,
tensor parallelism, weights it does not take) split the model into several runs and run op by
op between them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import paddle

from fastdeploy import _custom_ops as ops

if TYPE_CHECKING:
    from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata
    from fastdeploy.model_executor.layers.linear import KernelWeight


class FusedLayerArgs(NamedTuple):
    """One decoder layer's weights and settings as ``fd_decoder_layers`` takes them."""

    input_norm: paddle.Tensor
    qkv: KernelWeight
    qk_norm: paddle.Tensor | None
    cos_sin: paddle.Tensor
    o: KernelWeight
    post_norm: paddle.Tensor
    gate_up: KernelWeight
    down: KernelWeight
    # (num_heads, intermediate_size, eps, qk_eps, is_neox, scale, dtype): the op's attributes before
    # the segments; gguf_isa and attn_isa after them.
    settings: tuple
    gguf_isa: int
    attn_isa: int

    def signature(self) -> tuple:
        """What the layers of one run share: settings, kernel paths, rope table, which optional weights exist."""
        optional = (self.qkv.bias, self.qk_norm, self.o.bias, self.gate_up.bias, self.down.bias)
        return (self.settings, self.gguf_isa, self.attn_isa, id(self.cos_sin), tuple(w is None for w in optional))


class FusedLayerRun:
    """Layers ``[start, stop)`` of a model in one op call; called with those layers' KV caches."""

    def __init__(self, start: int, layers: list[FusedLayerArgs]) -> None:
        if not layers or len({a.signature() for a in layers}) != 1:
            raise ValueError("layers: a run needs one or more layers of the same signature")
        self.start, self.stop = start, start + len(layers)
        first = layers[0]

        def each(get) -> list[paddle.Tensor] | None:
            return None if get(first) is None else [get(a) for a in layers]

        segments = [v for a in layers for w in (a.qkv, a.o, a.gate_up, a.down) for v in (len(w.segments), *w.segments)]
        self._before = (each(lambda a: a.input_norm), each(lambda a: a.qkv.weight), each(lambda a: a.qkv.bias),
                        each(lambda a: a.qk_norm), first.cos_sin)
        self._after = (each(lambda a: a.o.weight), each(lambda a: a.o.bias), each(lambda a: a.post_norm),
                       each(lambda a: a.gate_up.weight), each(lambda a: a.gate_up.bias),
                       each(lambda a: a.down.weight), each(lambda a: a.down.bias), *first.settings, segments,
                       first.gguf_isa, first.attn_isa)

    def __call__(self, hidden: paddle.Tensor, residual: paddle.Tensor | None, positions: paddle.Tensor,
                 kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]], md: AttentionMetadata
                 ) -> tuple[paddle.Tensor, paddle.Tensor]:
        if residual is None:  # a zero residual makes the first layer's add exact
            residual = paddle.zeros_like(hidden)
        return ops.decoder_layers(
            hidden, residual, *self._before, positions, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches],
            md.slot_mapping, md.block_tables, md.query_start_loc, md.seq_lens, *self._after,
        )  # fmt: skip


def plan_runs(layers: list[FusedLayerArgs | None], max_layers: int | None = None
              ) -> list[tuple[int, int, FusedLayerRun | None]]:
    """Split the layers into ``(start, stop, run)``: maximal runs of one signature (of at most ``max_layers``
    layers when given: benchmarks measure the dispatch with one layer per call), and ``None`` for each
    layer that runs op by op."""
    plan: list[tuple[int, int, FusedLayerRun | None]] = []
    i = 0
    while i < len(layers):
        if layers[i] is None:
            plan.append((i, i + 1, None))
            i += 1
            continue
        j = i + 1
        while (j < len(layers) and layers[j] is not None and layers[j].signature() == layers[i].signature()
               and (max_layers is None or j - i < max_layers)):
            j += 1
        plan.append((i, j, FusedLayerRun(i, layers[i:j])))
        i = j
    return plan
