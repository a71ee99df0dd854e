"""The scheduler's thread: a generation job's place in the feed (feed/protocols.py's Engine), as
the Launcher is a forward pass's.

The feed's three steps keep their threads: the stager hands each part's prompts (token ids from
data.text, read and tokenized by read/) to stage(); launch() hands them to the engine's
scheduler (generate/engine.py's serve), which runs on a thread of its own (graphrun-scheduler):
it admits prompts whenever decode slots free up, from every part handed over so far, so a
part's records finish out of order and among other parts' records; the completer waits for
each part in input order (a Part: the completions of its records, filled as they finish),
decodes the new tokens to text and writes the records. Parts in flight are bounded by the feed
(make_room), so memory stays flat whatever the job's size.
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from graphrun.engine.buckets import Bucket
from graphrun.engine.launch import slot_count
from graphrun.generate.config import Completion
from graphrun.generate.engine import Engine, Finished, Request
from graphrun.generate.records import LOGPROB_OUTPUTS, SAMPLES_OUTPUT
from graphrun.spec.generate import PROMPT_AXIS
from graphrun.spec.keys import BATCH
from graphrun.spec.request import REQUEST_FIELD

_END = object()  # the scheduler's input is over


@dataclass
class PartRows:
    """What ran on one part size: the manifest's bucket row."""

    batches: int = 0
    records: int = 0


class Part:
    """A launched part: its records' completions (n samples each), filled by the scheduler as
    they finish; result() waits for the last, decodes their text (the completer's thread) and
    hands back the rows to write."""

    def __init__(self, samples: list[int], decode_text, token_text=None,
                 with_samples: bool = False):
        self.token_text = token_text  # one token id -> its text, where logprobs are written
        self.completions: list[list[Completion | None]] = [[None] * k for k in samples]
        self.left = sum(samples)
        self.with_samples = with_samples  # the rows carry every sample (SAMPLES_OUTPUT)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.decode_text = decode_text
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}

    def finished(self, i: int, completion: Completion) -> None:
        self.completions[i][completion.sample] = completion
        self.left -= 1
        if not self.left:
            self.times["e2e"] = (time.perf_counter() - self.t0) * 1e6
            self.done.set()

    def failed(self, err: BaseException) -> None:
        self.error = err
        self.done.set()

    def wait(self) -> dict[str, float]:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.times

    def result(self) -> tuple[dict, dict[str, float]]:
        """The records' rows: each field of sample 0, output_tokens summed over the samples,
        and with_samples every sample's own (token_ids, text, finish_reason, output_tokens)."""
        self.wait()
        texts = [[self.decode_text(c.token_ids) if c.text is None else c.text for c in samples]
                 for samples in self.completions]
        done = [samples[0] for samples in self.completions]
        outs = {"token_ids": [np.asarray(c.token_ids, dtype=np.int64) for c in done],
                "text": np.array([t[0] for t in texts], dtype=str),
                "finish_reason": np.array([c.finish_reason for c in done], dtype=str),
                "prompt_tokens": np.array([c.prompt_tokens for c in done], dtype=np.int64),
                "output_tokens": np.array([sum(c.output_tokens for c in samples)
                                           for samples in self.completions], dtype=np.int64)}
        if self.token_text is not None:
            outs.update(logprob_outputs(done, self.token_text))
        if done and done[0].prompt_logprobs is not None:  # the job's prompts all scored
            outs["prompt_logprobs"] = [np.asarray(c.prompt_logprobs, dtype=np.float32)
                                       for c in done]
        if self.with_samples:
            rows = np.empty(len(done), dtype=object)  # filled one by one: lists stay whole
            for i, (samples, text) in enumerate(zip(self.completions, texts)):
                rows[i] = [{"token_ids": c.token_ids, "text": t, "finish_reason": c.finish_reason,
                            "output_tokens": c.output_tokens,
                            "logprobs": (logprob_outputs([c], self.token_text)
                                         if self.token_text is not None
                                         and c.logprobs is not None else None)}
                           for c, t in zip(samples, text)]
            outs[SAMPLES_OUTPUT] = rows
        return outs, self.times


def logprob_outputs(done: list[Completion], token_text) -> dict[str, list[np.ndarray]]:
    """records.LOGPROB_OUTPUTS of each completion (empty where it asked none)."""
    outs: dict[str, list[np.ndarray]] = {k: [] for k in LOGPROB_OUTPUTS}
    for c in done:
        asked = c.logprobs is not None
        ids = np.asarray(c.token_ids if asked else [], dtype=np.int64)
        k = len(c.top_ids[0]) if asked and c.top_ids else 0
        top = np.asarray(c.top_ids if asked else [], dtype=np.int64).reshape(len(ids), k)
        outs["logprobs"].append(np.asarray(c.logprobs or [], dtype=np.float32))
        outs["tokens"].append(np.array([token_text(int(t)) for t in ids], dtype=str))
        outs["top_token_ids"].append(top)
        outs["top_logprobs"].append(np.asarray(c.top_logprobs if asked else [],
                                               dtype=np.float32).reshape(top.shape))
        outs["top_tokens"].append(np.array([[token_text(int(t)) for t in row] for row in top],
                                           dtype=str).reshape(top.shape))
    return outs


class Scheduler:
    """Parts of record batches in, one Part of completions per launch out (feed/protocols.py's
    Engine); the engine's scheduler loop on a thread of its own, started by the first launch.

    text_decoder() gives token ids -> text (a Part's texts); token_text() one token id -> its
    text, where logprobs are written (else None): asked at each launch, so a tokenizer loads
    only once a part needs it. with_samples: each row carries every sample's fields."""

    def __init__(self, engine: Engine, device: torch.device, *,
                 text_decoder: Callable[[], Callable[[list[int]], str]],
                 token_text: Callable[[], Callable[[int], str]] | None, with_samples: bool):
        self.engine, self.device = engine, device
        self.text_decoder, self.token_text = text_decoder, token_text
        self.with_samples = with_samples
        self.max_batch = engine.slots  # a part is at most the slots
        self.parts: dict[Bucket, PartRows] = {}  # by part size: the manifest's bucket rows
        self._staged: dict[int, tuple[list[list[int]], list, list]] = {}  # feed slot -> part
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # parts' Requests, then _END
        self._spare: list[Request] = []  # taken from the queue, not yet handed over
        self._ended = False  # _END taken
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._inflight: set[Part] = set()  # launched, not yet finished (failed on an error)
        self._lock = threading.Lock()
        self._log = None  # write/finished.FinishedLog: a job's completions kept as they finish

    @property
    def taken_back(self) -> int:
        """Records whose completions finished.jsonl gave back (keep)."""
        return self._log.taken if self._log is not None else 0

    def keep(self, log) -> None:
        """A job's finished.jsonl (write/finished.py): each sample is added to it as it
        finishes, and a record an earlier attempt kept is taken back, not generated again."""
        self._log = log

    # -- the feed's engine ---------------------------------------------------------------------

    def make_room(self, overlap: bool) -> int:
        """Parts in flight at most: overlapped, as many as the feed's host budget holds of a
        part's token ids at their longest (nothing pinned: the prompts go to the scheduler's
        queue); serial, one."""
        return slot_count(self.max_batch * self.engine.max_prompt * 8) if overlap else 1

    def current_stream(self):
        """None: a launch only queues prompts; the scheduler's thread issues the device work."""
        return None

    def device_context(self):
        """Nothing to make current on the launching thread (the scheduler's thread does)."""
        return nullcontext()

    def explain(self, exc: BaseException) -> str | None:
        """None: the engine's own errors say where and what to do."""
        return None

    def stage(self, fields: dict, n: int, lengths: dict, slot: int, ids=None,
              indices=None) -> Bucket:
        """The part's prompts (unpadded token ids), record ids (each record's sampling stream),
        input ordinals (finished.jsonl's keys) and own parameters (where the records carry
        them) kept for its launch; its bucket is its row count."""
        tokens, real = fields["input_ids"], lengths[PROMPT_AXIS]
        prompts = [np.asarray(tokens[i])[:int(real[i])].tolist() for i in range(n)]
        record_ids = list(range(n)) if ids is None else (
            ids.tolist() if isinstance(ids, np.ndarray) else list(ids))
        own = fields.get(REQUEST_FIELD)
        params = [None] * n if own is None else [
            None if own[i] is None or own[i].is_default else own[i] for i in range(n)]
        ordinals = [None] * n if indices is None else [int(k) for k in indices]
        self._staged[slot] = (prompts, record_ids, params, ordinals)
        return Bucket((n,), (BATCH,))

    def launch(self, bucket: Bucket, slot: int, n: int, lengths: dict, *,
               stream=None) -> Part:
        """The part's prompts handed to the scheduler, but for the records finished.jsonl
        gave back; nothing waits here."""
        prompts, record_ids, params, ordinals = self._staged.pop(slot)
        samples = [self.engine.samples_of(p) for p in params]
        part = Part(samples, self.text_decoder(),
                    self.token_text() if self.token_text is not None else None,
                    with_samples=self.with_samples)
        seen = self.parts.setdefault(bucket, PartRows())
        seen.batches += 1
        seen.records += len(prompts)
        asked = []
        for i, (prompt, rid, own, k) in enumerate(zip(prompts, record_ids, params, ordinals)):
            kept = (self._log.take(k, samples[i]) if self._log is not None and k is not None
                    else None)
            if kept is None:
                asked.append(Request(prompt, rid, own, tag=(part, i, k)))
                continue
            for fields in kept:
                part.finished(i, Completion(**fields))
        if not asked:
            return part
        with self._lock:
            if self._error is not None:
                raise self._error
            self._inflight.add(part)
        self._start()
        self._queue.put(asked)
        return part

    def run_rows(self, fields: dict, n: int, lengths: dict, ids=None,
                 indices=None) -> tuple[dict, list]:
        """A part larger than the slots (data.oversize eager): handed over whole, the engine
        admits it as slots free up."""
        bucket = self.stage(fields, n, lengths, -1, ids=ids, indices=indices)
        rows, times = self.launch(bucket, -1, n, lengths).result()
        return rows, [(bucket, times)]

    # -- the scheduler's thread ------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="graphrun-scheduler",
                                            daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        try:
            with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
                self.engine.serve(self._take, self._emit)
        except BaseException as err:  # noqa: BLE001 - raised on the threads waiting for parts
            with self._lock:
                self._error = err
                parts, self._inflight = list(self._inflight), set()
            for part in parts:
                part.failed(err)

    def _take(self, n: int, block: bool) -> list[Request] | None:
        """Up to n requests: a part's arrive together (the queue holds whole parts), so its
        prompts are admitted together where slots allow."""
        got, spare = [], self._spare
        while len(got) < n:
            if not spare and self._ended:
                break
            if not spare:
                try:
                    item = self._queue.get(block=block and not got)
                except queue.Empty:
                    break
                if item is _END:
                    self._ended = True
                    break
                spare.extend(item)
            take = min(n - len(got), len(spare))
            got += spare[:take]
            del spare[:take]
        self._spare = spare
        return None if not got and self._ended else got

    def _emit(self, done: Finished) -> None:
        part, i, k = done.request.tag
        part.finished(i, done.completion)
        if self._log is not None and k is not None:
            # its own fields, not a deep copy (asdict): the log's thread encodes them
            self._log.add(k, len(part.completions[i]), done.completion.sample,
                          vars(done.completion))
        if not part.left:
            with self._lock:
                self._inflight.discard(part)

    def close(self) -> None:
        """The scheduler's input ended and its thread joined (the parts in flight finish)."""
        if self._thread is not None:
            self._queue.put(_END)
            self._thread.join()
            self._thread = None
