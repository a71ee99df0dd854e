"""The CPU cores this process may run on, which the thread and process pools are sized by."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset),
    where the system has one, else every core (os.cpu_count counts the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1
