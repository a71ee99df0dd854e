"""The command line's exit: once a command is done and its output flushed, the process ends with
os._exit, skipping the interpreter's teardown (the CUDA context, torch's exit hooks, module
cleanup), which does no work of graphrun's: every file is closed and the manifest written by then.

It falls back to the normal exit whenever the teardown could matter: GRAPHRUN_SLOW_EXIT=1, a
child process still alive (a reader pool's, a hash's, a Ray node's), a thread that is not a
daemon still running, or Ray joined (its exit hook leaves the cluster).
"""

from __future__ import annotations

import os
import sys
import threading


def normal_exit_reason() -> str | None:
    """Why the normal exit must run, or None where os._exit is safe."""
    from graphrun.base import envs

    if envs.get("GRAPHRUN_SLOW_EXIT") not in ("", "0"):
        return "GRAPHRUN_SLOW_EXIT is set"
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return "Ray is joined"
    if "multiprocessing" in sys.modules:
        import multiprocessing

        if multiprocessing.active_children():  # also reaps the ones that have ended
            return "a multiprocessing child is alive"
    if _child_pids():
        return "a child process is alive"
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return "a thread that is not a daemon is running"
    return None


def _child_pids() -> list[int]:
    """This process's children (zombies included) from /proc; [] where /proc is missing."""
    me, found = os.getpid(), []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile, or not ours to read
        if ppid == me:
            found.append(int(name))
    return found


def finish(code) -> None:
    """End the process with `code` (a SystemExit's) now, where that is safe; else return, and
    the caller exits normally."""
    if code is None:
        code = 0
    if not isinstance(code, int) or normal_exit_reason() is not None:
        return
    try:
        import logging

        logging.shutdown()  # flush the handlers' streams and files
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except Exception:  # noqa: BLE001 - a closed pipe (| head): the normal exit reports it
        return
    os._exit(code & 0xFF)
