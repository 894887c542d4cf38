"""Prefix-cache block hashing: each full block's hash chains its parent's hash and its tokens."""

from __future__ import annotations

from collections.abc import Sequence

# Seed of the hash chain; a fixed value keeps hashes stable across processes.
NONE_HASH = 0x5F3759DF


def hash_block_tokens(parent_hash: int | None, block_token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """Hash of one full block given the hash of the block before it."""
    return hash((NONE_HASH if parent_hash is None else parent_hash, tuple(block_token_ids), extra_keys))


def update_block_hashes(block_hashes: list[int], token_ids: Sequence[int], block_size: int,
                        mm_features: Sequence | None = None) -> None:
    """Extend ``block_hashes`` in place with the hashes of any newly completed full blocks.

    ``mm_features``: the prompt's images; a block covering an image's placeholder tokens mixes in
    that image's hash, so two images behind the same placeholder ids never share cached blocks.
    """
    from fastdeploy.multimodal.inputs import mm_extra_keys

    num_full = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[-1] if block_hashes else None
        start, end = i * block_size, (i + 1) * block_size
        block_hashes.append(hash_block_tokens(parent, token_ids[start:end], mm_extra_keys(mm_features, start, end)))
