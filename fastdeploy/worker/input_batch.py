"""The persistent batch: one row per running request, kept across steps in numpy buffers.

Rows hold token ids, progress, the block table and the scalar sampling
settings, so building a step's inputs is fancy indexing over these buffers
rather than rebuilding Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fastdeploy.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the runner keeps per request besides its row (survives preemption)."""

    req_id: str
    sampling_params: SamplingParams
    num_prompt_tokens: int
    eos_token_id: int | None
    generator: np.random.Generator | None
    bad_words_token_ids: list[list[int]] | None = None
    output_token_ids: list[int] = field(default_factory=list)


class InputBatch:
    """Fixed-capacity row storage for up to ``max_num_reqs`` requests."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.req_id_to_index: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.req_id_to_index)

    def add_request(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        num_computed: int,
        block_ids: list[int],
        sp: SamplingParams,
    ) -> int:
        if not self._free_rows:
            raise RuntimeError(f"The persistent batch is full ({self.max_num_reqs} requests).")
        row = self._free_rows.pop()
        self.req_id_to_index[req_id] = row
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed
        self.num_blocks[row] = 0
        self.append_block_ids(row, block_ids)
        self.temperature[row] = sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = sp.top_k if sp.top_k and sp.top_k > 0 else 0
        self.min_p[row] = sp.min_p
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.repetition_penalty[row] = sp.repetition_penalty
        return row

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)
