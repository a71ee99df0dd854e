"""Every GRAPHRUN_* environment variable graphrun reads: its default and what it means.

A variable unset or empty takes its default. Read through get() and integer(), which refuse
names not listed here, so this table stays the whole list.
"""

from __future__ import annotations

import os

from graphrun.base.errors import GraphrunError

# name -> (default, meaning)
VARIABLES: dict[str, tuple[str, str]] = {
    "GRAPHRUN_OVERLAP": (
        "auto", "the streaming path: on (threads side by side), off (serial), auto (on for "
                "CUDA and for generation, off for a forward pass on the CPU)"),
    "GRAPHRUN_PARQUET_THREADS": (
        "cores - 4, 2 to 12", "threads decoding Parquet row groups at once"),
    "GRAPHRUN_JSONL_WORKERS": (
        "cores - 4, at most 8; 0 under 6 cores", "child processes parsing JSONL blocks"),
    "GRAPHRUN_TEXT_THREADS": (
        "cores, at most 2", "threads parsing and tokenizing data.text's JSONL blocks ahead of "
                            "the stream, where no child process does (0: on the stream's thread)"),
    "GRAPHRUN_READ_AHEAD_BYTES": (
        "268435456; 0 under 6 cores", "bytes of batches read ahead of the stream, during setup "
                                      "too (0: the next batch only)"),
    "GRAPHRUN_ROW_WRITERS": (
        "cores, at most 4", "threads writing the rows of big npy output batches"),
    "GRAPHRUN_ROW_POOL_BYTES": (
        "1048576", "npy output batches of at least this many bytes go to those threads"),
    "GRAPHRUN_HASH_CACHE": (
        "$XDG_CACHE_HOME/graphrun, else ~/.cache/graphrun", "the folder of the sha256 digests "
        "of large input and model files, kept by path, size, modification time and inode so "
        "that a file unchanged since a run is not read again to hash it (off: none kept)"),
    "GRAPHRUN_SLOW_EXIT": (
        "0", "1: the command line exits through the interpreter's teardown (exit hooks, module "
             "cleanup) instead of ending the process once its work is done and flushed"),
    "GRAPHRUN_KERNEL_WARM_UP": (
        "on", "a generation job's kernels (Triton's paged decode, the first attention and "
              "matmul) warmed on a thread while the weights load (off: the graphs' set-up "
              "compiles them, as without it; for comparisons)"),
    "GRAPHRUN_JOB_PARENT": (
        "", "set by `graphrun run --gpus N` in the worker processes it starts: its pid (it "
            "prepared the output folder and merges the workers' manifests)"),
}


def get(name: str, environ=None) -> str:
    """The variable's value, stripped; "" where unset (its default applies)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not listed in graphrun/base/envs.py")
    return (os.environ if environ is None else environ).get(name, "").strip()


def integer(name: str, default: int, minimum: int = 0, environ=None) -> int:
    """The variable as an integer of at least `minimum`, else `default` where unset."""
    text = get(name, environ)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise GraphrunError(f"{name}={text!r} is not an integer of at least {minimum}; set one "
                            "or unset it")
    return value


def switch(name: str, default: bool, environ=None) -> bool:
    """The variable as on (True) or off (False), else `default` where unset."""
    text = get(name, environ).lower()
    if not text:
        return default
    if text not in ("on", "off"):
        raise GraphrunError(f"{name}={text!r}: set on or off, or unset it")
    return text == "on"
