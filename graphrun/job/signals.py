"""SIGINT and SIGTERM during a run: stop at once in setup, after the batch in flight while
streaming, and never while the run commits and writes its manifest."""

from __future__ import annotations

import signal
import threading


class SignalTrap:
    """Inside `with`, SIGINT and SIGTERM go to _handle (on the main thread, where Python takes
    signals); the handlers from before are put back after."""

    def __init__(self):
        self.signum = 0
        self._old = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


class StopSignals(SignalTrap):
    """SIGINT/SIGTERM set a flag; the loop finishes the batch in flight, commits and stops.
    A second signal stops at once (KeyboardInterrupt), except after hold(): from there on the
    run only commits and writes its manifest, which must not be cut short."""

    def __init__(self):
        super().__init__()
        self._held = False
        self._streaming = False

    def _handle(self, signum, frame) -> None:
        first = not self.signum
        self.signum = signum  # the latest: the exit code names the signal that stopped the run
        # during setup (nothing to finish) or a second signal: stop now
        if (not first or not self._streaming) and not self._held:
            raise KeyboardInterrupt

    def streaming(self) -> None:
        self._streaming = True

    def hold(self) -> None:
        self._held = True
