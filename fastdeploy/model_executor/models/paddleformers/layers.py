"""Swap PaddleFormers' generic layers for FastDeploy's, fusing projections on the way.

What is swapped (only exact classes, so that architecture-specific subclasses such as
Gemma 3's ``1 + weight`` RMSNorm or its scaled embedding keep their own math):

- ``paddle.nn.Linear`` -> our Column/RowParallelLinear (weights ``[in, out]``, loaded
  from the checkpoint's ``[out, in]``); a projection PaddleFormers already fuses keeps its
  layout: ``fused_qkv`` -> :class:`GroupedQKVLinear`, ``fused_ffn`` ->
  MergedColumnParallelLinear;
- projections PaddleFormers keeps apart (Llama's): its generic MLP is switched to its own
  fused ``up_gate_proj`` path; ``q_proj``/``k_proj``/``v_proj`` (and gate/up of other MLP
  classes) become one fused matmul whose parts the members hand out (:class:`SharedProjection`);
- ``paddleformers.nn.norm.RMSNorm`` -> our RMSNorm (its CPU path works; PaddleFormers'
  default ``fused_rms_norm_ext`` has no CPU kernel);
- ``paddle.nn.Embedding`` -> our VocabParallelEmbedding (no ``padding_idx``, which
  PaddleFormers sets to ``pad_token_id`` and which zeroes that token's embedding).
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from fastdeploy.logger import init_logger
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from fastdeploy.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from fastdeploy.model_executor.models.paddleformers.weights import QKV_SHARDS, WeightMapping
from fastdeploy.model_executor.utils import load_into_slice

logger = init_logger(__name__)

# Sibling projections that read the same input, fused into one matmul: (members, fused name).
SIBLING_GROUPS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (("gate_proj", "up_proj"), "gate_up_proj"),
)
# Projections whose input dimension is the sharded one under tensor parallelism.
_ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "dense")


class GroupedQKVLinear(ColumnParallelLinear):
    """QKV projection in PaddleFormers' ``fused_qkv`` order: per KV head, its query heads, then K, then V.

    Loads the checkpoint's separate q/k/v tensors (shards "q", "k", "v") into that order
    once, so PaddleFormers' forward can keep splitting its fused output per KV head.
    """

    def __init__(
        self, input_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, dtype: str
    ) -> None:
        super().__init__(input_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    shard_ids = QKV_SHARDS

    def weight_loader(self, param: paddle.Tensor, loaded: np.ndarray, shard_id: object = None) -> None:
        """Place HF ``q_proj``/``k_proj``/``v_proj`` (weight ``[out, in]`` or bias ``[out]``) group by group."""
        if shard_id is None:  # already in PaddleFormers' fused order
            super().weight_loader(param, loaded)
            return
        if shard_id not in QKV_SHARDS:
            raise ValueError(f"GroupedQKVLinear shard must be one of {QKV_SHARDS}, got {shard_id!r}.")
        d, kvh = self.head_dim, self.num_kv_heads
        group = self.num_heads // kvh
        heads_here = group if shard_id == "q" else 1  # heads of this shard inside one KV group
        offset = {"q": 0, "k": group, "v": group + 1}[shard_id] * d
        rows = heads_here * d
        is_weight = param is self.weight
        for j in range(kvh):
            part = loaded[j * rows : (j + 1) * rows]
            start = j * (group + 2) * d + offset
            if is_weight:
                load_into_slice(param, part.T, start, rows, axis=1, name=f"qkv_proj[{shard_id}][{j}]")
            else:
                load_into_slice(param, part, start, rows, axis=0, name=f"qkv_proj.bias[{shard_id}][{j}]")


class SharedProjection:
    """One fused matmul serving sibling projection calls on the same input.

    PaddleFormers' Llama calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` in turn. Each
    member (a :class:`ProjectionSlice`) asks for its part: the first call computes
    ``x @ [Wq | Wk | Wv]`` once and keeps the parts for the others. The input is compared
    by identity and held while parts are pending, so its id cannot be reused meanwhile;
    a member called with another input simply triggers a new fused matmul. Once every
    part was handed out the references are dropped, so no activations outlive the layer.
    """

    def __init__(self, linear: MergedColumnParallelLinear) -> None:
        self.linear = linear
        self._input: paddle.Tensor | None = None
        self._parts: list[paddle.Tensor | None] = []

    def part(self, x: paddle.Tensor, index: int) -> paddle.Tensor:
        if x is not self._input or self._parts[index] is None:
            out = self.linear(x)
            self._parts = list(paddle.split(out, self.linear.output_sizes, axis=-1))
            self._input = x
        part, self._parts[index] = self._parts[index], None
        if all(p is None for p in self._parts):
            self._input, self._parts = None, []
        return part


class ProjectionSlice(nn.Layer):
    """Stands where one of the fused sibling projections was; has no parameters of its own."""

    def __init__(self, shared: SharedProjection, index: int, name: str) -> None:
        super().__init__()
        self._shared = shared  # plain object: the fused linear is registered once, on the parent
        self.index, self.member = index, name

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self._shared.part(x, self.index)

    def extra_repr(self) -> str:
        return f"{self.member}: part {self.index} of the fused projection"


def _linear_shape(layer: nn.Linear) -> tuple[int, int, bool]:
    in_features, out_features = layer.weight.shape  # Paddle's nn.Linear stores [in, out]
    return int(in_features), int(out_features), layer.bias is not None


class LayerSwapper:
    """Replaces PaddleFormers layers in place; remembers where fused-away parameters went.

    Args:
        mapping: the model class's weight mapping (gives the fused layouts).
        dtype: parameter dtype of the new layers.
        fuse: fuse sibling projections (Q/K/V, gate/up) that PaddleFormers keeps apart.
    """

    def __init__(self, mapping: WeightMapping, dtype: str, fuse: bool = True) -> None:
        self.mapping = mapping
        self.dtype = dtype
        self.fuse = fuse
        # PaddleFormers parameter name -> (our parameter name, shard id) for fused-away members.
        self.redirects: dict[str, tuple[str, object]] = {}
        self.fused: list[str] = []  # names of fused projections (PaddleFormers' own or ours)
        self.counts: dict[str, int] = {}

    def _count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def swap(self, root: nn.Layer, prefix: str) -> None:
        """Swap every eligible layer under ``root``, whose parameters are named ``prefix.*``."""
        parents = [(prefix, root)] + [(f"{prefix}.{n}", m) for n, m in root.named_sublayers()]
        for name, parent in parents:
            if self.fuse:
                self._fuse_mlp(name, parent)
                for members, fused_name in SIBLING_GROUPS:
                    self._fuse_siblings(name, parent, members, fused_name)
            for child_name, child in list(parent.named_children()):
                new = self._replacement(f"{name}.{child_name}", child_name, child)
                if new is not None:
                    setattr(parent, child_name, new)

    def _fuse_mlp(self, name: str, parent: nn.Layer) -> None:
        """Switch PaddleFormers' generic MLP, when built unfused (Llama), to its own fused gate/up path.

        ``paddleformers.nn.mlp.MLP`` supports ``fuse_up_gate`` itself: one ``[gate | up]``
        matmul, then one swiglu. Used here instead of :class:`SharedProjection`, it also
        saves the split and re-concatenation of gate and up.
        """
        from paddleformers.nn.mlp import MLP as PFMLP

        if type(parent) is not PFMLP or parent.fuse_up_gate:
            return
        gate, up = getattr(parent, "gate_proj", None), getattr(parent, "up_proj", None)
        if type(gate) is not nn.Linear or type(up) is not nn.Linear or _linear_shape(gate) != _linear_shape(up):
            return
        hidden, inter, bias = _linear_shape(gate)
        # The MLP may register each projection under two names (its custom one and the generic one).
        members = {child_name: 0 if child is gate else 1 for child_name, child in parent.named_children()
                   if child is gate or child is up}  # fmt: skip
        for child_name in members:
            delattr(parent, child_name)
        fused_name = parent.gate_up_proj_name
        setattr(parent, fused_name, MergedColumnParallelLinear(hidden, [inter, inter], bias=bias, dtype=self.dtype))
        parent.fuse_up_gate = True
        for child_name, index in members.items():
            for suffix in ("weight", "bias"):
                self.redirects[f"{name}.{child_name}.{suffix}"] = (f"{name}.{fused_name}.{suffix}", index)
        self.fused.append(f"{name}.{fused_name}")
        self._count("mlp_gate_up")

    def _fuse_siblings(self, name: str, parent: nn.Layer, members: tuple[str, ...], fused_name: str) -> None:
        children = [getattr(parent, m, None) for m in members]
        if not all(type(c) is nn.Linear for c in children) or hasattr(parent, fused_name):
            return
        shapes = [_linear_shape(c) for c in children]
        if len({(s[0], s[2]) for s in shapes}) != 1:  # same input size and bias use, or no fusion
            return
        linear = MergedColumnParallelLinear(shapes[0][0], [s[1] for s in shapes], bias=shapes[0][2], dtype=self.dtype)
        setattr(parent, fused_name, linear)
        shared = SharedProjection(linear)
        for index, member in enumerate(members):
            setattr(parent, member, ProjectionSlice(shared, index, member))
            for suffix in ("weight", "bias"):
                self.redirects[f"{name}.{member}.{suffix}"] = (f"{name}.{fused_name}.{suffix}", index)
        self.fused.append(f"{name}.{fused_name}")
        self._count(fused_name)

    def _replacement(self, full_name: str, short_name: str, child: nn.Layer) -> nn.Layer | None:
        from paddleformers.nn.norm import RMSNorm as PFRMSNorm

        kind = type(child)
        if kind is nn.Linear:
            self._count("linear")
            return self._linear(full_name, short_name, child)
        if kind is PFRMSNorm:
            self._count("rms_norm")
            return RMSNorm(int(child.weight.shape[0]), float(child.variance_epsilon), self.dtype)
        if kind is nn.Embedding:
            self._count("embedding")
            num, dim = child.weight.shape
            return VocabParallelEmbedding(int(num), int(dim), self.dtype)
        return None

    def _linear(self, full_name: str, short_name: str, child: nn.Linear) -> LinearBase:
        in_features, out_features, bias = _linear_shape(child)
        layout = self.mapping.layout(full_name)
        if layout is not None and layout.kind == "fused_qkv":
            heads, kv_heads = layout.num_heads, layout.num_kv_heads
            head_dim = out_features // (heads + 2 * kv_heads)
            self.fused.append(full_name)
            return GroupedQKVLinear(in_features, heads, kv_heads, head_dim, bias, self.dtype)
        if layout is not None and layout.kind == "fused_ffn":
            self.fused.append(full_name)
            return MergedColumnParallelLinear(in_features, [out_features // 2] * 2, bias=bias, dtype=self.dtype)
        if layout is not None:  # fused_qkv_old: the checkpoint's own [q | k | v] order, loaded whole
            self.fused.append(full_name)
        cls = RowParallelLinear if short_name in _ROW_PARALLEL else ColumnParallelLinear
        return cls(in_features, out_features, bias=bias, dtype=self.dtype)
