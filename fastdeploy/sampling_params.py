"""Sampling parameters for text generation, compatible with vLLM's ``vllm.sampling_params``.

``SamplingParams`` takes the same keyword arguments, applies the same
normalisations and raises ``ValueError`` with the same messages as vLLM, so
scripts and tests written against vLLM behave identically here.
"""

import copy
import math
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

from fastdeploy import envs
from fastdeploy.logger import init_logger

logger = init_logger(__name__)

__all__ = [
    "BeamSearchParams",
    "GuidedDecodingParams",
    "ParamValidationError",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
    "StructuredOutputsParams",
]

# Below this temperature sampling is greedy (vLLM's threshold).
_SAMPLING_EPS = 1e-5
# Positive temperatures below this overflow the softmax, so vLLM raises them to it.
_MAX_TEMP = 1e-2
_LOGIT_BIAS_LIMIT = 100.0
# Most ids one request may ask logprobs for with ``logprob_token_ids`` (vLLM's MAX_LOGPROB_TOKEN_IDS).
MAX_LOGPROB_TOKEN_IDS = 128


def _max_n_sequences() -> int:
    return envs.max_n_sequences()


class ParamValidationError(ValueError):
    """A rejected request parameter.

    A ``ValueError`` (so ``except ValueError`` and vLLM-style tests catch it) that
    also names the offending parameter, which the HTTP server reports as ``param``.
    ``str()`` is exactly the vLLM message.
    """

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


def _verify_num_sequences(value: Any, parameter_name: str) -> None:
    """Check ``n`` / ``beam_width``: an int in [1, max]."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ParamValidationError(
            f"{parameter_name} must be an int, but is of type {type(value)}",
            parameter=parameter_name,
            value=value,
        )
    if value < 1:
        raise ParamValidationError(
            f"{parameter_name} must be at least 1, got {value}.",
            parameter=parameter_name,
            value=value,
        )
    max_n = _max_n_sequences()
    if value > max_n:
        raise ParamValidationError(
            f"{parameter_name} must be at most {max_n}, got {value}. "
            "To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable.",
            parameter=parameter_name,
            value=value,
        )


class SamplingType(IntEnum):
    """How the next token is chosen."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(Enum):
    """What each streamed ``RequestOutput`` carries."""

    # The whole output so far, every time.
    CUMULATIVE = 0
    # Only what is new since the previous output.
    DELTA = 1
    # Nothing until the request finishes.
    FINAL_ONLY = 2


_CONSTRAINT_FIELDS = (
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "structural_tag",
)


@dataclass
class StructuredOutputsParams:
    """One constraint on the shape of the generated text (vLLM's structured outputs).

    Exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` or
    ``structural_tag`` must be given; the rest are options of the backend.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    # Chosen by the engine when the request is validated, never by the user.
    _backend: str | None = field(default=None, init=False, repr=False)
    _backend_was_auto: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        """Accept a pydantic model class as ``json`` and check exactly one constraint is set."""
        # Older FastDeploy / vLLM callers passed a pydantic model class; keep that working.
        if self.json is not None and not isinstance(self.json, (str, dict)) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()
        count = sum(getattr(self, name) is not None for name in _CONSTRAINT_FIELDS)
        if count > 1:
            raise ParamValidationError(
                "You can only use one kind of structured outputs constraint "
                f"but multiple are specified: {self.__dict__}"
            )
        if count < 1:
            raise ParamValidationError(
                f"You must use one kind of structured outputs constraint but none are specified: {self.__dict__}"
            )

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "StructuredOutputsParams | None":
        """Build params from request fields, or ``None`` when no constraint is among them."""
        if all(kwargs.get(name) is None for name in _CONSTRAINT_FIELDS):
            return None
        return cls(**kwargs)

    def all_constraints_none(self) -> bool:
        """True when no constraint field is set."""
        return all(getattr(self, name) is None for name in _CONSTRAINT_FIELDS)

    def all_non_structural_tag_constraints_none(self) -> bool:
        """True when no constraint other than ``structural_tag`` is set."""
        return all(getattr(self, name) is None for name in _CONSTRAINT_FIELDS if name != "structural_tag")


# FastDeploy's and vLLM's former name.
GuidedDecodingParams = StructuredOutputsParams


def _normalise_logit_bias(logit_bias: dict[Any, Any]) -> dict[int, float]:
    """Token-id keys as int (JSON gives strings), biases clamped to [-100, 100]."""
    result: dict[int, float] = {}
    bad_keys = []
    for token, bias in logit_bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            bad_keys.append(token)
            continue
        try:
            bias = float(bias)
        except (TypeError, ValueError):
            raise ParamValidationError(
                f"logit_bias values must be numbers, got {bias!r} for token {token!r}.",
                parameter="logit_bias",
                value=bias,
            ) from None
        result[token_id] = min(_LOGIT_BIAS_LIMIT, max(-_LOGIT_BIAS_LIMIT, bias))
    if bad_keys:
        raise ParamValidationError(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad_keys!r}",
            parameter="logit_bias",
            value=bad_keys,
        )
    return result


@dataclass(kw_only=True)
class SamplingParams:
    """Sampling parameters for text generation (vLLM's ``SamplingParams``).

    Follows the OpenAI completions API plus vLLM's extensions. All arguments are
    keywords; they are checked and normalised on construction.

    Args:
        n: Number of completions to return.
        presence_penalty: Penalty in [-2, 2] for tokens already present in the output.
        frequency_penalty: Penalty in [-2, 2] proportional to a token's count in the output.
        repetition_penalty: Multiplicative penalty (> 0) for tokens in the prompt or output; 1 = off.
        temperature: Randomness; 0 means greedy.
        top_p: Cumulative-probability cut-off in (0, 1].
        top_k: Keep the k most likely tokens; 0 (or -1) keeps all.
        min_p: Drop tokens below ``min_p`` times the top token's probability.
        seed: Seed of this request's random generator (-1 = none).
        stop: String(s) that end generation; not included in the output by default.
        stop_token_ids: Token ids that end generation.
        bad_words: Words that must not be generated.
        ignore_eos: Keep generating past the EOS token.
        max_tokens: Most tokens to generate per completion; ``None`` = up to the context length.
        min_tokens: Fewest tokens to generate before EOS / stop tokens are allowed.
        logprobs: Top logprobs returned per generated token (-1 = whole vocabulary).
        prompt_logprobs: Top logprobs returned per prompt token (-1 = whole vocabulary).
        logprob_token_ids: Token ids whose logprobs are returned at every generated position,
            with the sampled token's, instead of the top-k (``logprobs``, when also set, must be their count).
        detokenize: Produce text (otherwise only token ids).
        skip_special_tokens: Leave special tokens out of the text.
        spaces_between_special_tokens: Put spaces between special tokens in the text.
        include_stop_str_in_output: Keep the matched stop string in the text.
        output_kind: Cumulative, delta or final-only streaming outputs.
        structured_outputs: Constraint on the generated text.
        guided_decoding: Former name of ``structured_outputs``; moved there, then reset to ``None``.
        logit_bias: ``{token_id: bias}`` added to the logits, clamped to [-100, 100].
        allowed_token_ids: Only these tokens may be generated.
        extra_args: Free-form arguments for custom samplers and plugins.
        truncate_prompt_tokens: Keep only the last k prompt tokens (-1 = the model's maximum).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Legacy input name, moved into structured_outputs by __post_init__ (as vLLM 0.11 did).
    guided_decoding: StructuredOutputsParams | None = field(default=None, repr=False)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = None

    # Derived in __post_init__ / by the engine; not constructor arguments.
    # Characters of text held back while a stop string might still be matching.
    output_text_buffer_length: int = field(default=0, init=False, repr=False)
    _eos_token_id: int | None = field(default=None, init=False, repr=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        """Normalise the arguments as vLLM does, then validate them."""
        # The legacy name wins when given, as in vLLM 0.11, which then cleared it so
        # that replace()/deserialisation cannot resurrect a stale constraint.
        if self.guided_decoding is not None:
            self.structured_outputs = self.guided_decoding
            self.guided_decoding = None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

        if isinstance(self.temperature, (int, float)) and 0 < self.temperature < _MAX_TEMP:
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors nan or inf in tensors. "
                "We have maxed it out to %s.",
                self.temperature,
                _MAX_TEMP,
                _MAX_TEMP,
            )
            self.temperature = _MAX_TEMP

        if self.seed == -1:
            self.seed = None

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)

        # Duplicates are dropped keeping the first occurrence's order.
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        self.bad_words = [] if self.bad_words is None else list(dict.fromkeys(self.bad_words))

        # OpenAI clients send logprobs=True for "the chosen token only".
        if self.logprobs is True:
            self.logprobs = 1
        elif self.logprobs is False:
            self.logprobs = None
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        elif self.prompt_logprobs is False:
            self.prompt_logprobs = None

        if self.logit_bias is not None:
            self.logit_bias = _normalise_logit_bias(self.logit_bias)

        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1

        self._verify_args()

        # vLLM accepts -1 as "off" but prefers 0; one value keeps the sampler simple.
        if self.top_k == -1:
            self.top_k = 0

        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other truncations cannot change the argmax.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            self._verify_greedy_sampling()

        # update() rather than assignment: a deserialised copy arrives with the
        # EOS ids the engine already added (update_from_generation_config).
        self._all_stop_token_ids.update(self.stop_token_ids)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "SamplingParams":
        """Build params from request fields where ``None`` means "the default".

        ``max_tokens=None`` is kept (it means "up to the context length"), as in vLLM.
        """
        defaults = {
            "n": 1,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "min_tokens": 0,
        }
        for name, default in defaults.items():
            if kwargs.get(name) is None:
                kwargs[name] = default
        return cls(**kwargs)

    def _verify_args(self) -> None:
        _verify_num_sequences(self.n, "n")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ParamValidationError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.",
                parameter="presence_penalty",
                value=self.presence_penalty,
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ParamValidationError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.",
                parameter="frequency_penalty",
                value=self.frequency_penalty,
            )
        if not math.isfinite(self.repetition_penalty):
            raise ParamValidationError(
                f"repetition_penalty must be a finite number, got {self.repetition_penalty}.",
                parameter="repetition_penalty",
                value=self.repetition_penalty,
            )
        if self.repetition_penalty <= 0.0:
            raise ParamValidationError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
                parameter="repetition_penalty",
                value=self.repetition_penalty,
            )
        if not math.isfinite(self.temperature):
            raise ParamValidationError(
                f"temperature must be a finite number, got {self.temperature}.",
                parameter="temperature",
                value=self.temperature,
            )
        if self.temperature < 0.0:
            raise ParamValidationError(
                f"temperature must be non-negative, got {self.temperature}.",
                parameter="temperature",
                value=self.temperature,
            )
        if self.temperature > 2.0:
            raise ParamValidationError(
                f"temperature must be in [0, 2], got {self.temperature}.",
                parameter="temperature",
                value=self.temperature,
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ParamValidationError(
                f"top_p must be in (0, 1], got {self.top_p}.",
                parameter="top_p",
                value=self.top_p,
            )
        if self.top_k < -1:
            raise ParamValidationError(
                f"top_k must be 0 (disable), or at least 1, got {self.top_k}.",
                parameter="top_k",
                value=self.top_k,
            )
        if not isinstance(self.top_k, int):
            raise ParamValidationError(
                f"top_k must be an integer, got {type(self.top_k).__name__}",
                parameter="top_k",
                value=self.top_k,
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamValidationError(
                f"min_p must be in [0, 1], got {self.min_p}.",
                parameter="min_p",
                value=self.min_p,
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParamValidationError(
                f"max_tokens must be at least 1, got {self.max_tokens}.",
                parameter="max_tokens",
                value=self.max_tokens,
            )
        if self.min_tokens < 0:
            raise ParamValidationError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
                parameter="min_tokens",
                value=self.min_tokens,
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamValidationError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.",
                parameter="min_tokens",
                value=self.min_tokens,
            )
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise ParamValidationError(
                f"logprobs must be non-negative or -1, got {self.logprobs}.",
                parameter="logprobs",
                value=self.logprobs,
            )
        if self.prompt_logprobs is not None and self.prompt_logprobs != -1 and self.prompt_logprobs < 0:
            raise ParamValidationError(
                f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}.",
                parameter="prompt_logprobs",
                value=self.prompt_logprobs,
            )
        self._verify_logprob_token_ids()
        if self.truncate_prompt_tokens is not None and (
            self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1
        ):
            raise ParamValidationError(
                f"truncate_prompt_tokens must be an integer >= 1 or -1, got {self.truncate_prompt_tokens}",
                parameter="truncate_prompt_tokens",
                value=self.truncate_prompt_tokens,
            )
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ParamValidationError(
                f"seed must be an integer, got {type(self.seed).__name__}",
                parameter="seed",
                value=self.seed,
            )
        assert isinstance(self.stop_token_ids, list)
        if not all(isinstance(st_id, int) and not isinstance(st_id, bool) for st_id in self.stop_token_ids):
            raise ParamValidationError(
                f"stop_token_ids must contain only integers, got {self.stop_token_ids}.",
                parameter="stop_token_ids",
                value=self.stop_token_ids,
            )
        assert isinstance(self.stop, list)
        if any(not stop_str for stop_str in self.stop):
            raise ParamValidationError(
                "stop cannot contain an empty string.",
                parameter="stop",
                value=self.stop,
            )
        if self.stop and not self.detokenize:
            raise ParamValidationError(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.",
                parameter="stop",
                value=self.stop,
            )
        assert isinstance(self.bad_words, list)
        if any(not bad_word for bad_word in self.bad_words):
            raise ParamValidationError(
                f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}",
                parameter="bad_words",
                value=self.bad_words,
            )

    def _verify_logprob_token_ids(self) -> None:
        """vLLM's checks of ``logprob_token_ids`` that need no model (the vocabulary range is checked by the engine)."""
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ParamValidationError(f"logprob_token_ids must be a list of integers, got {ids!r}.",
                                       parameter="logprob_token_ids", value=ids)
        if not ids:
            raise ParamValidationError("`logprob_token_ids` must not be an empty list.",
                                       parameter="logprob_token_ids", value=ids)
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise ParamValidationError(
                f"Requested logprob_token_ids of length {len(ids)}, which is greater than max allowed: "
                f"{MAX_LOGPROB_TOKEN_IDS}", parameter="logprob_token_ids", value=len(ids))
        if self.logprobs is not None and self.logprobs != len(ids):
            raise ParamValidationError(
                "When both logprobs and logprob_token_ids are set, logprobs must equal len(logprob_token_ids). "
                f"Got logprobs={self.logprobs}, len(logprob_token_ids)={len(ids)}.",
                parameter="logprob_token_ids", value=len(ids))

    def _verify_greedy_sampling(self) -> None:
        if self.n > 1:
            raise ParamValidationError(
                f"n must be 1 when using greedy sampling, got {self.n}.",
                parameter="n",
                value=self.n,
            )

    @property
    def sampling_type(self) -> SamplingType:
        """Greedy, random, or random with this request's own seed."""
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def num_logprobs(self) -> int | None:
        """Logprobs returned per generated token besides the sampled one's, or None for none
        (``len(logprob_token_ids)`` when only those are asked for), as in vLLM."""
        if self.logprobs is not None:
            return self.logprobs
        return len(self.logprob_token_ids) if self.logprob_token_ids else None

    @property
    def eos_token_id(self) -> int | None:
        """The model's EOS id, or ``None`` when ``ignore_eos`` (set by the engine)."""
        return self._eos_token_id

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Stop token ids plus every EOS id; ``min_tokens`` suppresses all of these."""
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """Token sequences of ``bad_words`` (set by the engine's :func:`~fastdeploy.engine.sampling_finalization.update_from_tokenizer`)."""
        return self._bad_words_token_ids

    def clone(self) -> "SamplingParams":
        """A deep copy, so per-request changes by the engine do not leak between requests."""
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        return (
            f"SamplingParams(n={self.n}, "
            f"presence_penalty={self.presence_penalty}, "
            f"frequency_penalty={self.frequency_penalty}, "
            f"repetition_penalty={self.repetition_penalty}, "
            f"temperature={self.temperature}, "
            f"top_p={self.top_p}, "
            f"top_k={self.top_k}, "
            f"min_p={self.min_p}, "
            f"seed={self.seed}, "
            f"stop={self.stop}, "
            f"stop_token_ids={self.stop_token_ids}, "
            f"bad_words={self.bad_words}, "
            f"include_stop_str_in_output={self.include_stop_str_in_output}, "
            f"ignore_eos={self.ignore_eos}, "
            f"max_tokens={self.max_tokens}, "
            f"min_tokens={self.min_tokens}, "
            f"logprobs={self.logprobs}, "
            f"prompt_logprobs={self.prompt_logprobs}, "
            f"logprob_token_ids={self.logprob_token_ids}, "
            f"skip_special_tokens={self.skip_special_tokens}, "
            f"spaces_between_special_tokens={self.spaces_between_special_tokens}, "
            f"truncate_prompt_tokens={self.truncate_prompt_tokens}, "
            f"structured_outputs={self.structured_outputs}, "
            f"extra_args={self.extra_args})"
        )


@dataclass
class BeamSearchParams:
    """Parameters of ``LLM.beam_search`` (vLLM's ``BeamSearchParams``).

    Args:
        beam_width: Beams kept at each step (also the number of outputs).
        max_tokens: Most tokens to generate.
        ignore_eos: Keep extending beams past EOS.
        temperature: Temperature applied to the logprobs before ranking.
        length_penalty: Exponent of the length normalisation of beam scores.
        include_stop_str_in_output: Keep the stop string in the text.
        structured_outputs: Optional constraint on the generated text.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        """Check ``beam_width`` as vLLM does."""
        _verify_num_sequences(self.beam_width, "beam_width")
