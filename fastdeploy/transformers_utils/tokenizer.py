"""Tokenizers of local HF folders and GGUF files.

transformers' own GGUF tokenizer conversion is wrong for byte-level BPE models such
as SmolLM2 (wrong class, wrong EOS, a BOS the file says not to add, bogus extra
special tokens), so for ``tokenizer.ggml.model == "gpt2"`` the tokenizer is rebuilt
here from the GGUF metadata with the ``tokenizers`` library.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from fastdeploy.logger import init_logger
from fastdeploy.transformers_utils.gguf_pre_tokenizers import SPLIT_SEQUENCE_PRES
from fastdeploy.transformers_utils.gguf_utils import read_gguf_metadata

logger = init_logger(__name__)

# llama.cpp token types (gguf.TokenType).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# GPT-2's split, as used by llama.cpp for most byte-level vocabularies.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer names that split digits one by one before GPT-2's split.
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_PRES = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"}
_LLAMA3_PRES = {"llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3", "pixtral", "dbrx"}
_QWEN2_PRES = {"qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"}

# Files that make a folder a tokenizer folder of its own.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class GGUFTokenizerError(ValueError):
    """The GGUF file's tokenizer kind is not one this module can rebuild."""


def _pre_tokenizer(pre: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True),
            ]
        )
    if pre in _GPT2_PRES:
        return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in SPLIT_SEQUENCE_PRES:  # DeepSeek's: several splits in turn, then the byte-level mapping
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in SPLIT_SEQUENCE_PRES[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)]
        )
    pattern = _LLAMA3_PATTERN if pre in _LLAMA3_PRES else _QWEN2_PATTERN if pre in _QWEN2_PRES else None
    if pattern is None:
        raise GGUFTokenizerError(f"GGUF pre-tokenizer {pre!r} is not supported.")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ]
    )


def _special(meta: dict[str, Any], tokens: list[str], key: str) -> str | None:
    idx = meta.get(f"tokenizer.ggml.{key}_token_id")
    if idx is None or not 0 <= int(idx) < len(tokens):
        return None
    return tokens[int(idx)]


def build_gguf_bpe_tokenizer(gguf_path: str) -> PreTrainedTokenizerFast:
    """Build a fast tokenizer from the metadata of a byte-level BPE (``gpt2``) GGUF file.

    Raises:
        GGUFTokenizerError: the file's tokenizer is not byte-level BPE or its pre-tokenizer is unknown.
    """
    meta = read_gguf_metadata(gguf_path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(f"GGUF tokenizer model {kind!r} is not byte-level BPE.")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))

    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")), add_prefix_space)
    tok.decoder = decoders.ByteLevel()

    # Control tokens are special (never split, skipped on decode); user-defined ones are
    # plain added tokens. Both already have their ids in the vocab.
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, token_types, strict=True)
        if ty == _TOKEN_CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, token_types, strict=True)
        if ty == _TOKEN_USER_DEFINED
    ]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    bos = _special(meta, tokens, "bos")
    eos = _special(meta, tokens, "eos")
    post: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        pre_ids = [(bos, vocab[bos])] if add_bos else []
        post_ids = [(eos, vocab[eos])] if add_eos else []
        single = " ".join([t for t, _ in pre_ids] + ["$A"] + [t for t, _ in post_ids])
        pair = single + " " + " ".join([t for t, _ in pre_ids] + ["$B:1"] + [t for t, _ in post_ids])
        post.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=pre_ids + post_ids))
    tok.post_processor = processors.Sequence(post)

    kwargs: dict[str, Any] = {
        "tokenizer_object": tok,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": _special(meta, tokens, "unknown"),
        "pad_token": _special(meta, tokens, "padding"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture', '')}.context_length", 0)) or None,
    }
    if meta.get("tokenizer.chat_template"):
        kwargs["chat_template"] = meta["tokenizer.chat_template"]
    return PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})


def get_gguf_tokenizer(model_path: str, gguf_file: str) -> PreTrainedTokenizerBase:
    """Tokenizer of a GGUF checkpoint: byte-level BPE ones are rebuilt from the metadata, others use transformers.

    Rebuilding takes ~0.25 s for SmolLM2, no slower than loading a saved tokenizer.json,
    so nothing is cached on disk.
    """
    gguf_path = os.path.join(model_path, gguf_file)
    try:
        return build_gguf_bpe_tokenizer(gguf_path)
    except GGUFTokenizerError as e:
        logger.warning("%s Falling back to transformers' GGUF tokenizer for %s.", e, gguf_path)
        return AutoTokenizer.from_pretrained(model_path, gguf_file=gguf_file)


def get_tokenizer(
    path: str | None,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    tokenizer_mode: str = "auto",
    **kwargs: Any,
) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local model folder or GGUF file (vLLM's ``get_tokenizer``).

    Args:
        path: model folder, ``.gguf`` file, or a name ``resolve_model`` knows (the default model).
        gguf_file: GGUF file name inside ``path``; found automatically when ``path`` is a folder
            with one ``.gguf`` file and no tokenizer files of its own.
        trust_remote_code: passed to ``AutoTokenizer`` for folders.
        revision: accepted for vLLM compatibility; only local files are read.
        tokenizer_mode: ``"auto"`` (fast tokenizer) or ``"slow"``.
        **kwargs: passed to ``AutoTokenizer.from_pretrained`` for folders; ``truncation_side``
            (default "left", vLLM's for generation: a truncated prompt keeps its end) applies to all.
    """
    del revision  # local files only: there is no revision to choose
    truncation_side = kwargs.pop("truncation_side", "left")
    if tokenizer_mode not in ("auto", "slow"):
        raise ValueError(f"tokenizer_mode must be 'auto' or 'slow', got {tokenizer_mode!r}.")
    if gguf_file is None:
        has_own_files = path is not None and any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES)
        if not has_own_files:
            from fastdeploy.transformers_utils.model_resolver import resolve_model

            path, gguf_file = resolve_model(path)
    if gguf_file is not None:
        tokenizer = get_gguf_tokenizer(path, gguf_file)
    else:
        tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code, use_fast=tokenizer_mode != "slow", **kwargs
        )
    tokenizer.truncation_side = truncation_side
    # vLLM's cached tokenizer carries this too: fast tokenizers copy the whole vocabulary on
    # get_vocab() and even len(), far too slow to repeat for every request's validation.
    tokenizer.max_token_id = max(cached_vocab(tokenizer).values(), default=len(tokenizer) - 1)
    return tokenizer


def get_tokenizer_for_model(model_config):
    """The tokenizer of a configured model (GGUF metadata or its folder); None with skip_tokenizer_init."""
    if model_config.skip_tokenizer_init:
        return None
    # A separate --tokenizer folder never uses the model's GGUF file.
    gguf = model_config.gguf_file if model_config.tokenizer_path == model_config.model_path else None
    return get_tokenizer(
        model_config.tokenizer_path,
        gguf_file=gguf,
        trust_remote_code=model_config.trust_remote_code,
        revision=model_config.revision,
        tokenizer_mode=model_config.tokenizer_mode,
    )


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_vocab(tokenizer: Any) -> dict[str, int]:
    """``tokenizer.get_vocab()``, built once per tokenizer (fast tokenizers copy the whole
    vocabulary on every call; the parsers made per request only read it)."""
    try:
        return _VOCABS[tokenizer]
    except (KeyError, TypeError):
        pass
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = dict(get_vocab()) if get_vocab is not None else {}
    try:
        _VOCABS[tokenizer] = vocab
    except TypeError:  # not weak-referenceable
        pass
    return vocab
