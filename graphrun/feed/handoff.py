"""Hand-offs between the feed's threads: the free host slots, and a read-ahead iterator."""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator

_DONE = object()


class Closed(Exception):
    """The slot pool was closed while the stager waited for a slot: the run is ending."""


class SlotPool:
    """The free host slots. The stager takes one per batch, the completer gives it back."""

    def __init__(self, size: int):
        self.size = size
        self._free: queue.Queue = queue.Queue()
        for slot in range(size):
            self._free.put(slot)
        self._closed = threading.Event()

    def acquire(self) -> int:
        while True:
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                if self._closed.is_set():
                    raise Closed from None

    def release(self, slot: int) -> None:
        self._free.put(slot)

    def close(self) -> None:
        self._closed.set()


class Prefetch:
    """Iterate `source` on a background thread, `depth` items ahead. An exception raised by the
    source (a bad record with on_bad_record: error) is re-raised here, in order."""

    def __init__(self, source: Iterable, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(iter(source),),
                                        name="graphrun-stager", daemon=True)
        self._thread.start()

    def _fill(self, it: Iterator) -> None:
        try:
            for item in it:
                if not self._put((True, item)):
                    return
        except Closed:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, in order
            self._put((False, exc))
            return
        self._put((True, _DONE))

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self):
        ok, item = self._queue.get()
        if not ok:
            raise item
        if item is _DONE:
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
