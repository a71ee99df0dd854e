"""The errors a user can cause. Each says what went wrong, where, and what to do.

The CLI prints ``str(err)`` and exits non-zero without a traceback (unless ``--debug``);
anything that is not a GraphrunError is a bug in graphrun and keeps its traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


class GraphrunError(Exception):
    """Base of every error a user can cause."""

    exit_code = 2


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where (file:line:col or an override) and what."""

    where: str  # "pipelines/x.yaml:14:7" or "--set capture.warmup_iters=x"
    path: str  # dotted key path, "buckets.batch[2]"; "" for the whole file
    message: str

    def __str__(self) -> str:
        head = f"{self.where}: " if self.where else ""
        key = f"{self.path}: " if self.path else ""
        return f"{head}{key}{self.message}"


class SpecError(GraphrunError):
    """The pipeline spec is invalid; carries every problem found, not only the first."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class InputError(GraphrunError):
    """A record of the input file cannot be used (or the file cannot be read)."""

    def __init__(self, message: str, *, where: str = "", record_id=None):
        self.where = where
        self.record_id = record_id
        head = f"{where}: " if where else ""
        rid = f"record {record_id!r}: " if record_id is not None else ""
        super().__init__(f"{head}{rid}{message}")


class ModelError(GraphrunError):
    """The model cannot be built or loaded (bad target, archive, weights, arguments)."""


class GenerationError(ModelError):
    """The model, its settings or the generation asked for cannot generate as asked: the
    message names what (the class, the row count, the value) and what to do."""


class CaptureError(GraphrunError):
    """A bucket could not be captured or replayed, or its replay disagrees with eager."""

    def __init__(self, message: str, *, bucket: str = "", remedies: list[str] | None = None):
        self.bucket, self.message = bucket, message  # the message: without bucket or remedies
        self.remedies = list(remedies or [])
        text = f"bucket {bucket}: {message}" if bucket else message
        if self.remedies:
            text += "\n" + "\n".join(f"  {i}. {r}" for i, r in enumerate(self.remedies, 1))
        super().__init__(text)


class OutputError(GraphrunError):
    """The output folder cannot be used as asked (exists, belongs to another run, ...)."""


class Interrupted(GraphrunError):
    """The run was stopped by SIGINT or SIGTERM after committing what was complete."""

    def __init__(self, signum: int, after: str = "finished shards are committed; run again "
                 "with --resume to continue"):
        import signal

        self.signum = signum
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}: {after}")


_debug = False  # one process's --debug: user errors keep their tracebacks


def debugging() -> bool:
    """--debug was given (the command line sets it; workers it starts inherit it)."""
    return _debug


def set_debugging(on: bool) -> None:
    global _debug
    _debug = on


def first_message(err: BaseException) -> str:
    """The first line of an exception's message; "" for an exception raised without one."""
    text = str(err).strip()
    return text.splitlines()[0].rstrip() if text else ""


def first_line(err: BaseException, limit: int = 300) -> str:
    """An exception in one line for a manifest or a log: its type and its message's first line,
    not a stack."""
    message = first_message(err)
    return (f"{type(err).__name__}: {message}" if message else type(err).__name__)[:limit]


def error_chain(exc: BaseException | None) -> list[BaseException]:
    """exc and the errors chained to it (raised while it was handled, or `from` it), each once,
    outermost first. A wrapper's `cause` (Ray's error for an actor's) is followed first."""
    chain: list[BaseException] = []
    while exc is not None and not any(exc is seen for seen in chain):
        chain.append(exc)
        cause = getattr(exc, "cause", None)
        exc = cause if isinstance(cause, BaseException) else (exc.__context__ or exc.__cause__)
    return chain
