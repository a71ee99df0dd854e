"""An ordered map computed ahead of its consumer on a few threads: the text reader's chunks
tokenized while the stream takes the batches of those before (read/text.py says why threads).

fn(item) runs on `threads` pool threads for up to `depth` items past the one the consumer
waits for; results come back in the items' order, and an exception fn raised is raised by the
next() that reaches its item, after the results before it, as map() would raise it. The items
iterator itself is advanced on the consumer's thread (a file's lines are read there, in order);
its own error is raised after the results of the items before it.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator


def ahead_map(fn: Callable, items: Iterable, threads: int, depth: int,
              name: str = "graphrun-ahead") -> Iterator:
    """fn over items, in order, up to `depth` (at least `threads`) items ahead."""
    depth = max(depth, threads, 1)
    items = iter(items)
    pending: deque = deque()
    pool = ThreadPoolExecutor(max(threads, 1), thread_name_prefix=name)
    try:
        while True:
            try:
                item = next(items)
            except StopIteration:
                break
            except Exception:  # the items read before it are handed out first, as by map()
                while pending:
                    yield pending.popleft().result()
                raise
            pending.append(pool.submit(fn, item))
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # stopped early (closed, an error): what is queued is dropped, a running item ends
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
