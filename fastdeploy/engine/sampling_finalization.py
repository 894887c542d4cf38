"""Finalizing a request's sampling parameters against the model: EOS ids, bad words, token-id ranges.

The engine's :class:`~fastdeploy.engine.processor.Processor` calls these once per request,
on its own copy of the user's :class:`SamplingParams` (vLLM does the same in its
``SamplingParams.update_from_generation_config`` / ``update_from_tokenizer``).
"""

from __future__ import annotations

from typing import Any

from fastdeploy import envs
from fastdeploy.sampling_params import ParamValidationError, SamplingParams


def _max_token_id(tokenizer: Any) -> int:
    """Largest token id the tokenizer knows (added tokens included).

    Tokenizers from ``get_tokenizer`` carry it as ``max_token_id`` (computed once); any
    other tokenizer is asked each time.
    """
    max_id = getattr(tokenizer, "max_token_id", None)
    if isinstance(max_id, int):
        return max_id
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is not None:
        vocab = get_vocab()
        if vocab:
            return max(vocab.values())
    return len(tokenizer) - 1



def update_from_generation_config(
    params: SamplingParams,
    generation_config: dict[str, Any],
    model_eos_token_id: int | None = None,
    *,
    eos_token_id: int | None = None,
) -> None:
    """Take the EOS ids of the model and of its ``generation_config.json``.

    ``model_eos_token_id`` (vLLM's ``eos_token_id``, also accepted by that
    name) is the tokenizer's EOS; it ends generation unless ``ignore_eos``.
    Extra ids under ``generation_config["eos_token_id"]`` become stop token
    ids unless ``ignore_eos``. All of them join ``all_stop_token_ids``, which
    ``min_tokens`` masks even when ``ignore_eos`` is set.
    """
    if model_eos_token_id is None:
        model_eos_token_id = eos_token_id
    if not params.ignore_eos:
        params._eos_token_id = model_eos_token_id
    if model_eos_token_id is not None:
        params._all_stop_token_ids.add(model_eos_token_id)

    eos_ids = generation_config.get("eos_token_id")
    if eos_ids is None:
        return
    eos_set = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
    # The primary EOS is handled on its own, not as a stop token id.
    eos_set.discard(model_eos_token_id)
    if not eos_set:
        return
    params._all_stop_token_ids.update(eos_set)
    if not params.ignore_eos:
        assert params.stop_token_ids is not None
        # Existing ids keep their order; new EOS ids follow in id order (deterministic).
        params.stop_token_ids = list(dict.fromkeys([*params.stop_token_ids, *sorted(eos_set)]))

def update_from_tokenizer(params: SamplingParams, tokenizer: Any, vocab_size: int | None = None) -> None:
    """Tokenise ``bad_words`` and check token ids against the vocabulary.

    Each bad word is encoded as written (leading spaces stripped) and, when it
    yields a different first token of the same length, also with one leading
    space, so it is blocked both at the start of the text and mid-sentence.

    Args:
        tokenizer: A Hugging Face-style tokenizer (``encode``, ``get_vocab``/``len``).
        vocab_size: The model's vocabulary size when it differs from the
            tokenizer's; ids are checked against it.
    """
    max_token_id = _max_token_id(tokenizer)
    if params.bad_words:
        max_num_bad_words = envs.max_num_bad_words()
        params._bad_words_token_ids = []
        for bad_word in params.bad_words:
            plain: list[int] | None = None
            for prefix in ("", " "):
                token_ids = list(tokenizer.encode(prefix + bad_word.lstrip(), add_special_tokens=False))
                if not token_ids:
                    if not prefix:
                        raise ParamValidationError(
                            "bad_words entries must tokenize to at least one token.",
                            parameter="bad_words",
                            value=params.bad_words,
                        )
                    continue
                if not prefix:
                    plain = token_ids
                # The spaced form only counts when it is a distinct word token
                # (same length, different first id); otherwise it is the same
                # word split differently and blocking it would be redundant.
                elif plain is None or token_ids[0] == plain[0] or len(token_ids) != len(plain):
                    continue
                params._bad_words_token_ids.append(token_ids)
                if len(params._bad_words_token_ids) > max_num_bad_words:
                    raise ParamValidationError(
                        f"Too many bad words after tokenization: {len(params._bad_words_token_ids)}. "
                        f"The max number is {max_num_bad_words}.",
                        parameter="bad_words",
                        value=params.bad_words,
                    )
        invalid = [tid for ids in params._bad_words_token_ids for tid in ids if tid < 0 or tid > max_token_id]
        if invalid:
            raise ParamValidationError(
                f"The model vocabulary size is {max_token_id + 1}, but the following tokens were specified as bad: "
                f"{invalid}. All token id values should be integers satisfying: 0 <= token_id <= {max_token_id}.",
                parameter="bad_words",
                value=params.bad_words,
            )
    verify_token_ids(params, vocab_size if vocab_size is not None else max_token_id + 1)

def verify_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Check ``allowed_token_ids``, ``logit_bias``, ``stop_token_ids`` and ``logprob_token_ids`` lie in ``[0, vocab_size)``."""
    if params.allowed_token_ids is not None:
        if len(params.allowed_token_ids) == 0:
            raise ParamValidationError(
                "allowed_token_ids is not None and empty!",
                parameter="allowed_token_ids",
                value=params.allowed_token_ids,
            )
        invalid = [tid for tid in params.allowed_token_ids if tid < 0 or tid >= vocab_size]
        if invalid:
            raise ParamValidationError(
                "allowed_token_ids contains out-of-vocab token id!",
                parameter="allowed_token_ids",
                value=invalid,
            )
    for name in ("logit_bias", "stop_token_ids", "logprob_token_ids"):
        ids = getattr(params, name)
        if not ids:
            continue
        invalid = [tid for tid in ids if tid < 0 or tid >= vocab_size]
        if invalid:
            raise ParamValidationError(
                f"token_id(s) {invalid} in {name} contain out-of-vocab token ids. Vocabulary size: {vocab_size}",
                parameter=name,
                value=invalid,
            )
