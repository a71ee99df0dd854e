"""The CUDA driver's start (cuInit), with no torch: the CLI begins it on a thread before torch's
import, so that the driver starts while the interpreter imports (device_start.py's thread then
finds it started; cuInit is safe to call again, from any thread, and returns once it is done).
"""

from __future__ import annotations

import ctypes
import threading


def start_driver() -> None:
    """cuInit through ctypes, which lets go of the GIL while the driver starts (torch's own call,
    in torch.cuda.is_available(), holds it: the main thread would stop meanwhile); torch's call
    then finds the driver started. Without libcuda, torch finds no CUDA, as it would."""
    try:
        ctypes.CDLL("libcuda.so.1").cuInit(0)
    except (OSError, AttributeError):
        pass


def start_driver_beside() -> None:
    """start_driver on a daemon thread: nothing waits for it but the device's own start."""
    threading.Thread(target=start_driver, name="graphrun-cuinit", daemon=True).start()


def driver_present() -> bool:
    """Whether an NVIDIA driver is installed (libcuda loads), asked without starting it and
    without torch, whose own question (torch.cuda.is_available) starts the driver holding the
    GIL."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def gpu_possible(device: str) -> bool:
    """Whether a spec's device (cuda, cpu or auto) may turn out a GPU, asked without torch and
    without starting the driver: what the CPU's runs need not prepare for."""
    return device != "cpu" and (device != "auto" or driver_present())
