"""The mixture-of-experts layer (vLLM's ``FusedMoE``) and its method interface.

:class:`FusedMoE` holds every expert's SwiGLU MLP as two stacked parameters in Hugging
Face's per-expert ``[out, in]`` layout: ``w13_weight [E, 2I, H]`` (gate rows, then up rows)
and ``w2_weight [E, H, I]`` (down). Its forward takes the hidden states and the router's
logits, picks each token's experts (:func:`~.router.select_experts`) and runs the experts
through its method, a :class:`FusedMoEMethodBase` handed out by the quantization config
like a linear layer's: ``wint8`` / ``wint4`` (``IntFusedMoEMethod``, quantization/weight_only.py)
and ``gguf`` (``GGUFFusedMoEMethod``, quantization/gguf.py) bring their own expert kernels
(csrc/cpu/moe_quant.cc, the same grouping code as moe.cc); any other format is refused by
name. Without quantization the method is :class:`UnquantizedFusedMoEMethod`:

- kernel path (the platform's ``fused_moe == "csrc"``): each expert's two matrices are
  packed once by the linear kernel's ``linear_pack`` (bf16 or fp32) and the forward is one
  ``fd_fused_moe`` call (csrc/cpu/moe.cc: group the tokens by expert, one GEMM per active
  expert, weighted sum back, batch-invariant);
- plain-Paddle path: the same grouping with one ``paddle.matmul`` per active expert.

Checkpoints name experts ``...experts.{e}.{gate,up,down}_proj.weight``; the models map
those to ``(w13_weight, (e, "w1"))``, ``(w13_weight, (e, "w3"))`` and ``(w2_weight, (e, "w2"))``
(:func:`expert_params_mapping`), vLLM's shard names. A checkpoint that already stacks
them (``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``, transformers 5's
in-memory layout) loads with shard None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.fused_moe.router import select_experts
from fastdeploy.model_executor.layers.linear import PACKED_DTYPES, ReplicatedLinear
from fastdeploy.model_executor.layers.quantization.base_config import QuantizeMethodBase
from fastdeploy.model_executor.utils import load_into, new_parameter, param_dtype, to_tensor

if TYPE_CHECKING:
    from fastdeploy._custom_ops import SharedExperts
    from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig
    from fastdeploy.platforms.interface import OpBackend

# Checkpoint projection -> our shard name (vLLM's: w1 gate, w3 up, w2 down).
_EXPERT_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def expert_params_mapping(name: str) -> tuple[str, object] | None:
    """A checkpoint name of one expert's projection -> (our parameter name, shard id), else None.

    ``model.layers.3.mlp.experts.7.up_proj.weight`` -> ``("model.layers.3.mlp.experts.w13_weight", (7, "w3"))``;
    the stacked ``...experts.gate_up_proj`` / ``...experts.down_proj`` -> ``(..., None)``.
    """
    parts = name.split(".")
    if "experts" not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index("experts")
    rest, prefix = parts[i + 1 :], ".".join(parts[: i + 1])
    if len(rest) == 3 and rest[0].isdigit() and rest[1] in _EXPERT_SHARDS and rest[2] == "weight":
        shard = _EXPERT_SHARDS[rest[1]]
        return f"{prefix}.{'w2_weight' if shard == 'w2' else 'w13_weight'}", (int(rest[0]), shard)
    if rest in (["gate_up_proj"], ["gate_up_proj", "weight"]):
        return f"{prefix}.w13_weight", None
    if rest in (["down_proj"], ["down_proj", "weight"]):
        return f"{prefix}.w2_weight", None
    return None


def moe_quantization_methods() -> list[str]:
    """The ``--quantization`` names whose configs give MoE experts a method of their own."""
    from fastdeploy.model_executor.layers.quantization import get_quantization_config, get_quantization_methods

    return [name for name in get_quantization_methods() if get_quantization_config(name).supports_moe]


class FusedMoEMethodBase(QuantizeMethodBase):
    """How a :class:`FusedMoE` layer holds its experts and runs them (vLLM's ``FusedMoEMethodBase``)."""

    # The KernelWeight dtypes of the shared experts apply() runs itself (see runs_shared_experts).
    shared_expert_dtypes: tuple[str, ...] = ()

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_size: int,
                       dtype: str) -> None:
        """Register ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]`` (or the format's own) on ``layer``."""
        raise NotImplementedError

    def apply(self, layer: FusedMoE, x: paddle.Tensor, topk_weights: paddle.Tensor,
              topk_ids: paddle.Tensor, shared: SharedExperts | None = None,
              shared_weights: paddle.Tensor | None = None) -> paddle.Tensor:
        """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for every token ``t`` -> ``[T, H]``,
        plus the block's shared experts (times ``shared_weights [T]`` where given) where ``shared`` is set
        (only where :meth:`runs_shared_experts` said yes)."""
        raise NotImplementedError

    def runs_shared_experts(self, dtype: str) -> bool:
        """Whether :meth:`apply` runs shared experts whose weights compute in ``dtype`` (a :class:`KernelWeight`'s)."""
        return dtype in self.shared_expert_dtypes

    def weight_loader(self, layer: FusedMoE, param: paddle.Tensor, loaded: Any, shard_id: object) -> bool:
        """Load a checkpoint tensor the method keeps in its own form; False leaves it to the layer."""
        return False

    def dense_weights(self, layer: FusedMoE) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` fp32, for inspection and export (not the forward)."""
        raise NotImplementedError


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """fp32 expert weights, packed once per expert for ``fd_fused_moe`` in fp32 or bf16, or kept for ``paddle.matmul``.

    Args:
        backend: the platform's kernel choice; packing happens only where its MoE path is the kernel.
    """

    def __init__(self, backend: OpBackend | None = None) -> None:
        self.use_kernel = (backend or get_op_backend()).uses_kernel("fused_moe")

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_size: int,
                       dtype: str) -> None:
        layer.w13_weight = new_parameter([num_experts, 2 * intermediate_size, hidden_size], dtype)
        layer.w2_weight = new_parameter([num_experts, hidden_size, intermediate_size], dtype)

    def process_weights_after_loading(self, layer: FusedMoE, dtype: str) -> bool:
        """Pack every expert once for the kernel in ``dtype``; False where the weights stay for ``paddle.matmul``."""
        if layer._packed_args is not None:
            return True
        if not self.use_kernel or dtype not in PACKED_DTYPES or param_dtype(layer.w13_weight) != "float32":
            return False
        # linear_pack takes [K, N]: the transposes of HF's [out, in] rows.
        w13 = _pack_experts(layer.w13_weight, dtype)
        w2 = _pack_experts(layer.w2_weight, dtype)
        layer.register_buffer("packed_w13", w13, persistable=True)
        layer.register_buffer("packed_w2", w2, persistable=True)
        object.__setattr__(layer, "_packed_args", (w13, w2, layer.intermediate_size, dtype))
        # The packed copies replace the fp32 weights (keeping both would double the experts' memory).
        layer.w13_weight = None
        layer.w2_weight = None
        return True

    def apply(self, layer: FusedMoE, x: paddle.Tensor, topk_weights: paddle.Tensor,
              topk_ids: paddle.Tensor) -> paddle.Tensor:
        args = layer._packed_args
        if args is not None:
            return ops.fused_moe(x, topk_ids, topk_weights, *args)
        return moe_forward_native(x, topk_weights, topk_ids, layer.w13_weight, layer.w2_weight)

    def dense_weights(self, layer: FusedMoE) -> tuple[paddle.Tensor, paddle.Tensor]:
        if layer._packed_args is None:
            return layer.w13_weight, layer.w2_weight
        w13, w2, inter, dtype = layer._packed_args
        hidden = layer.hidden_size
        return _unpack_experts(w13, hidden, 2 * inter, dtype), _unpack_experts(w2, inter, hidden, dtype)


def _pack_experts(weights: paddle.Tensor, dtype: str) -> paddle.Tensor:
    """``[E, out, in]`` fp32 -> ``[E, bytes]``: each expert's ``[in, out]`` transpose packed by ``linear_pack``."""
    return paddle.stack([ops.linear_pack(paddle.transpose(weights[e], [1, 0]), dtype) for e in range(weights.shape[0])])


def _unpack_experts(packed: paddle.Tensor, k: int, n: int, dtype: str) -> paddle.Tensor:
    """The inverse of :func:`_pack_experts`: ``[E, n, k]`` fp32."""
    return paddle.stack([paddle.transpose(ops.linear_unpack(packed[e], k, n, dtype), [1, 0])
                         for e in range(packed.shape[0])])


def moe_forward_native(x: paddle.Tensor, topk_weights: paddle.Tensor, topk_ids: paddle.Tensor,
                       w13: paddle.Tensor, w2: paddle.Tensor) -> paddle.Tensor:
    """The experts on plain Paddle ops, grouped as the kernel groups them.

    The (token, slot) pairs are sorted by expert (stable), each active expert runs one
    gate/up matmul, SwiGLU and one down matmul over its rows, and every token sums its own
    k outputs in slot order.
    """
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape([-1]).numpy()
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.arange(w13.shape[0] + 1))
    rows = paddle.zeros([num_tokens * top_k, x.shape[-1]], dtype=x.dtype)
    for e in np.flatnonzero(np.diff(bounds)):
        pairs = paddle.to_tensor(order[bounds[e] : bounds[e + 1]].astype(np.int64))
        h = paddle.matmul(paddle.gather(x, pairs // top_k), w13[int(e)], transpose_y=True)
        out = paddle.matmul(F.swiglu(h), w2[int(e)], transpose_y=True)
        rows = paddle.scatter(rows, pairs, out)
    weighted = rows.reshape([num_tokens, top_k, -1]) * topk_weights.astype(x.dtype).unsqueeze(-1)
    return weighted.sum(axis=1)


class FusedMoE(nn.Layer):
    """Routed experts: ``forward(hidden_states [T, H], router_logits [T, E]) -> [T, H]``.

    Args:
        num_experts, top_k, hidden_size, intermediate_size: the experts' shapes (``intermediate_size``
            is one expert's, vLLM's ``moe_intermediate_size``).
        renormalize: divide each token's k weights by their sum (``norm_topk_prob``).
        scoring_func, num_expert_group, topk_group, routed_scaling_factor, renormalize_min: routing
            options, see :func:`~.router.select_experts`.
        e_score_correction_bias: a ``[E]`` / ``[1, E]`` parameter the model owns (loaded under its
            checkpoint name), added to the scores for choosing experts only.
        quant_config: the model's quantization config, which gives the experts their method
            (:class:`UnquantizedFusedMoEMethod` without one). A config that has none for MoE experts
            is refused by name (a ValueError listing the formats that quantize experts).
        prefix: the layer's checkpoint name.
    """

    _packed_args: tuple | None = None

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool = True,
        dtype: str = "float32",
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        *,
        scoring_func: str = "softmax",
        e_score_correction_bias: paddle.Tensor | None = None,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        renormalize_min: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"FusedMoE {prefix}: top_k={top_k} must be in [1, num_experts={num_experts}].")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.routing = dict(
            renormalize=renormalize, scoring_func=scoring_func, num_expert_group=num_expert_group,
            topk_group=topk_group, routed_scaling_factor=routed_scaling_factor, renormalize_min=renormalize_min,
        )  # fmt: skip
        self.routing_kernel = get_op_backend().uses_kernel("moe_routing")
        # A plain attribute: the parameter belongs to (and is loaded through) the model's own module.
        object.__setattr__(self, "e_score_correction_bias", e_score_correction_bias)
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        if quant_config is not None and method is None:
            raise ValueError(
                f"quantization={quant_config.get_name()!r} has no method for the MoE experts {prefix!r} "
                f"(FusedMoE); MoE experts are quantized by: {', '.join(moe_quantization_methods())} "
                "(or serve the model unquantized)."
            )
        if method is not None and not isinstance(method, FusedMoEMethodBase):
            raise ValueError(f"{type(quant_config).__name__} gave {type(method).__name__} for the MoE experts "
                             f"{prefix!r}, which is not an MoE method.")
        object.__setattr__(self, "quant_method", method or UnquantizedFusedMoEMethod())
        self.quant_method.create_weights(self, num_experts, hidden_size, intermediate_size, dtype)

    def select_experts(self, router_logits: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``(topk_weights [T, K] float32, topk_ids [T, K] int64)`` of the router's logits."""
        return select_experts(router_logits, self.top_k, e_score_correction_bias=self.e_score_correction_bias,
                              use_kernel=self.routing_kernel, **self.routing)

    def forward(self, hidden_states: paddle.Tensor, router_logits: paddle.Tensor, shared: SharedExperts | None = None,
                shared_weights: paddle.Tensor | None = None) -> paddle.Tensor:
        """The routed experts' output; with ``shared`` (see :meth:`FusedMoEMethodBase.apply`) the shared experts' too."""
        topk_weights, topk_ids = self.select_experts(router_logits)
        # Methods that run no shared experts keep the four-argument apply (a method's own, like a test's).
        if shared is None:
            return self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)
        return self.quant_method.apply(self, hidden_states, topk_weights, topk_ids, shared, shared_weights)

    def process_weights_after_loading(self, dtype: str) -> bool:
        """Convert the loaded experts once for the compute ``dtype``; False where they stay as loaded."""
        return self.quant_method.process_weights_after_loading(self, dtype)

    @property
    def is_packed(self) -> bool:
        return self._packed_args is not None

    def dense_weights(self) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` fp32 (unpacked again when packed)."""
        return self.quant_method.dense_weights(self)

    def expected_shards(self, param_name: str) -> set[object]:
        """Shards that together fill ``param_name`` (for the loader's completeness check)."""
        names = ("w1", "w3") if param_name == "w13_weight" else ("w2",)
        return {(e, n) for e in range(self.num_experts) for n in names}

    def weight_loader(self, param: paddle.Tensor, loaded: Any, shard_id: object = None) -> None:
        """Load one expert's HF projection (shard ``(e, "w1"|"w3"|"w2")``, ``[out, in]``) or a stacked tensor (None)."""
        if self.quant_method.weight_loader(self, param, loaded, shard_id):
            return
        name = "w13_weight" if param is self.w13_weight else "w2_weight"
        if shard_id is None:
            load_into(param, loaded, f"{type(self).__name__}.{name}")
            return
        expert, shard = shard_id
        if not 0 <= expert < self.num_experts or shard not in ("w1", "w3", "w2") or (shard == "w2") != (
            name == "w2_weight"
        ):
            raise ValueError(f"FusedMoE: shard {shard_id!r} does not fit {name} of {self.num_experts} experts.")
        inter = self.intermediate_size
        start, size = (inter, inter) if shard == "w3" else (0, param.shape[1] if shard == "w2" else inter)
        array = np.asarray(loaded)
        if tuple(array.shape) != (size, param.shape[2]):
            raise ValueError(f"Shape mismatch loading FusedMoE.{name}[{expert}, {shard}]: checkpoint has "
                             f"{tuple(array.shape)}, model expects {(size, param.shape[2])}.")
        param[expert, start : start + size] = to_tensor(array, param_dtype(param))

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}")


class GateLinear(ReplicatedLinear):
    """A router (or shared-expert gate) projection, kept in fp32 whatever the model's dtype.

    Routing picks experts by comparing scores: fp32 keeps the choice that of the
    checkpoint's own (transformers computes ERNIE's router in fp32 too). It is never quantized.
    """

    def __init__(self, input_size: int, output_size: int, dtype: str = "float32", prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias=False, dtype=dtype, quant_config=None, prefix=prefix)

    def process_weights_after_loading(self, dtype: str) -> bool:
        # Reported as converted in fp32 too, so that a bf16 model counts it among its packed matmuls.
        return super().process_weights_after_loading("float32") or dtype == "float32"
