"""Whether a family of graphrun's Triton kernels runs in this process: the switch the paged
decode attention (models/causal/paged_attention.py), the fused elementwise ops
(models/causal/fused.py) and the pick (generate/sampling.py) each keep one of.

A family runs on a GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1), with its
module importable, until one of its kernels fails (give_up): from then on, for the rest of the
process, its torch ops. The module is imported on first use, so a job that never runs the
kernels never imports Triton. No torch: a device is read by its type.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from types import ModuleType

from graphrun.base.errors import first_line


class KernelFailures:
    """Why a kernel failed in this process: the first is the reason, and none is tried again
    (give_up). The Triton families' switches below, and the prefill's flash attention
    (models/causal/packed_attention.py), keep one each."""

    def __init__(self):
        self.failures: list[str] = []

    def give_up(self, err: BaseException) -> None:
        """A kernel failed (or computed other values than the torch ops): the torch ops from
        now on, in this process."""
        self.failures.append(first_line(err))

    def failure(self) -> str | None:
        """Why the kernels are no longer used in this process, or None."""
        return self.failures[0] if self.failures else None


class KernelSwitch(KernelFailures):
    """One family's switch: its kernels' module (by name, imported on first use) and why its
    kernels failed in this process (KernelFailures)."""

    def __init__(self, module: str):
        super().__init__()
        self.module = module

    @functools.cached_property
    def kernels(self) -> ModuleType | None:
        """The kernels' module, or None without Triton."""
        try:
            return importlib.import_module(self.module)
        except ImportError:
            return None

    def on(self, device) -> bool:
        """Whether the kernels run on `device` (a torch.device): a GPU, or the CPU under
        Triton's interpreter, while none has failed, with Triton importable."""
        here = device.type == "cuda" or (device.type == "cpu"
                                         and os.environ.get("TRITON_INTERPRET") == "1")
        return here and not self.failures and self.kernels is not None


_PREFETCH_LOCK = threading.Lock()  # one prefetch a process; a second caller waits for it
_prefetched: list[bool] = []  # its result, once done


def prefetch() -> bool:
    """Triton imported and its cache key computed: both once per process, and both what the
    first kernel's launch would otherwise pay before it looks in the compile cache (the key is
    a hash of Triton's own files, its libtriton of some 400 MB among them: about half a
    second, with the GIL let go). Neither needs the device or torch. A call while another
    thread's is under way waits for it (prefetch_beside's thread, begun before torch's
    import). False without Triton; a Triton whose key lives elsewhere is only imported."""
    with _PREFETCH_LOCK:
        if not _prefetched:
            _prefetched.append(_prefetch())
        return _prefetched[0]


def prefetch_beside() -> None:
    """prefetch() on a daemon thread, begun before torch's import: the key's hash then runs
    while the interpreter imports torch, not after it, on the kernels' warm-up thread."""
    threading.Thread(target=prefetch, name="graphrun-triton-prefetch", daemon=True).start()


def _prefetch() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return True
    triton_key()
    return True
