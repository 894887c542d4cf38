"""Transparent huge pages (Linux) for the memory every decode step streams: the weights.

A decode step reads every weight once, in 4 KB pages unless told
otherwise: Linux gives an anonymous mapping 2 MB pages only where the process asks
(``madvise(MADV_HUGEPAGE)``) when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise``,
as it is on Debian and these machines. Each 4 KB of a stream then costs a TLB miss and a page walk.
Measured on a Sapphire Rapids core (one thread, 330 tokens of context;
``benchmarks/benchmark_huge_pages.py``), weights in 2 MB pages made a one-sequence decode step
11-13% faster (the default model's GGUF and its weights in bf16); a 16-sequence step, bound by
compute and the KV cache, stayed level.

Weights are already written when the model runner has loaded them, so their pages are collapsed in place
(``MADV_COLLAPSE``, Linux 6.1+; the contents move to 2 MB pages at the same addresses). The KV cache
keeps 4 KB pages: advised, its blocks' first writes faulted in whole 2 MB pages inside the serving
steps (see ``ModelRunner``). Only private anonymous memory is collapsed, in whole 2 MB-aligned pages: a
range that reaches past a small tensor covers its neighbours' bytes too, which changes nothing for
them but their page size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_PAGE_BYTES = 2 << 20
# Weights below this are left in 4 KB pages: the second-level TLB's 4 KB
# entries (1,536-2,048 on recent x86 cores) already reach 6-8 MB, and collapsing costs a copy into
# fresh pages (a test suite's tiny models loaded 17% slower with it).
MIN_MODEL_BYTES = 16 << 20
# <linux/mman.h> (asm-generic): the same numbers on x86-64 and aarch64.
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's transparent-huge-page mode: "always", "madvise", "never", or "unavailable" (no such file)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


@cache
def _madvise() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _advise(start: int, length: int, advice: int) -> int:
    """madvise; 0 or the errno."""
    return 0 if _madvise()(start, length, advice) == 0 else ctypes.get_errno()


def private_anonymous_ranges(maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """This process's writable private anonymous mappings (the heap included), as [start, end) pairs."""
    ranges = []
    with open(maps, encoding="ascii", errors="replace") as f:
        for line in f:
            fields = line.split()
            perms, name = fields[1], (fields[5] if len(fields) > 5 else "")
            if perms.startswith("rw") and perms[3] == "p" and name in ("", "[heap]"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def huge_page_spans(buffers: Iterable[tuple[int, int]], anonymous: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The 2 MB pages ``buffers`` ((address, bytes) pairs) touch, merged and clipped to the whole pages
    of ``anonymous`` (small buffers share pages)."""
    page = HUGE_PAGE_BYTES
    spans: list[list[int]] = []
    for address, size in sorted(buffers):
        if size <= 0:
            continue
        start, end = address // page * page, -(-(address + size) // page) * page
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    clipped = []
    for start, end in spans:
        for a_start, a_end in anonymous:
            lo, hi = max(start, -(-a_start // page) * page), min(end, a_end // page * page)
            if lo < hi:
                clipped.append((lo, hi))
    return clipped


def tensor_buffers(objects: Iterable[Any]) -> list[tuple[int, int]]:
    """(address, bytes) of every CPU tensor held by ``objects``: paddle Layers (every sublayer's parameters,
    buffers and attributes, through tuples, lists and dicts, e.g. packed kernel weights) or tensors."""
    import paddle

    found: dict[int, int] = {}

    def walk(obj: Any, depth: int) -> None:
        if isinstance(obj, paddle.Tensor):
            if obj.place.is_cpu_place() and obj._is_initialized():
                size = int(obj.numel()) * obj.element_size()
                if size > 0:
                    found[obj.data_ptr()] = max(found.get(obj.data_ptr(), 0), size)
        elif depth < 4 and isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, depth + 1)
        elif depth < 4 and isinstance(obj, dict):
            for item in obj.values():
                walk(item, depth + 1)

    for obj in objects:
        if isinstance(obj, paddle.nn.Layer):
            for layer in obj.sublayers(include_self=True):
                walk(vars(layer), 0)
        else:
            walk(obj, 0)
    return sorted(found.items())


@dataclass
class HugePageResult:
    """What one call moved to 2 MB pages, in bytes."""

    collapsed: int = 0
    # The first errno that left a span in 4 KB pages (e.g. EINVAL: a kernel before 6.1 has no MADV_COLLAPSE).
    error: str | None = None


def back_with_huge_pages(buffers: Iterable[tuple[int, int]]) -> HugePageResult:
    """Move the 2 MB pages that written ``buffers`` touch to huge pages, in place.

    Failures are not errors (the memory keeps working in 4 KB pages); the first is reported.
    """
    result = HugePageResult()
    for start, end in huge_page_spans(buffers, private_anonymous_ranges()):
        code = _advise(start, end - start, MADV_HUGEPAGE)
        if code == 0:
            code = _advise(start, end - start, MADV_COLLAPSE)
        if code == 0:
            result.collapsed += end - start
        else:
            result.error = result.error or errno.errorcode.get(code, str(code))
    return result

