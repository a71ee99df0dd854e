"""The device's start beside the rest of setup: the driver, the CUDA context and cuBLAS, made on
a thread.

Starting the driver (cuInit, called so that the GIL is let go meanwhile), creating the context
and loading cuBLAS is the driver's and the library's work; on the main thread it would wait in
line before the model's build, while the engine's imports, a model library's import
(transformers), the output folder's preparation and the reader's start can run meanwhile. The
Runner then waits for it ("cuda context" in the manifest's phases: only the wait is left).

    start = DeviceStart.begin(spec)       # as soon as the spec is known
    ...                                   # anything else; the thread runs meanwhile
    device = start.wait()                 # Runner: the device, its context made (or the error)
"""

from __future__ import annotations

import threading

import torch

from graphrun.engine.device import resolve_device
from graphrun.engine.driver import start_driver


_BEGUN: dict[str, "DeviceStart"] = {}  # by the spec's device name: once per process
_LOCK = threading.Lock()


class DeviceStart:
    """The spec's device resolved and, for CUDA, its context and first matmul made, on a daemon
    thread."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype
        self.device: torch.device | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, name="graphrun-device-start",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def begin(cls, spec) -> "DeviceStart | None":
        """The start of the spec's device, begun at the first call for it in this process (the
        CLI's, before its imports; else the run's): the driver and a context are the process's,
        made once. None where the spec asks for the CPU (nothing to start there)."""
        if spec.device == "cpu":
            return None
        with _LOCK:
            if spec.device not in _BEGUN:
                _BEGUN[spec.device] = cls(spec.device, getattr(torch, spec.model.dtype))
            return _BEGUN[spec.device]

    def _start(self) -> None:
        try:
            start_driver()
            self.device = device = resolve_device(self.name)
            if device.type == "cuda":
                with torch.cuda.device(device):
                    a = torch.ones(8, 8, device=device, dtype=self.dtype)  # the context
                    (a @ a).sum().item()  # cuBLAS's handle, kept in torch's pool for the run
        except BaseException as err:  # noqa: BLE001 - re-raised on the waiting thread
            self.error = err

    def wait(self) -> torch.device:
        """The device once started; what failed there (a device that does not exist, a
        driver error) raises here, on the caller's thread."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.device
