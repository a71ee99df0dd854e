"""What a person watching sees: progress while running, a table at the end (rich).

Both are shown only when asked (`show`: the CLI passes it unless --quiet is given); the
manifest holds everything either way. On a terminal the progress is a bar; elsewhere (a log
file, CI) it is a plain line every LINE_S seconds, with records, rate and ETA.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

from graphrun.base.errors import GraphrunError
from graphrun.base.extras import install_hint
from graphrun.base.phases import FIRST_USE
from graphrun.read.formats import reader_for
from graphrun.base.tuning import Tuning

UPDATE_S = 0.1  # the progress bar's counts are pushed at most this often
LINE_S = 5.0  # outside a terminal, a progress line this often


class Progress:
    def __init__(self, show: bool, total: int | None, out=None):
        self._bar = self._lines = self._tokens = None
        self._pending, self._shown = 0, 0.0
        if not show:
            return
        out = out or sys.stdout
        if not getattr(out, "isatty", lambda: False)():
            self._lines = ProgressLines(total, out)
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, TextColumn,
                                   TimeRemainingColumn)
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(TextColumn("records"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("[progress.data.speed]{task.fields[rate]}"),
                                 TimeRemainingColumn(), transient=False)
        self._task = self._bar.add_task("run", total=total, rate="")
        self._bar.start()

    def count_tokens(self, tokens) -> None:
        """A generation job: tokens() gives the output tokens of the batches finished so far
        (the engine counts them as each batch's generation ends), shown as a rate too."""
        self._tokens = tokens
        if self._lines is not None:
            self._lines.tokens = tokens

    def set_total(self, total: int | None) -> None:
        """The records the run will read, once counted (beside setup: spine.open_sinks)."""
        if self._lines is not None:
            self._lines.total = total
        elif self._bar is not None:
            self._bar.update(self._task, total=total)

    def streaming(self) -> None:
        """The stream begins: rates count from now (setup and capture are not in them)."""
        if self._lines is not None:
            self._lines.t0 = self._lines.shown = time.monotonic()
        elif self._bar is not None:
            self._bar.reset(self._task, start=True, total=self._bar.tasks[0].total)

    def advance(self, n: int, taken_back: int = 0) -> None:
        """Count n more records finished, taken_back of them read back from finished.jsonl
        (counted, but not in the line's rate: they took no time). Called on the completer's
        thread (the launching one, serially) once per batch and per rejected record: the bar
        is updated at most every UPDATE_S (an update costs tens of microseconds, a GPU batch
        may take less than a millisecond)."""
        if self._lines is not None:
            self._lines.advance(n, taken_back)
            return
        if self._bar is None:
            return
        self._pending += n
        now = time.monotonic()
        if now - self._shown < UPDATE_S:
            return
        self._shown = now
        self._flush()

    def _flush(self) -> None:
        self._bar.advance(self._task, self._pending)
        self._pending = 0
        task = self._bar.tasks[0]
        if task.speed:
            rate = f"{task.speed:,.0f} rec/s"
            if self._tokens is not None and task.elapsed:
                rate += f", {self._tokens() / task.elapsed:,.0f} tok/s"
            self._bar.update(self._task, rate=rate)

    def close(self) -> None:
        if self._bar is not None:
            self._flush()
            self._bar.stop()
            self._bar = None


class ProgressLines:
    """`graphrun: 12,000/100,000 records (12%), 3,100 records/s, ETA 0:00:25`, a line every
    LINE_S seconds; the rate counts from the stream's start (Progress.streaming; else the
    first batch finished): setup and capture are not in it. A
    generation job's line has its output tokens/s after the records/s."""

    def __init__(self, total: int | None, out, tokens=None):
        self.total, self.out, self.tokens = total, out, tokens
        self.done = 0
        self.taken_back = 0  # of done: read back by --resume, so not in the rate
        self.t0 = self.shown = None

    def advance(self, n: int, taken_back: int = 0) -> None:
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = self.shown = now
        self.done += n
        self.taken_back += taken_back
        if now - self.shown >= LINE_S:
            self.shown = now
            print(self.line(now - self.t0), file=self.out, flush=True)

    def line(self, elapsed: float) -> str:
        rate = (self.done - self.taken_back) / elapsed if elapsed > 0 else 0.0
        # a log read later (CI, a scheduler's file) says when each line was written
        stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        text = f"{stamp} graphrun: {self.done:,}"
        if self.total:
            text += f"/{self.total:,} records ({self.done / self.total:.0%})"
        else:
            text += " records"
        text += f", {rate:,.0f} records/s"
        if self.tokens is not None:
            made = self.tokens()
            text += f", {made / elapsed if elapsed > 0 else 0.0:,.0f} output tokens/s"
        if self.total and rate > 0:
            left = max(0, self.total - self.done) / rate
            text += f", ETA {int(left) // 3600}:{int(left) % 3600 // 60:02d}:{int(left) % 60:02d}"
        return text


def count_records(spec, start: int = 0, stop: int | None = None) -> int | None:
    """Records the run will read, cheaply (a line count, an array header, Parquet metadata);
    None where the file cannot say (the run itself then reports why)."""
    try:
        total = reader_for(spec, Tuning()).count()
    except (GraphrunError, OSError, ValueError, KeyError, StopIteration):
        return None
    end = total if stop is None else min(stop, total)
    return max(0, end - start)


def summary_table(manifest, shown: set[str] = frozenset()) -> None:
    """One row per bucket, narrow enough for 80 columns; the manifest has the rest (e2e and
    every percentile, pool memory, verify errors)."""
    from rich.console import Console
    from rich.table import Table

    title = f"graphrun: {manifest.name} ({manifest.status})"
    table = (generation_table(manifest.generation, title) if manifest.generation is not None
             else bucket_table(manifest, title))
    # piped (a log file, CI): lines are not cut at 80 columns; a terminal wraps as it is wide
    console = Console(soft_wrap=not sys.stdout.isatty())
    console.print(table)
    t = manifest.totals
    if manifest.generation is not None:  # its padding is the prefills' (generation_line)
        console.print(f"records in {t.records_in}, out {t.records_out}, rejected "
                      f"{t.records_rejected}; {t.records_per_s:,.0f} records/s; setup "
                      f"{t.setup_s:.2f} s")
        console.print(graph_setup(manifest.generation))
        console.print(generation_line(manifest.generation))
    else:
        console.print(f"records in {t.records_in}, out {t.records_out}, rejected "
                      f"{t.records_rejected}; {t.batches} batches; {t.records_per_s:,.0f} "
                      f"records/s; setup {t.setup_s:.2f} s, capture {t.capture_s:.2f} s; "
                      f"padding {t.padding_ratio:.1%} of rows"
                      + "".join(f", {r:.1%} of {a} positions"
                                for a, r in t.padding_ratio_positions.items()))
        console.print(bucket_setup(manifest))
    cuts = text_cuts(manifest)
    if cuts:
        console.print(cuts)
    where = stream_breakdown(t, manifest.spec["data"]["path"])
    if where:
        console.print(where)
    biggest = biggest_phases(manifest)
    if biggest:
        console.print(biggest)
    for w in manifest.warnings:
        if w not in shown:
            console.print(f"[yellow]warning:[/yellow] {w}")


def bucket_table(manifest, title: str):
    """A forward job's buckets, one row each."""
    from rich.table import Table

    table = Table(title=title, box=None, padding=(0, 1), pad_edge=False, show_edge=False,
                  caption="replay: median us per batch; capture: ms")
    for col in ("bucket", "status", "batches", "records", "padded", "replay", "capture",
                "verify"):
        table.add_column(col, justify="left" if col in ("bucket", "status") else "right",
                         no_wrap=True, min_width=len(col))
    unused = [b for b in manifest.buckets if b.status == "unused"]
    for b in manifest.buckets:
        if b.status == "unused":
            continue
        replay = b.latency_us.get("replay", {}).get("p50")
        checks = [lane.verify for lane in b.lanes if lane.verify is not None]
        verify = "-" if not checks else ("ok" if all(v.passed for v in checks) else "FAILED")
        table.add_row(b.name, b.status, str(b.batches), str(b.records), str(b.padded_rows),
                      f"{replay:.0f}" if replay else "-",
                      f"{b.capture_s * 1e3:.1f}" if b.capture_s else "-", verify)
    if unused:  # capture.lazy: buckets no batch selected, one row for all of them
        table.add_row(f"{len(unused)} bucket{'s' if len(unused) > 1 else ''} not used",
                      "unused", "0", "0", "0", "-", "-", "-")
    return table


def generation_table(g, title: str):
    """A generation job's graphs, one row each: decode steps by rows, prefills by tokens."""
    from rich.table import Table

    table = Table(title=title, box=None, padding=(0, 1), pad_edge=False, show_edge=False,
                  caption="set-up and capture: ms; memory: MiB of the graph pool")
    for col in ("graph", "status", "set-up", "capture", "memory"):
        table.add_column(col, justify="left" if col in ("graph", "status") else "right",
                         no_wrap=True, min_width=len(col))
    unit = {"decode": "row", "prefill": "token"}
    # workers' graphs (rank set) of one kind and size in one row: the statuses they had, the
    # slowest set-up and capture, the largest memory
    rows: dict[tuple[str, int], list] = {}
    for x in g.graphs:
        rows.setdefault((x.kind, x.size), []).append(x)
    workers = len({x.rank for x in g.graphs}) if any(x.rank is not None for x in g.graphs) else 0

    def most(values, scale: float) -> str:
        values = [v for v in values if v]
        return f"{max(values) * scale:.1f}" if values else "-"

    for (kind, size), xs in sorted(rows.items(), key=lambda kv: (kv[0][0] != "decode", kv[0][1])):
        statuses = sorted({x.status for x in xs})
        status = statuses[0] if len(statuses) == 1 else ", ".join(
            f"{s} {sum(x.status == s for x in xs)}" for s in statuses)
        table.add_row(f"{kind} {size} {unit[kind]}{'s' if size > 1 else ''}", status,
                      most((x.set_up_s for x in xs), 1e3), most((x.capture_s for x in xs), 1e3),
                      most((x.memory_bytes for x in xs), 2**-20))
    if workers:
        table.caption = (f"{workers} workers, each with its own graphs: a row is a size's in "
                         "every worker that has it; set-up and capture: the slowest's ms; "
                         "memory: the largest, MiB of its pool")
    return table


def graph_setup(g) -> str:
    """`graphs: 9 (4 decode, 5 prefill): 9 set up at start, 9 captured`: a generation job's
    graphs, and why any is not captured (the first reason)."""
    graphs = g.graphs
    kinds = ", ".join(f"{sum(x.kind == k for x in graphs)} {k}" for k in ("decode", "prefill"))
    workers = len({x.rank for x in graphs if x.rank is not None})
    if workers:
        kinds += f"; {workers} workers, each its own"
    said = [f"{sum(x.set_up == 'setup' for x in graphs)} set up at start"]
    later = sum(x.set_up == "first_use" for x in graphs)
    if later:
        said.append(f"{later} on first use")
    for status in ("captured", "eager", "skipped", "unused"):
        these = [x for x in graphs if x.status == status]
        if these:
            why = next((x.reason for x in these if x.reason), None)
            said.append(f"{len(these)} {status}" + (f" ({why})" if why and status != "captured"
                                                    else ""))
    return f"graphs: {len(graphs)} ({kinds}): " + ", ".join(said)


def generation_line(g) -> str:
    """`generation: 48 output tokens (eos 2, length 6), 310 tokens/s; TTFT p50 12.1 ms, TPOT
    p50 3.2 ms; 25% of decode row-steps wasted, 64 slots 90% occupied, KV blocks peak 610 of
    2,561; prompt tokens 9,100 computed, 31,000 reused (77%)`: the generation section in a
    line (the prefix cache's counts where it reused any; with
    model.compile, how many of its graphs compiled: a fallback's reasons are in the manifest;
    on a GPU, the decode steps the device waited on the host for, where there were any; after
    --resume, the records finished.jsonl gave back)."""
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(g.finish_reasons.items()))
    times = "; ".join(f"{name} {key} {values[key]:.1f} ms"
                      for name, values in (("TTFT", g.ttft_ms), ("TPOT", g.tpot_ms))
                      for key in list(values)[:1])
    asked = [x for x in g.graphs if x.compiled is not None]  # model.compile on
    compiled = (f"; model.compile: {sum(x.compiled for x in asked)} of {len(asked)} graphs "
                "compiled" if asked else "")
    slots = (f", {g.slots} slots {g.slot_occupancy:.0%} occupied, KV blocks peak "
             f"{g.kv_blocks_peak:,} of {g.kv_blocks:,}" if g.slots and g.decode_steps else "")
    waited = (f"; the device waited on the host at {g.host_bound_steps:,} of "
              f"{g.decode_steps:,} decode steps" if g.host_bound_steps else "")
    reused = (f"; prompt tokens {g.prompt_tokens_computed:,} computed, "
              f"{g.prompt_tokens_reused:,} reused ({g.prefix_hit_rate:.0%})"
              if g.prompt_tokens_reused else "")
    padded = (f"; prefill padding {g.prefill_padding:.0%} of {g.prefill_positions:,} positions"
              if g.prefill_positions else "")
    kept = (f"; {g.records_taken_back:,} records' completions taken back from finished.jsonl"
            if g.records_taken_back else "")
    return (f"generation: {g.output_tokens:,} output tokens ({reasons}), "
            f"{g.output_tokens_per_s:,.0f} tokens/s" + (f"; {times}" if times else "")
            + f"; {g.wasted_fraction:.0%} of decode row-steps wasted" + waste_causes(g)
            + slots + padded
            + reused + compiled + waited + kept)


def waste_causes(g) -> str:
    """` (no prompt waiting 3%, admission 4%, stopped rows 2%)`: the wasted row-steps by
    cause, as shares of all decode row-steps; empty where none were wasted or the causes are
    not known."""
    w = g.waste
    if w is None or not g.decode_row_steps or g.wasted_fraction <= 0:
        return ""
    parts = (("no prompt waiting", w.no_prompt), ("admission", w.admission),
             ("stopped rows", w.stopped))
    return " (" + ", ".join(f"{name} {n / g.decode_row_steps:.0%}" for name, n in parts) + ")"


def text_cuts(manifest) -> str | None:
    """`texts: 3 cut to 64 tokens (data.text.truncate, from the left)`: a data.text job with
    truncate on that cut some; None otherwise (with truncate off a too long text is a rejected
    record, counted there)."""
    t = manifest.totals
    text = (manifest.spec.get("data") or {}).get("text") or {}
    if not t.texts_truncated or not text.get("truncate", True):
        return None
    side = "left" if manifest.spec.get("generate") else "right"
    what = "prompt" if side == "left" else "text"
    return (f"texts: {t.texts_truncated:,} {what}{'' if t.texts_truncated == 1 else 's'} cut "
            f"to {t.text_max_tokens:,} tokens (data.text.truncate, from the {side})")


def bucket_setup(manifest) -> str:
    """`buckets: 1 set up at start, 1 on first use (batch=1 by batch 6; 0.07 s), 2 never
    set up (no batch selected them: capture.lazy)`: when each bucket was set up."""
    buckets = manifest.buckets
    first = [b for b in buckets if b.set_up == "first_use"]
    said = [f"{sum(b.set_up == 'setup' for b in buckets)} set up at start"]
    if first:
        named = ", ".join(f"{b.name} by batch {b.first_use_batch}" for b in first[:3])
        spent = [p.s for p in (manifest.phases.top if manifest.phases else [])
                 if p.name == FIRST_USE]
        said.append(f"{len(first)} on first use ({named}{', ...' if len(first) > 3 else ''}"
                    + (f"; {spent[0]:.2f} s" if spent else "") + ")")
    unused = sum(b.status == "unused" for b in buckets)
    if unused:
        said.append(f"{unused} never set up (no batch selected them: capture.lazy)")
    skipped = sum(b.status == "skipped" for b in buckets)
    if skipped:
        said.append(f"{skipped} skipped (the manifest says why)")
    unchecked = [b for b in buckets if b.status == "eager" and b.set_up and not b.capture_s
                 and not any(lane.verify for lane in b.lanes)]
    if unchecked and len(unchecked) == sum(b.set_up is not None for b in buckets):
        said.append("all eager: nothing captured, so no warm-up and no replay-vs-eager check")
    return "buckets: " + ", ".join(said)


def biggest_phases(manifest, count: int = 3) -> str | None:
    """`time 4.02 s from the process's start: interpreter and imports 3.06 s (76%), stream
    0.34 s (8%), first call and buffers 0.17 s (4%)`: the largest of manifest.phases."""
    phases, total = manifest.phases, manifest.totals.process_wall_s
    if phases is None or not total:
        return None
    top = sorted(phases.top, key=lambda p: p.s, reverse=True)[:count]
    return (f"time {total:.2f} s from the process's start: "
            + ", ".join(f"{p.name} {p.s:.2f} s ({p.s / total:.0%})" for p in top))


# host_phase_s keys, as the summary names them: what each thread does (feed/loop.py)
_STEPS = (("read", "read"), ("stage", "pad"), ("launch", "launch"),
          ("device_wait", "device wait"), ("write", "write"))


def read_advice(data_path: str) -> str:
    """What makes reading this input faster, by its format."""
    import importlib.util

    suffix = Path(data_path).suffix.lower()
    if suffix == ".parquet":
        return "write row groups of at most 65,536 records so that several decode at once"
    if suffix == ".jsonl":
        if importlib.util.find_spec("orjson") is None:
            return ("install orjson, which parses JSONL several times faster: "
                    + install_hint("fast"))
        return "a binary format (Parquet, npz) reads faster than JSONL's text"
    return "give the input a faster disk, or a copy on local storage"


def stream_breakdown(totals, data_path: str = "") -> str | None:
    """Where the streaming time went, per step, as shares of it: serially they add up to
    about all of it; overlapped the threads run side by side, and the largest share of a
    step that is the host's own work (not a wait) is what bounds the rate; serially, the
    device where its wait is the largest share. When the busiest is the read (and a record
    came out: with none, reading is all that ran) and it takes half the stream or more than
    the device wait, what helps for the input's format."""
    stream = totals.stream_s
    phases = totals.host_phase_s
    if stream <= 0 or not phases:
        return None
    shares = [(label, phases.get(key, 0.0) / stream) for key, label in _STEPS]
    text = ", ".join(f"{label} {share:.0%}" for label, share in shares)
    path = "overlapped, steps side by side" if totals.overlapped else "serial"
    own = [(share, label) for label, share in shares if label != "device wait"]
    top, busiest = max(own)
    wait = dict(shares).get("device wait", 0.0)
    if not totals.overlapped and wait > top:  # serially the shares add up: the device
        busiest = "the device"
    text = f"stream ({path}): {text}; busiest: {busiest}"
    # the read limits the rate where it fills the stream or outlasts the device's work: a read
    # of 1% beside a device wait of 99% (a generation job) is the busiest host step, no limit
    limits = top >= min(0.5, wait)
    if busiest == "read" and totals.records_out and limits:
        text += f" (reading the input limits the rate: {read_advice(data_path)})"
    return text
