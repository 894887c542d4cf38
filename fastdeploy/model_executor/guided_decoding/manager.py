"""StructuredOutputManager: the engine-side owner of grammars (vLLM's manager of the same name).

Grammars compile on a small thread pool, off the engine loop: a request waits
in ``WAITING_FOR_FSM`` until its grammar is ready while the rest of the batch
keeps running. Compiled grammars are cached by constraint key, so repeated
schemas start at once. Each step the scheduler asks for one bitmask covering
every constrained request it will sample, filled by xgrammar in one batch call.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from fastdeploy.logger import init_logger
from fastdeploy.model_executor.guided_decoding.request import (
    StructuredOutputKey,
    StructuredOutputRequest,
    get_structured_output_key,
)

if TYPE_CHECKING:
    from fastdeploy.config import FDConfig
    from fastdeploy.engine.request import Request
    from fastdeploy.model_executor.guided_decoding.backend_xgrammar import XgrammarBackend, XgrammarGrammar

logger = init_logger(__name__)

# Compiled grammars kept for reuse; JSON-schema grammars are a few hundred KiB at most.
_COMPILED_CACHE_SIZE = 256


class StructuredOutputManager:
    """Compiles, caches and advances the grammars of constrained requests.

    Args:
        fd_config: the engine configuration (backend, vocabulary, batch size, reasoning parser).
        tokenizer: the model's tokenizer (or an ``xgrammar.TokenizerInfo``) when the caller
            already has one; otherwise it is loaded the first time a constrained request
            arrives (in the compile thread).
    """

    def __init__(self, fd_config: FDConfig, tokenizer: Any = None) -> None:
        self.config = fd_config.structured_outputs_config
        self.fd_config = fd_config
        self.enable_in_reasoning = self.config.enable_in_reasoning
        self.reasoner: Any = None
        self._tokenizer = tokenizer
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._compiled: OrderedDict[StructuredOutputKey, Any] = OrderedDict()
        self._compiled_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    # ---- compilation -------------------------------------------------------------------
    def grammar_init(self, request: Request) -> None:
        """Start building the request's grammar: at once when its key is cached, else on the pool."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        so_request = StructuredOutputRequest(params, get_structured_output_key(params, self.config))
        request.structured_output_request = so_request
        if self._backend is not None:
            compiled = self._cached(so_request.key)
            if compiled is not None:
                so_request._grammar = self._backend.new_grammar(compiled)
                return
        if self._executor is None:
            # CPU-bound work: half the cores, as vLLM does, so decoding keeps the rest.
            workers = max(1, ((os.cpu_count() or 2) + 1) // 2)
            self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fd-grammar")
        so_request._grammar = self._executor.submit(self._create_grammar, so_request.key)

    def _cached(self, key: StructuredOutputKey) -> Any:
        with self._compiled_lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
            return compiled

    def _create_grammar(self, key: StructuredOutputKey) -> XgrammarGrammar:
        backend = self._get_backend()
        compiled = self._cached(key)
        if compiled is None:
            compiled = backend.compile(key)
            with self._compiled_lock:
                self._compiled[key] = compiled
                while len(self._compiled) > _COMPILED_CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return backend.new_grammar(compiled)

    def _get_backend(self) -> XgrammarBackend:
        """The backend, created on first use (loading the tokenizer when none was given)."""
        with self._backend_lock:
            if self._backend is None:
                from fastdeploy.model_executor.guided_decoding.backend_xgrammar import XgrammarBackend

                tokenizer = self._tokenizer
                if tokenizer is None:
                    from fastdeploy.transformers_utils.tokenizer import get_tokenizer_for_model

                    tokenizer = self._tokenizer = get_tokenizer_for_model(self.fd_config.model_config)
                if tokenizer is None:
                    raise ValueError("Structured outputs need a tokenizer (skip_tokenizer_init is set).")
                if self.config.reasoning_parser:
                    from fastdeploy.reasoning import ReasoningParserManager

                    parser_cls = ReasoningParserManager.get_reasoning_parser(self.config.reasoning_parser)
                    self.reasoner = parser_cls(tokenizer)
                self._backend = XgrammarBackend(
                    tokenizer,
                    self.fd_config.model_config.vocab_size,
                    self.fd_config.scheduler_config.max_num_seqs,
                )
            return self._backend

    def wait_for_any(self, requests: list[Request], timeout: float) -> None:
        """Block until one of these requests' grammars is ready (or ``timeout`` seconds).

        Called when nothing else can run, so the engine sleeps instead of spinning
        while the compile threads need the cores.
        """
        pending = [r.structured_output_request.pending for r in requests if r.structured_output_request is not None]
        pending = [f for f in pending if f is not None]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    # ---- per step ----------------------------------------------------------------------
    def grammar_bitmask(self, requests: list[Request]) -> tuple[np.ndarray | None, dict[str, int]]:
        """The bitmask of the constrained requests among ``requests`` (those sampling this step).

        Returns:
            ``(bitmask [k, ceil(vocab / 32)] int32, {request_id: row})``, or ``(None, {})``
            when no request needs masking.
        """
        grammars: list[XgrammarGrammar] = []
        rows: dict[str, int] = {}
        for request in requests:
            so_request = request.structured_output_request
            grammar = so_request.grammar if so_request is not None else None
            if grammar is None or grammar.is_terminated() or not self.should_fill_bitmask(request):
                continue
            rows[request.request_id] = len(grammars)
            grammars.append(grammar)
        if not grammars:
            return None, {}
        assert self._backend is not None
        return self._backend.fill_bitmask(grammars), rows

    def bitmasks_along(self, grammar: XgrammarGrammar, tokens: list[int]) -> np.ndarray:
        """The grammar's bitmask at each of ``len(tokens) + 1`` positions (speculative verification)."""
        assert self._backend is not None
        return self._backend.fill_bitmask_along(grammar, tokens)

    def should_fill_bitmask(self, request: Request) -> bool:
        """Whether the grammar constrains the next token (not while the model is still reasoning)."""
        if self.reasoner is None or self.enable_in_reasoning:
            return True
        so_request = request.structured_output_request
        assert so_request is not None
        if so_request.reasoning_ended is None:
            # A prompt can close the reasoning itself (e.g. thinking disabled by the chat template).
            so_request.reasoning_ended = self.reasoner.is_reasoning_end(request.prompt_token_ids)
        return so_request.reasoning_ended

    def should_advance(self, request: Request) -> bool:
        """Whether this step's tokens go through the grammar.

        While reasoning they do not; the step that ends the reasoning does not
        either (its end marker is not part of the answer), the next ones do.
        """
        so_request = request.structured_output_request
        if so_request is None or so_request.grammar is None:
            return False
        if self.reasoner is None or self.enable_in_reasoning or so_request.reasoning_ended:
            return True
        if self.reasoner.is_reasoning_end(request.all_token_ids):
            so_request.reasoning_ended = True
        return False

    def shutdown(self) -> None:
        """Stop the compile threads (pending compilations are dropped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
