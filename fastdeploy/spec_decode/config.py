"""``--speculative-config``: vLLM's keys (and their older spellings), FastDeploy's aliases.

The JSON is resolved once into :class:`SpeculativeConfig`; an unknown key, an unknown method or
an impossible value is a ``ValueError`` naming it, before any model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from fastdeploy.logger import init_logger

logger = init_logger(__name__)

# What each method reads its drafts from.
METHODS = ("ngram", "suffix", "draft_model", "mtp")
# vLLM's per-architecture MTP method names (all deprecated in vLLM in favour of "mtp").
_MTP_SPELLINGS = frozenset({
    "deepseek_mtp", "ernie_mtp", "mimo_mtp", "glm4_moe_mtp", "qwen3_next_mtp", "longcat_flash_mtp",
    "pangu_ultra_moe_mtp",
})
# Older names of keys, mapped to the ones vLLM reads today.
_KEY_ALIASES = {
    # vLLM < 0.7 engine flags (speculative_model, ngram_prompt_lookup_*, ...).
    "speculative_model": "model",
    "ngram_prompt_lookup_max": "prompt_lookup_max",
    "ngram_prompt_lookup_min": "prompt_lookup_min",
    "speculative_disable_by_batch_size": "disable_by_batch_size",
    # FastDeploy's own keys that mean the same.
    "num_model_steps": "num_speculative_tokens",
    "max_ngram_size": "prompt_lookup_max",
    "min_ngram_size": "prompt_lookup_min",
}
# vLLM's ngram default window when neither bound is given.
_DEFAULT_NGRAM_WINDOW = 5


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's ``SpeculativeConfig`` names).

    Attributes:
        method: ngram | suffix | draft_model | mtp.
        num_speculative_tokens: draft tokens proposed per request and step (k).
        model: the draft model (path or known name) for ``draft_model``.
        prompt_lookup_max / prompt_lookup_min: the ngram window (longest / shortest suffix matched).
        disable_by_batch_size: no drafts in a step whose running batch is larger than this.
        suffix_decoding_*: the suffix proposer's limits, as in vLLM.
        verify_strategy: FastDeploy's name for the acceptance rule; only ``target_match`` (the
            exact rule the rejection sampler implements) is accepted.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    quantization: str | None = None
    revision: str | None = None
    draft_tensor_parallel_size: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    verify_strategy: str = "target_match"

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Resolve the ``--speculative-config`` JSON (None: no speculation)."""
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {type(raw).__name__}.")
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            name = _KEY_ALIASES.get(key, key)
            if name not in known:
                raise ValueError(f"Unknown key {key!r} in --speculative-config; expected one of "
                                 f"{', '.join(sorted(known | set(_KEY_ALIASES)))}.")
            if name in values and values[name] != value:
                raise ValueError(f"--speculative-config gives {name!r} twice with different values "
                                 f"(as {key!r}).")
            values[name] = value
        method = values.get("method")
        model = values.get("model")
        if method is None:
            # As in vLLM: a model of "ngram" means the ngram method, any other model is a draft model.
            if model in ("ngram", "[ngram]"):
                method, values["model"] = "ngram", None
            elif model is not None:
                method = "draft_model"
            else:
                raise ValueError("--speculative-config needs 'method' (ngram, suffix, draft_model or mtp) or "
                                 "a draft 'model'.")
        if method == "[ngram]":
            method = "ngram"
        if method in _MTP_SPELLINGS:
            logger.warning("Speculative method %r is the older spelling of 'mtp'.", method)
            method = "mtp"
        if method not in METHODS:
            raise ValueError(f"Unknown speculative method {method!r} in --speculative-config; expected one of "
                             f"{', '.join(METHODS)}.")
        values["method"] = method
        k = values.get("num_speculative_tokens")
        if k is None:
            raise ValueError("--speculative-config needs num_speculative_tokens.")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}.")
        return cls(**values)

    def __post_init__(self) -> None:
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = _DEFAULT_NGRAM_WINDOW
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{name} must be an integer >= 1, got {v!r}.")
            if lo > hi:
                raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}.")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError(f"prompt_lookup_min / prompt_lookup_max apply to the ngram method only, not "
                             f"{self.method!r}.")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method 'draft_model' needs the draft 'model' in --speculative-config.")
        if self.method in ("ngram", "suffix") and self.model is not None:
            raise ValueError(f"'model' does not apply to the {self.method} method (it reads no model).")
        if self.method == "mtp" and self.model is not None:
            raise ValueError("'model' does not apply to the mtp method: the MTP modules are the target checkpoint's.")
        d = self.disable_by_batch_size
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"disable_by_batch_size must be an integer >= 1, got {d!r}.")
        if self.verify_strategy != "target_match":
            raise ValueError(f"verify_strategy {self.verify_strategy!r} is not supported by this FastDeploy build: "
                             "verification is exact ('target_match': a draft token is kept when the target "
                             "samples it, which is Leviathan et al.'s rule for one-hot drafts).")
        if self.quantization is not None:
            raise ValueError("A quantized draft model (quantization in --speculative-config) is not supported by "
                             "this FastDeploy build yet.")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError("draft_tensor_parallel_size must be 1 (tensor parallelism is not built).")
        if self.method == "suffix":
            if self.suffix_decoding_max_tree_depth < 1:
                raise ValueError("suffix_decoding_max_tree_depth must be >= 1.")
            if self.suffix_decoding_max_cached_requests < 0:
                raise ValueError("suffix_decoding_max_cached_requests must be >= 0.")
            if self.suffix_decoding_max_spec_factor <= 0:
                raise ValueError("suffix_decoding_max_spec_factor must be > 0.")
            if not 0 <= self.suffix_decoding_min_token_prob <= 1:
                raise ValueError("suffix_decoding_min_token_prob must be in [0, 1].")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the scheduled tokens a proposer writes during the step (the draft model's k)."""
        return self.num_speculative_tokens if self.method in ("draft_model", "mtp") else 0
