"""Weights in 2 MB transparent huge pages: the spans collapsed, and what the kernel then maps."""

import mmap
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from fastdeploy.platforms import huge_pages
from fastdeploy.platforms.huge_pages import (
    HUGE_PAGE_BYTES,
    back_with_huge_pages,
    huge_page_spans,
    private_anonymous_ranges,
    tensor_buffers,
    thp_mode,
)
from tests.model_executor.models.test_deepseek_mtp import mtp_checkpoint  # noqa: F401  (the fixture)
from tests.model_executor.utils import build_tiny_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MB = 1 << 20
PAGE = HUGE_PAGE_BYTES
SIZE = 8 * MB

needs_thp = pytest.mark.skipif(thp_mode() not in ("always", "madvise"),
                               reason=f"transparent huge pages are {thp_mode()} on this kernel")


def anon_huge_bytes(address: int, size: int = 1, smaps: str = "/proc/self/smaps") -> int:
    """AnonHugePages of the mappings overlapping [address, address + size), in bytes.

    A mapping advised in part is split there, so one buffer may span several mappings.
    """
    total, inside = 0, False
    with open(smaps, encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < address + size and address < end
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def _collapse_works() -> bool:
    probe = paddle.ones([4 * MB], dtype="uint8")
    return back_with_huge_pages([(probe.data_ptr(), 4 * MB)]).error is None


def test_thp_mode_reads_the_selected_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert thp_mode(str(path)) == "madvise"
    path.write_text("[always] madvise never\n")
    assert thp_mode(str(path)) == "always"
    assert thp_mode(str(tmp_path / "missing")) == "unavailable"


def test_spans_round_merge_and_stay_inside_anonymous_memory():
    anonymous = [(0, 100 * PAGE)]
    # Two small buffers in one page and a third in the next: one span of the two pages they touch.
    small = [(PAGE + 100, 1000), (PAGE + 5000, 1000), (2 * PAGE + 10, 64)]
    assert huge_page_spans(small, anonymous) == [(PAGE, 3 * PAGE)]
    large = [(PAGE + 1, 5 * PAGE)]  # not on a page boundary: its partial pages at both ends too
    assert huge_page_spans(large, anonymous) == [(PAGE, 7 * PAGE)]
    # Only the whole pages of anonymous mappings are collapsed (file mappings and gaps are not).
    assert huge_page_spans(large, [(0, 3 * PAGE + 7), (5 * PAGE, 20 * PAGE)]) == [
        (PAGE, 3 * PAGE), (5 * PAGE, 7 * PAGE)]
    assert huge_page_spans([(PAGE, 0)], anonymous) == []


def test_private_anonymous_ranges_hold_a_tensor():
    t = paddle.ones([3 * MB], dtype="uint8")
    assert any(start <= t.data_ptr() < end for start, end in private_anonymous_ranges())


def test_tensor_buffers_find_parameters_and_packed_attributes():
    layer = paddle.nn.Linear(64, 32)
    packed = (paddle.zeros([1000], dtype="uint8"), [paddle.zeros([7], dtype="float32")])
    layer.packed = packed  # what a kernel's packed weight looks like on a layer: a tuple of tensors
    outer = paddle.nn.Sequential(layer)
    found = dict(tensor_buffers([outer]))
    assert found[layer.weight.data_ptr()] == 64 * 32 * 4
    assert found[layer.bias.data_ptr()] == 32 * 4
    assert found[packed[0].data_ptr()] == 1000
    assert found[packed[1][0].data_ptr()] == 28


def _fresh_mapping(size: int) -> tuple[mmap.mmap, np.ndarray]:
    """A private anonymous mapping of its own: never advised, unlike heap that an earlier test's
    model (in the same process) may have collapsed already."""
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return region, np.frombuffer(region, dtype=np.uint8)


@needs_thp
def test_written_memory_is_collapsed_in_place():
    if not _collapse_works():
        pytest.skip("MADV_COLLAPSE is refused here (a kernel before 6.1)")
    region, array = _fresh_mapping(SIZE)
    values = np.random.default_rng(0).integers(0, 255, SIZE, dtype=np.uint8)
    array[:] = values
    address = array.ctypes.data
    assert anon_huge_bytes(address, SIZE) == 0 or thp_mode() == "always"
    result = back_with_huge_pages([(address, SIZE)])
    # The pages it fills whole (a mapping is 4 KB aligned, not 2 MB).
    assert result.error is None and result.collapsed >= SIZE - 2 * PAGE
    assert anon_huge_bytes(address, SIZE) >= SIZE - 2 * PAGE
    np.testing.assert_array_equal(array, values)  # same addresses, same bytes
    del array
    region.close()


def _worker(path: str, spec: dict | None = None):
    from fastdeploy.engine.arg_utils import EngineArgs
    from fastdeploy.worker.worker import Worker

    config = EngineArgs(model=path, kv_cache_memory_bytes=64 * MB, dtype="float32", block_size=16,
                        skip_tokenizer_init=True, speculative_config=spec).create_engine_config()
    worker = Worker(config)
    worker.load_model()
    return worker


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


@needs_thp
@pytest.mark.parametrize("method", ["draft_model", "mtp"])
def test_a_workers_weights_are_in_huge_pages(tiny_llama, mtp_checkpoint, tmp_path, monkeypatch, method):  # noqa: F811
    if not _collapse_works():
        pytest.skip("MADV_COLLAPSE is refused here (a kernel before 6.1)")
    monkeypatch.setattr(huge_pages, "MIN_MODEL_BYTES", 0)  # the tiny model stands in for a real one
    from fastdeploy.worker import model_runner

    asked: list[tuple[int, int]] = []  # what the runner collapses (a tiny model's tensors share 2 MB pages)
    monkeypatch.setattr(model_runner, "back_with_huge_pages",
                        lambda buffers: asked.extend(buffers) or back_with_huge_pages(buffers))
    if method == "draft_model":
        draft = build_tiny_checkpoint("LlamaForCausalLM", tmp_path, seed=1)
        worker = _worker(tiny_llama, {"method": method, "model": draft, "num_speculative_tokens": 2})
        proposer = worker.model_runner.drafter.draft_model.model
    else:
        worker = _worker(mtp_checkpoint[0], {"method": method, "num_speculative_tokens": 1})
        proposer = worker.model_runner.drafter.mtp.mtp
    assert worker.model_runner.huge_pages
    # The target's weights and the proposer's (each step streams both).
    for model in (worker.model_runner.model, proposer):
        weights = tensor_buffers([model])
        assert set(weights) <= set(asked)
        # All but those in a mapping's first or last partial 2 MB (which stay in 4 KB pages).
        huge = sum(size for address, size in weights if anon_huge_bytes(address, size) > 0)
        assert huge >= 0.5 * sum(size for _, size in weights)


def test_a_model_small_enough_for_the_tlb_keeps_4k_pages(tiny_llama):
    worker = _worker(tiny_llama)
    assert sum(size for _, size in tensor_buffers([worker.model_runner.model])) < huge_pages.MIN_MODEL_BYTES
    assert not worker.model_runner.huge_pages


def test_the_platform_turns_huge_pages_on_where_the_kernel_offers_them():
    from fastdeploy.platforms import current_platform

    backend = current_platform.get_op_backend()
    if os.environ.get("FD_CPU_HUGE_PAGES") in (None, "", "1"):
        assert backend.huge_pages == (thp_mode() in ("always", "madvise"))
    assert f"huge pages: {'on' if backend.huge_pages else 'off'}" in backend.describe()


def test_the_switch_turns_huge_pages_off():
    code = "from fastdeploy.platforms import current_platform as p; print(p.get_op_backend().huge_pages)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FD_CPU_HUGE_PAGES": "0"},
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "False"
