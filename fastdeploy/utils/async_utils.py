"""asyncio helpers for the server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncGenerator[tuple[int, T], None]:
    """Yield ``(index, item)`` from several async iterators as items arrive.

    Closing the merged generator (or cancelling its consumer) cancels the pending
    reads and closes every source iterator, so the requests behind them are aborted.
    """
    if len(iterators) == 1:
        # The common case needs no tasks.
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await _aclose(iterators[0])
        return
    loop = asyncio.get_running_loop()
    pending = {loop.create_task(anext(it)): i for i, it in enumerate(iterators)}  # type: ignore[arg-type]
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[loop.create_task(anext(iterators[i]))] = i  # type: ignore[arg-type]
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        # Let the cancelled reads unwind (their generators abort their requests) before closing.
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await _aclose(it)


async def _aclose(iterator: AsyncIterator) -> None:
    close = getattr(iterator, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await close()
