"""PaddleFormers' attention calls, routed to FastDeploy's paged attention.

PaddleFormers attention modules compute Q/K/V and RoPE themselves, then call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, ...)``
(the same indirection as transformers, which vLLM's Transformers backend relies on).
The backend registers one more implementation, :func:`paged_attention_forward`, and sets
it in the config: every call lands on the :class:`PagedAttentionAdapter` attached to the
calling module, which writes K/V into this step's paged cache and attends over each
sequence's context with the step's :class:`AttentionMetadata`. The model runs with
batch size 1 over the flattened ``[num_tokens]`` batch, so decodes, chunked prefills and
prefix-cache hits all work exactly as for the native models.

Sliding-window layers (a ``sliding_window`` argument, or ``module.sliding_window``) get a
copy of the step's metadata with the window folded into its masks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata, PrefillSeqMetadata
from fastdeploy.model_executor.layers.attention.paged_attention import PagedAttention

# Name of the implementation in PaddleFormers' ALL_ATTENTION_FUNCTIONS and in config._attn_implementation.
ATTN_IMPLEMENTATION = "fastdeploy_paged"


class ForwardContext:
    """This step's KV caches and metadata, shared by every adapter of one model.

    The model sets it before calling the PaddleFormers forward and clears it after,
    so the PaddleFormers code in between never needs to carry our arguments.
    """

    def __init__(self) -> None:
        self.kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]] | None = None
        self.metadata: AttentionMetadata | None = None
        self._windowed: dict[int, AttentionMetadata] = {}

    def set(self, kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]], metadata: AttentionMetadata) -> None:
        self.kv_caches, self.metadata, self._windowed = kv_caches, metadata, {}

    def clear(self) -> None:
        self.set(None, None)  # type: ignore[arg-type]

    def metadata_for(self, sliding_window: int | None) -> AttentionMetadata:
        """The step's metadata, restricted to the last ``sliding_window`` keys when one is given."""
        md = self.metadata
        if md is None:
            raise RuntimeError("PaddleFormers attention was called outside of a FastDeploy forward.")
        if not sliding_window:
            return md
        if sliding_window not in self._windowed:
            self._windowed[sliding_window] = windowed_metadata(md, int(sliding_window))
        return self._windowed[sliding_window]


def windowed_metadata(md: AttentionMetadata, window: int) -> AttentionMetadata:
    """``md`` where a query at position ``p`` sees only keys ``p - window < k <= p`` (transformers' rule).

    Returns ``md`` itself (kernel fields included) when no context is longer than the
    window. Otherwise built once per step and window, with numpy over the plain-Paddle
    fields; the copy has no kernel fields, so windowed layers take the plain path.
    """
    if _longest_context(md) <= window:
        return md
    decode_mask = md.decode_mask
    if md.num_decodes:
        mask = md.decode_mask.numpy()  # [nd, 1, 1, L]: 0 for the context, -inf for padding
        ctx = (mask[:, 0, 0, :] == 0).sum(-1)
        if int(ctx.max()) > window:
            keys = np.arange(mask.shape[-1])
            far = keys[None, :] < (ctx - window)[:, None]
            decode_mask = paddle.to_tensor(np.where(far[:, None, None, :], -np.inf, mask).astype(np.float32))
    prefills = []
    for seq in md.prefills:
        if seq.context_len <= window:
            prefills.append(seq)
            continue
        pos = np.arange(seq.context_len - seq.query_len, seq.context_len)[:, None]
        keys = np.arange(seq.context_len)[None, :]
        visible = (keys <= pos) & (keys > pos - window)
        mask = paddle.to_tensor(np.where(visible, 0.0, -np.inf).astype(np.float32))
        prefills.append(PrefillSeqMetadata(seq.query_start, seq.query_len, seq.context_len, seq.context_slots, mask))
    if decode_mask is md.decode_mask and all(a is b for a, b in zip(prefills, md.prefills, strict=True)):
        return md
    return AttentionMetadata(
        num_tokens=md.num_tokens,
        slot_mapping=md.slot_mapping,
        num_decodes=md.num_decodes,
        decode_slots=md.decode_slots,
        decode_mask=decode_mask,
        prefills=prefills,
    )


def _longest_context(md: AttentionMetadata) -> int:
    """Longest context of the step (from the host copy when the runner kept one)."""
    host = getattr(md, "host", None)
    if host is not None and len(host.seq_lens):
        return int(host.seq_lens.max())
    longest = max((seq.context_len for seq in md.prefills), default=0)
    if md.num_decodes:
        longest = max(longest, int(md.decode_mask.shape[-1]))
    return longest


class PagedAttentionAdapter(nn.Layer):
    """Paged attention for one PaddleFormers attention module (one decoder layer).

    Args:
        layer_idx: which of the step's KV caches this layer owns.
        num_heads, num_kv_heads, head_dim: the layer's attention shape.
        scale: softmax scale; replaced by the ``scaling`` PaddleFormers passes, when it passes one.
        context: the model's :class:`ForwardContext`.
    """

    def __init__(
        self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, context: ForwardContext
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attn = PagedAttention(num_heads, head_dim, scale, num_kv_heads)
        self._context = context  # a plain object: not registered as a sublayer

    def forward(
        self,
        query: paddle.Tensor,
        key: paddle.Tensor,
        value: paddle.Tensor,
        scaling: float | None = None,
        sliding_window: int | None = None,
    ) -> paddle.Tensor:
        """PaddleFormers' ``[1, heads, T, D]`` query/key/value -> ``[1, T, H * D]`` attention output."""
        if query.ndim != 4 or query.shape[0] != 1:
            raise ValueError(f"Expected query [1, heads, tokens, head_dim], got {list(query.shape)}.")
        ctx = self._context
        if scaling is not None:
            self.attn.scale = float(scaling)
        # [1, heads, T, D] -> [T, heads, D]: the token-major layout of the paged cache.
        q, k, v = (t[0].transpose([1, 0, 2]) for t in (query, key, value))
        out = self.attn(q, k, v, ctx.kv_caches[self.layer_idx], ctx.metadata_for(sliding_window))
        return out.unsqueeze(0)


def paged_attention_forward(
    module: nn.Layer,
    query: paddle.Tensor,
    key: paddle.Tensor,
    value: paddle.Tensor,
    attention_mask: paddle.Tensor | None = None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[paddle.Tensor, None]:
    """The function PaddleFormers calls in place of sdpa/flash attention.

    Masks PaddleFormers may pass are ignored: causality, padding and windows come from
    the step's metadata, which knows each sequence's real context. Features the paged
    attention does not have (attention sinks) fail instead of being dropped.
    """
    if kwargs.get("sink") is not None:
        raise NotImplementedError(f"{type(module).__name__} uses attention sinks, which paged attention lacks.")
    adapter = getattr(module, "fd_paged_attention", None)
    if adapter is None:
        raise RuntimeError(f"{type(module).__name__} has no FastDeploy paged attention attached.")
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    return adapter(query, key, value, scaling, window), None


def register_attention_implementation() -> None:
    """Make :func:`paged_attention_forward` selectable through ``config._attn_implementation``."""
    from paddleformers.nn.attention.interface import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def attach_paged_attention(model: nn.Layer, config: Any, context: ForwardContext) -> list[nn.Layer]:
    """Attach a :class:`PagedAttentionAdapter` to every attention module of ``model``; returns those modules.

    An attention module is a sublayer with a ``layer_idx`` and its own Q/K/V projections
    (separate or fused); its shape comes from the module when it states it, else the config.
    """
    modules = [
        m
        for _, m in model.named_sublayers()
        if getattr(m, "layer_idx", None) is not None and (hasattr(m, "qkv_proj") or hasattr(m, "q_proj"))
    ]
    for module in modules:
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None)
        head_dim = head_dim or config.hidden_size // num_heads
        scale = getattr(module, "scaling", None) or head_dim**-0.5
        module.fd_paged_attention = PagedAttentionAdapter(
            int(module.layer_idx), num_heads, num_kv_heads, head_dim, scale, context
        )
    return modules
