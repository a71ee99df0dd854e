"""JSONL blocks parsed and checked in child processes, handed back in file order.

A JSONL block is parsed by orjson and converted by numpy while holding the GIL: on the reader's
thread that caps the rate and takes the GIL from the thread launching the graphs. So, for a file
big enough to pay for starting them (tuning.jsonl_workers_min_bytes), blocks go to
tuning.jsonl_workers child processes, each running what the reader would
(jsonl_parse.parse_block, then checks.precheck), and the reader gets Prechecked chunks back,
in order.

The children are plain interpreters (`python -I -c`), not multiprocessing's: nothing of the
caller's __main__ is imported again, nothing is forked from a process with threads and a CUDA
context. They speak length-prefixed pickles over their stdin and stdout: the spec first, then
one block at a time; each has one block at most, so neither side can block the other for good.
A child that fails or dies costs only speed: its block, and every block after it, is parsed
here instead, where an error is raised as it would have been.
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import struct
import subprocess
import sys
from collections import deque
from typing import Callable, Iterable, Iterator

from graphrun.read.ahead import ahead_map
from graphrun.read.formats.jsonl_parse import parse_block
from graphrun.read.checks import precheck
from graphrun.base.tuning import Tuning

_HEADER = struct.Struct("<Q")

# The child: the caller's sys.path (graphrun may be a checkout on PYTHONPATH, which -I ignores),
# then serve(). What it prints goes to stderr: its stdout carries the results.
_CHILD = ("import os, signal, sys\n"
          "signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller stops it, Ctrl-C or not\n"
          "sys.path[:0] = bytes.fromhex(sys.argv[1]).decode().split(os.pathsep)\n"
          "out = os.fdopen(os.dup(1), 'wb')\n"
          "os.dup2(2, 1)\n"
          "from graphrun.read.formats.jsonl_workers import serve\n"
          "serve(sys.stdin.buffer, out)\n")


def _send(f, obj) -> None:
    data = pickle.dumps(obj, protocol=5)
    f.write(_HEADER.pack(len(data)))
    f.write(data)
    f.flush()


def _recv(f):
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("the other side closed")
    (n,) = _HEADER.unpack(head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError("the other side closed mid-message")
    return pickle.loads(data)


def serve(inp, out) -> None:
    """A child's loop: the spec, then (file, lines, linenos, first) blocks until EOF; for each,
    (True, Prechecked) or (False, why) where parsing raised."""
    try:
        spec = _recv(inp)
        while True:
            block = _recv(inp)
            try:
                result = (True, precheck(spec, parse_block(spec, block)))
            except Exception as e:  # noqa: BLE001 - the caller parses this block itself
                result = (False, f"{type(e).__name__}: {e}")
            _send(out, result)
    except (EOFError, BrokenPipeError):
        return


def _parse_and_precheck(spec, block: tuple):
    """What a child does with a block, on a pool thread of this process."""
    return precheck(spec, parse_block(spec, block))


class ParseWorkers:
    """`count` children parsing blocks for `parse_here`'s caller; map() hands the results back
    in order. close() ends them (always: at the end, on an error, when the caller stops)."""

    def __init__(self, spec, count: int, parse_here: Callable):
        self.parse_here = parse_here
        self.broken = False
        path = os.pathsep.join(p for p in sys.path if p).encode().hex()
        self.procs: list[subprocess.Popen] = []
        try:
            for _ in range(count):
                proc = subprocess.Popen([sys.executable, "-I", "-c", _CHILD, path],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL)
                self.procs.append(proc)
                _send(proc.stdin, spec)
        except BaseException:
            self.close()
            raise

    def map(self, blocks: Iterable[tuple]) -> Iterator:
        """Each block's Prechecked chunk (or, parsed here, its Candidates), in order."""
        n = len(self.procs)
        pending: deque[tuple[int, tuple]] = deque()  # (child, block), oldest first
        k = 0
        for block in blocks:
            if len(pending) == n:  # the child of the block now sent is free once this is in
                yield self._result(*pending.popleft())
            child = k % n
            k += 1
            if self.broken or not self._give(child, block):
                pending.append((-1, block))  # parsed here, in its turn
            else:
                pending.append((child, block))
        while pending:
            yield self._result(*pending.popleft())

    def _give(self, child: int, block: tuple) -> bool:
        try:
            _send(self.procs[child].stdin, block)
            return True
        except OSError:  # the child is gone: from now on every block is parsed here
            self.broken = True
            return False

    def _result(self, child: int, block: tuple):
        if child >= 0 and not self.broken:
            try:
                ok, value = _recv(self.procs[child].stdout)
                if ok:
                    return value
            except Exception:  # noqa: BLE001 - gone, or what it sent cannot be read
                self.broken = True
        return self.parse_here(block)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            proc.wait()
        self.procs = []


def parse_blocks(spec, size: int, blocks: Iterable[tuple], parse_here: Callable,
                 tuning: Tuning) -> Iterator:
    """The parsed blocks, in order: by children where tuning.jsonl_workers and the file's size
    (in bytes) call for them and an interpreter can be started, else here: data.text's on
    tuning.text_threads threads ahead of the caller (the tokenizer runs off the GIL), the
    rest on the caller's thread."""
    if (tuning.jsonl_workers < 1 or size < tuning.jsonl_workers_min_bytes
            or not sys.executable):
        if spec.data.text is not None and tuning.text_threads > 0:
            yield from ahead_map(functools.partial(_parse_and_precheck, spec), blocks,
                                 tuning.text_threads, tuning.text_ahead, "graphrun-tokenize")
        else:
            yield from map(parse_here, blocks)
        return
    workers = None
    blocks = iter(blocks)
    try:
        first = next(blocks, None)
        if first is None:
            return
        try:
            workers = ParseWorkers(spec, tuning.jsonl_workers, parse_here)
        except OSError:  # no interpreter to start (embedded, no processes left): parse here
            yield parse_here(first)
            yield from map(parse_here, blocks)
            return
        yield from workers.map(itertools.chain([first], blocks))
    finally:
        if workers is not None:
            workers.close()
