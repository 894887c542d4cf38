"""Grammar checks of drafts: the accepted prefix, and one bitmask row per verified position."""

import numpy as np
import pytest

xgr = pytest.importorskip("xgrammar")

from fastdeploy.model_executor.guided_decoding.backend_xgrammar import XgrammarBackend  # noqa: E402
from fastdeploy.model_executor.guided_decoding.request import StructuredOutputKey, StructuredOutputOptions  # noqa: E402

VOCAB = ["a", "b", "c", "</s>"]


def _allowed(row: np.ndarray) -> list[int]:
    bits = np.unpackbits(row.astype("<i4").view(np.uint8), bitorder="little")
    return [i for i in range(len(VOCAB)) if bits[i]]


@pytest.fixture()
def grammar():
    backend = XgrammarBackend(xgr.TokenizerInfo(VOCAB, stop_token_ids=[3]), len(VOCAB), 4)
    compiled = backend.compile(StructuredOutputKey(StructuredOutputOptions.REGEX, "ab+c"))
    return backend, backend.new_grammar(compiled)


def test_validate_tokens_is_the_accepted_prefix_and_leaves_the_state(grammar):
    _, g = grammar
    assert g.validate_tokens([0, 1, 1, 2, 0]) == 4   # "abbc", then "a" breaks it
    assert g.validate_tokens([1]) == 0                # must start with "a"
    assert g.accept_tokens("r", [0]) and g.validate_tokens([1, 2, 3, 0]) == 3  # stops after </s>


def test_bitmask_rows_along_the_drafts(grammar):
    backend, g = grammar
    rows = backend.fill_bitmask_along(g, [0, 1])
    assert [_allowed(r) for r in rows] == [[0], [1], [1, 2]]
    # Rolled back: the grammar still expects "a" first.
    assert g.validate_tokens([0]) == 1 and g.num_processed_tokens == 0
