"""The model runner's multimodal state: 3-D positions per request and the encoder cache.

For a model with ``supports_multimodal`` the runner keeps one :class:`MultiModalRunnerState`.
When a request arrives it computes the prompt's M-RoPE positions once (and the delta that
places every later token); each step it hands the model the positions of the scheduled tokens
and, for the placeholder tokens in the step, the rows of their images' embeddings. An image is
encoded by the vision tower the first time one of its placeholders is scheduled and kept (keyed
by its hash, as vLLM's encoder cache) until every request using it has its placeholders in the
KV cache, so a prefill split into chunks (or two running requests with the same image) runs
the tower once; a request preempted and recomputed encodes again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle

from fastdeploy.multimodal.inputs import MultiModalFeatureSpec


@dataclass
class _RequestMM:
    features: list[MultiModalFeatureSpec]
    positions: np.ndarray | None  # [3, P] M-RoPE positions of the prompt
    delta: int = 0


@dataclass
class EncoderCache:
    """Vision-tower outputs by image hash, each kept while some request uses it."""

    outputs: dict[str, paddle.Tensor] = field(default_factory=dict)
    users: dict[str, set[str]] = field(default_factory=dict)
    # Images encoded so far (counts vision-tower runs; tests and stats read it).
    num_encoded: int = 0

    def get_or_encode(self, feature: MultiModalFeatureSpec, req_id: str, model: Any) -> paddle.Tensor:
        key = feature.identifier
        self.users.setdefault(key, set()).add(req_id)
        out = self.outputs.get(key)
        if out is None:
            out = model.embed_multimodal(feature.pixel_values.to_array(), np.asarray([feature.grid_thw]))
            if out.shape[0] != feature.length:
                raise ValueError(f"The vision tower gave {out.shape[0]} embeddings for {feature.length} placeholders.")
            self.outputs[key] = out
            self.num_encoded += 1
        return out

    def release(self, req_id: str, keys: list[str]) -> None:
        for key in keys:
            users = self.users.get(key)
            if users is None:
                continue
            users.discard(req_id)
            if not users:
                del self.users[key]
                self.outputs.pop(key, None)


class MultiModalRunnerState:
    """Per-request M-RoPE positions and image embeddings for one multimodal model."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.requests: dict[str, _RequestMM] = {}
        self.encoder_cache = EncoderCache()

    def add_request(self, req_id: str, token_ids: list[int], num_prompt_tokens: int,
                    features: list[MultiModalFeatureSpec] | None) -> None:
        features = list(features or [])
        positions, delta = None, 0
        if self.uses_mrope and features:
            positions, delta = self.model.get_mrope_input_positions(token_ids[:num_prompt_tokens], features)
        self.requests[req_id] = _RequestMM(features, positions, delta)

    def remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.encoder_cache.release(req_id, [f.identifier for f in state.features])

    def step_inputs(self, req_ids: list[str], computed: np.ndarray, num_tokens: np.ndarray) -> dict[str, Any]:
        """Model keyword arguments for a step scheduling ``num_tokens[i]`` tokens of ``req_ids[i]``
        from index ``computed[i]``: ``mrope_positions`` ``[3, T]``, ``mm_embeds`` and ``mm_token_index``."""
        pos_parts: list[np.ndarray] = []
        embeds: list[paddle.Tensor] = []
        index: list[np.ndarray] = []
        step_start = 0
        for req_id, c, n in zip(req_ids, computed.tolist(), num_tokens.tolist(), strict=True):
            p = np.arange(c, c + n, dtype=np.int64)
            state = self.requests.get(req_id)
            if state is None or state.positions is None:
                pos3 = np.broadcast_to(p, (3, n))
            else:
                table = state.positions
                in_prompt = p < table.shape[1]
                pos3 = np.where(in_prompt[None, :], table[:, np.minimum(p, table.shape[1] - 1)], p + state.delta)
            pos_parts.append(pos3)
            for f in state.features if state is not None else ():
                lo, hi = max(f.offset, c), min(f.offset + f.length, c + n)
                if lo >= hi:
                    continue
                out = self.encoder_cache.get_or_encode(f, req_id, self.model)
                embeds.append(out[lo - f.offset:hi - f.offset])
                index.append(step_start + np.arange(lo - c, hi - c, dtype=np.int64))
                if hi == f.offset + f.length:  # the image is fully in the KV cache: this request is done with it
                    self.encoder_cache.release(req_id, [f.identifier])
            step_start += n
        kwargs: dict[str, Any] = {}
        if self.uses_mrope:
            kwargs["mrope_positions"] = np.concatenate(pos_parts, axis=1)
        if embeds:
            kwargs["mm_embeds"] = paddle.concat(embeds, axis=0) if len(embeds) > 1 else embeds[0]
            kwargs["mm_token_index"] = np.concatenate(index)
        return kwargs
