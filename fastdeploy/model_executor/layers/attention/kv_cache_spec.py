"""What each attention layer keeps per token in the paged KV cache (vLLM's ``kv_cache_interface``).

The model runner sizes and allocates the cache from these specs, one per layer, so an
architecture whose layers store something other than ``num_kv_heads x head_dim`` keys and
values (multi-head latent attention stores one compressed latent per token) buys the right
number of blocks from ``--kv-cache-memory-bytes``.

- :class:`FullAttentionSpec`: a key and a value tensor per layer, each
  ``[num_blocks, block_size, num_kv_heads, head_size]``;
- :class:`MLAAttentionSpec`: one latent tensor per layer, ``[num_blocks, block_size, 1,
  kv_lora_rank + qk_rope_head_dim]`` (the ``kv_caches`` entry is a 1-tuple).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paddle

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class FullAttentionSpec:
    """Separate K and V per layer (multi-head, grouped-query and multi-query attention)."""

    num_kv_heads: int
    head_size: int
    dtype: str = "float32"

    # How many tensors of [num_blocks, block_size, num_kv_heads, head_size] the layer holds.
    num_tensors = 2

    @property
    def bytes_per_token(self) -> int:
        return self.num_tensors * self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes one block of this layer takes."""
        return block_size * self.bytes_per_token

    def allocate(self, num_blocks: int, block_size: int, zero: bool = False) -> tuple[paddle.Tensor, ...]:
        """The layer's cache tensors; ``paddle.empty`` by default (pages cost memory only once written).

        ``zero``: fill with zeros (tests whose masked padding slots must hold finite values).
        """
        shape = [num_blocks, block_size, self.num_kv_heads, self.head_size]
        make = paddle.zeros if zero else paddle.empty
        return tuple(make(shape, dtype=self.dtype) for _ in range(self.num_tensors))


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one tensor per layer holding ``[c_kv ; k_pe]`` of each token."""

    num_tensors = 1


def model_kv_cache_specs(model: Any, num_kv_heads: int, head_dim: int, num_layers: int,
                         dtype: str) -> list[FullAttentionSpec]:
    """One spec per attention layer of ``model``: its own (``get_kv_cache_spec``, e.g. MLA's latent), else K and V
    of ``num_kv_heads x head_dim`` per layer."""
    get_spec = getattr(model, "get_kv_cache_spec", None)
    if get_spec is not None:
        return get_spec()
    return [FullAttentionSpec(num_kv_heads, head_dim, dtype)] * num_layers


def kv_cache_bytes_per_block(specs: list[FullAttentionSpec], block_size: int) -> int:
    """Bytes one block id costs across every layer."""
    return sum(spec.page_size_bytes(block_size) for spec in specs)
