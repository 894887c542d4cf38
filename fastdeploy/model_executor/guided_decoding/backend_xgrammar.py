"""xgrammar backend: request validation, grammar compilation, matchers and the batch bitmask."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fastdeploy.logger import init_logger
from fastdeploy.model_executor.guided_decoding.request import StructuredOutputKey, StructuredOutputOptions
from fastdeploy.sampling_params import ParamValidationError, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

logger = init_logger(__name__)

# String formats xgrammar turns into grammar rules; any other "format" would be silently ignored.
_SUPPORTED_STRING_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
_UNSUPPORTED_ARRAY_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains")
_COMMENT_RE = re.compile(r"(#|//).*$")


def _xgr():
    """xgrammar, imported on first use (it pulls in torch, which an engine without constraints never needs)."""
    import xgrammar

    return xgrammar


# ---- constraint translation -----------------------------------------------------------------
def choice_as_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the given strings.

    ``json.dumps`` writes exactly the escapes xgrammar's EBNF string literals
    read (``\\"``, ``\\\\``, ``\\n``, ``\\uXXXX``); ``ensure_ascii=False`` keeps
    other characters as they are.
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_is_likely_lark(grammar: str) -> bool:
    """True unless some rule is written ``name ::= ...`` (GBNF/EBNF); comments are ignored."""
    for line in grammar.split("\n"):
        if "::=" in _COMMENT_RE.sub("", line):
            return False
    return True


def _types_of(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return set()


def has_xgrammar_unsupported_json_features(schema: Any) -> bool:
    """Whether the schema uses keywords xgrammar would drop instead of enforcing.

    Compiling them would succeed yet let outputs break the schema, so such
    requests are refused up front (as vLLM does).
    """
    if isinstance(schema, list):
        return any(has_xgrammar_unsupported_json_features(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    kinds = _types_of(schema)
    if kinds & {"integer", "number"} and "multipleOf" in schema:
        return True
    if "array" in kinds and any(k in schema for k in _UNSUPPORTED_ARRAY_KEYWORDS):
        return True
    if "string" in kinds:
        if "format" in schema and schema["format"] not in _SUPPORTED_STRING_FORMATS:
            return True
        # A pattern or format combined with length bounds compiles with the bounds dropped.
        if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
            return True
    return any(has_xgrammar_unsupported_json_features(v) for v in schema.values() if isinstance(v, (dict, list)))


def _load_json(value: str | dict, what: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ParamValidationError(f"Invalid {what} specification.", parameter="structured_outputs") from e


def _structural_tag_arguments(spec: str | dict) -> tuple[list[Any], list[str]] | str:
    """Arguments of ``compile_structural_tag``: the legacy ``{"structures", "triggers"}`` form, or the JSON as is."""
    tag = _load_json(spec, "structural tag")
    if isinstance(tag, dict) and "structures" in tag:
        xgr = _xgr()
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        return items, list(tag["triggers"])
    return spec if isinstance(spec, str) else json.dumps(spec)


def validate_xgrammar_grammar(params: StructuredOutputsParams) -> None:
    """Check that xgrammar can enforce the constraint, without a tokenizer (cheap, front-end side).

    Raises:
        ParamValidationError: a ``ValueError`` with vLLM's message naming what is wrong.
    """
    xgr = _xgr()

    def fail(message: str, err: BaseException | None = None) -> None:
        raise ParamValidationError(message, parameter="structured_outputs") from err

    if params.whitespace_pattern is not None:
        fail("The xgrammar structured outputs backend does not support whitespace_pattern.")
    if params.regex is not None:
        if "\x00" in params.regex:
            fail("structured_outputs.regex must not contain a NUL character ('\\x00')")
        try:
            xgr.Grammar.from_regex(params.regex)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError on parse errors
            fail(f"Failed to transform regex into a grammar: {e}", e)
        return
    if params.choice is not None:
        if not params.choice or not all(isinstance(c, str) for c in params.choice):
            fail("structured_outputs.choice must be a non-empty list of strings.")
        try:
            xgr.Grammar.from_ebnf(choice_as_grammar(list(params.choice)))
        except Exception as e:  # noqa: BLE001
            fail(f"Failed to transform choices into a grammar: {e}", e)
        return
    if params.json is not None:
        schema = _load_json(params.json, "JSON grammar")
        if not isinstance(schema, (dict, bool)):
            fail("Invalid JSON grammar specification.")
        if has_xgrammar_unsupported_json_features(schema):
            fail("The provided JSON schema contains features not supported by xgrammar.")
        try:
            xgr.Grammar.from_json_schema(json.dumps(schema))
        except Exception as e:  # noqa: BLE001
            fail(f"Failed to transform json schema into a grammar: {e}", e)
        return
    if params.grammar is not None:
        try:
            if grammar_is_likely_lark(params.grammar):
                xgr.Grammar.from_lark(params.grammar)
            else:
                xgr.Grammar.from_ebnf(params.grammar)
        except Exception as e:  # noqa: BLE001
            fail("Invalid grammar specification.", e)
        return
    if params.structural_tag is not None:
        try:
            args = _structural_tag_arguments(params.structural_tag)
            if isinstance(args, tuple):
                tag = _load_json(params.structural_tag, "structural tag")
                for structure in tag["structures"]:
                    xgr.Grammar.from_json_schema(json.dumps(structure["schema"]))
            else:
                xgr.Grammar.from_structural_tag(args)
        except ParamValidationError:
            raise
        except Exception as e:  # noqa: BLE001
            fail("Invalid structural tag specification.", e)
        return
    if not params.json_object:
        fail("structured_outputs.json_object must be true when it is the only constraint.")


# ---- the backend ---------------------------------------------------------------------------
@dataclass
class XgrammarGrammar:
    """A request's grammar state: one xgrammar matcher over a shared compiled grammar."""

    matcher: xgr.GrammarMatcher
    num_processed_tokens: int = field(default=0, init=False)
    _terminated: bool = field(default=False, init=False)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over sampled tokens; False (logged) when a token breaks the grammar.

        Tokens after the grammar terminated are ignored: the request finishes there.
        """
        for token in tokens:
            if self._terminated:
                break
            if not self.matcher.accept_token(token):
                logger.error("Structured output of request %s rejected token %d.", request_id, token)
                return False
            self.num_processed_tokens += 1
            self._terminated = self.matcher.is_terminated()
        return True

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts (speculative drafts); the state is left unchanged.

        Tokens after the one that completes the grammar are not accepted.
        """
        accepted = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens
        self._terminated = self.matcher.is_terminated()

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self.matcher.reset()
        self.num_processed_tokens = 0
        self._terminated = False


class XgrammarBackend:
    """Compiles constraints for one tokenizer and fills the batch bitmask.

    Args:
        tokenizer: the model's Hugging Face tokenizer, or a ready ``xgrammar.TokenizerInfo``
            (for tokenizers that are not Hugging Face ones).
        vocab_size: the model's vocabulary (logits width), which may exceed the tokenizer's.
        max_num_seqs: rows of the persistent bitmask (the most requests sampled in one step).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_num_seqs: int) -> None:
        xgr = _xgr()
        self.vocab_size = vocab_size
        if isinstance(tokenizer, xgr.TokenizerInfo):
            self.tokenizer_info = tokenizer
        else:
            eos = tokenizer.eos_token_id
            stop_ids = None if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids
            )
        # The engine's own pool already runs compilations in parallel; one thread each keeps the
        # total bounded on small machines.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=True)
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads="auto")
        self._bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)

    def compile(self, key: StructuredOutputKey) -> xgr.CompiledGrammar:
        """Compile one constraint (slow for big schemas: runs on the manager's thread pool)."""
        kind, spec = key.kind, key.spec
        if kind == StructuredOutputOptions.JSON:
            return self.compiler.compile_json_schema(spec, any_whitespace=key.any_whitespace)
        if kind == StructuredOutputOptions.JSON_OBJECT:
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=key.any_whitespace)
        if kind == StructuredOutputOptions.REGEX:
            return self.compiler.compile_regex(spec)
        if kind == StructuredOutputOptions.CHOICE:
            return self.compiler.compile_grammar(choice_as_grammar(json.loads(spec)))
        if kind == StructuredOutputOptions.GRAMMAR:
            return self.compiler.compile_lark(spec) if grammar_is_likely_lark(spec) else self.compiler.compile_grammar(spec)
        if kind == StructuredOutputOptions.STRUCTURAL_TAG:
            args = _structural_tag_arguments(spec)
            return self.compiler.compile_structural_tag(*args) if isinstance(args, tuple) else (
                self.compiler.compile_structural_tag(args)
            )
        raise ValueError(f"Unsupported structured output kind: {kind}")

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        """A fresh matcher over a compiled grammar (cheap; one per request)."""
        return XgrammarGrammar(_xgr().GrammarMatcher(compiled))

    def fill_bitmask_along(self, grammar: XgrammarGrammar, tokens: list[int]) -> np.ndarray:
        """``len(tokens) + 1`` bitmask rows: the grammar's mask now and after each of ``tokens``.

        The tokens (validated speculative drafts) are accepted one by one, then rolled back.
        """
        out = _xgr().allocate_token_bitmask(len(tokens) + 1, self.vocab_size)
        matcher = grammar.matcher
        accepted = 0
        for i in range(len(tokens) + 1):
            matcher.fill_next_token_bitmask(out, i)
            if i < len(tokens):
                if not matcher.accept_token(tokens[i]):
                    raise RuntimeError(f"A validated draft token ({tokens[i]}) broke the grammar.")
                accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return out.numpy()

    def fill_bitmask(self, grammars: list[XgrammarGrammar]) -> np.ndarray:
        """Allowed-token bitmask ``[len(grammars), ceil(vocab / 32)]`` int32, filled for the batch in one call."""
        count = len(grammars)
        if count > self._bitmask.shape[0]:
            self._bitmask = _xgr().allocate_token_bitmask(count, self.vocab_size)
        self.batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], self._bitmask[:count])
        # A copy: the persistent buffer is refilled next step while this step's output may still be in use.
        return self._bitmask[:count].numpy().copy()
