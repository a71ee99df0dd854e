"""How many calls of one method run at once while several threads call into the object that
owns it: the tests of calls from two threads (an LLM's engine, a Runner's static buffers)."""

from __future__ import annotations

import threading
from typing import Callable


def most_at_once(owner, name: str, calls: list[Callable[[], None]], join_s: float = 120) -> int:
    """Run each of `calls` on a thread of its own while owner.name is watched; the most calls
    of it seen inside at once. The first call inside holds on until a second joins it (or two
    seconds pass), so calls that may overlap do."""
    real = getattr(owner, name)
    inside, most, second_in = [], [], threading.Event()

    def watched(*args, **kwargs):
        inside.append(1)
        most.append(len(inside))
        if len(inside) == 2:
            second_in.set()
        else:
            second_in.wait(2)
        try:
            return real(*args, **kwargs)
        finally:
            inside.pop()

    setattr(owner, name, watched)
    try:
        threads = [threading.Thread(target=call) for call in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join(join_s)
    finally:
        delattr(owner, name)  # the instance's watcher gone: the class's method again
    return max(most)
