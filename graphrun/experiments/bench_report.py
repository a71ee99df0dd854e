"""A bench folder's page (graphrun report on bench.json): what ran, the table per bucket and mode,
then latency, and speedup, capture and memory only where a mode other than eager ran."""

from __future__ import annotations

import html
from pathlib import Path

from graphrun.base.units import MiB
from graphrun.experiments import charts as c
from graphrun.experiments.bench import Bench
from graphrun.experiments.stats import range_text

GRAPH_BACKENDS = ("cuda-graph", "torch.compile reduce-overhead")  # backends that capture


def load_bench(folder: Path) -> Bench:
    from graphrun.experiments.compare import load_result

    return load_result(folder, "bench.json", Bench)


def _modes(result: Bench) -> list[str]:
    return list(dict.fromkeys(m.mode for b in result.buckets for m in b.modes))


def _rows(result: Bench, mode: str):
    return [(b.name, m) for b in result.buckets for m in b.modes if m.mode == mode]


def what_ran(result: Bench) -> tuple[str, bool]:
    statuses = ["captured" if any(m.backend.startswith(GRAPH_BACKENDS) for m in b.modes)
                else "eager" for b in result.buckets]
    return c.what_ran(statuses, result.device)


def _generation(result: Bench) -> bool:
    return any(m.output_tokens_per_s is not None for b in result.buckets for m in b.modes)


def bench_html(result: Bench) -> str:
    gen = _generation(result)
    head = ["bucket", "mode", "backend"]
    head += (["tokens/s", "TTFT p50 ms", "TPOT p50 ms", "call p50 ms", "call p99 ms"] if gen
             else ["p50 us", "p90 us", "p99 us"])
    head += ["p50 over repeats us", "speedup", "capture s", "graph MiB", "verify", "fastest"]
    rows = []
    for b in result.buckets:
        for m in b.modes:
            lat = m.latency_us
            cells = [b.name, m.mode, m.backend]
            if gen:
                cells += [c.fmt(m.output_tokens_per_s, ",.1f"),
                          c.fmt((m.ttft_ms or {}).get("p50"), ",.2f"),
                          c.fmt((m.tpot_ms or {}).get("p50"), ",.2f"),
                          c.fmt(lat.get("p50", 0) / 1e3, ",.2f"),
                          c.fmt(lat.get("p99", 0) / 1e3, ",.2f")]
            else:
                cells += [c.fmt(lat.get(k), ",.0f") for k in ("p50", "p90", "p99")]
            # the speedup is marked ~ when it lies within the repeats' noise
            noisy = m.speedup is not None and m.mode != "eager" and not m.speedup_beyond_noise
            cells += [range_text(m.p50_spread_us, ",.0f"),
                      ("~" if noisy else "") + c.fmt(m.speedup, ".2f", "x"),
                      c.fmt(m.capture_s, ".2f"),
                      c.fmt(None if m.memory_bytes is None else m.memory_bytes / MiB, ",.1f"),
                      "-" if m.verify is None else ("passed" if m.verify else "FAILED"),
                      b.fastest.text if b.fastest is not None and m is b.modes[0] else ""]
            rows.append(cells)
    return c.table(head, rows, "bench")


def _about(result: Bench) -> str:
    text = (f"{result.iters} timed steps per bucket and mode after {result.warmup} warm-up, over "
            f"{result.distinct} input batches, {result.repeats} repeats with the modes taking "
            f"turns; inputs: {result.inputs}. A mode is named fastest only beyond the repeats' "
            "spread; ~ marks a speedup within it")
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in result.notes)
    return f'<p class="about">{html.escape(text)}</p>' + (
        f'<ul class="notes">{notes}</ul>' if notes else "")


def bench_figures(go, result: Bench) -> list:
    """A line naming the charts left out, then the charts."""
    modes = _modes(result)
    values = [v for b in result.buckets for m in b.modes for v in m.latency_us.values()]
    div, unit = c.time_unit(values)
    latency = go.Figure()
    for mode in modes:
        rows = _rows(result, mode)
        names = [n for n, _ in rows]
        latency.add_bar(name=f"{mode} p50", x=names,
                        y=c.scaled([m.latency_us.get("p50") for _, m in rows], div))
        latency.add_scatter(name=f"{mode} p99", x=names, mode="markers", marker={"size": 9},
                            y=c.scaled([m.latency_us.get("p99") for _, m in rows], div))
    what = "generate call" if _generation(result) else "step"
    c.layout(latency, f"{what.capitalize()} latency per bucket and mode (p50 bars, p99 markers)",
             yaxis=c.value_axis(unit))
    out = [("bench-latency", latency)]
    if _generation(result):
        tokens = go.Figure()
        for mode in modes:
            rows = _rows(result, mode)
            tokens.add_bar(name=mode, x=[n for n, _ in rows],
                           y=[m.output_tokens_per_s for _, m in rows])
        c.layout(tokens, "Output tokens/s per bucket and mode", yaxis=c.value_axis("tokens/s"))
        out.append(("bench-tokens", tokens))
    others = [m for m in modes if m != "eager"]
    speedup = go.Figure()
    for mode in others:  # eager's speedup over itself is 1 everywhere: not drawn
        rows = _rows(result, mode)
        if c.has_data(m.speedup for _, m in rows):
            speedup.add_bar(name=mode, x=[n for n, _ in rows], y=[m.speedup for _, m in rows])
    if speedup.data:
        speedup.add_hline(y=1, line_dash="dot", annotation_text="eager")
        c.layout(speedup, "Speedup over eager (eager p50 / the mode's p50)",
                 yaxis=c.value_axis("x"))
        out.append(("bench-speedup", speedup))
    else:
        out.append(("bench-speedup", None))
    for key, name, title, axis, scale in (
            ("capture_s", "bench-capture", "Capture (or first-call compilation) seconds per "
             "bucket", "s", 1), ("memory_bytes", "bench-memory", "Graph memory per bucket",
                                 "MiB", MiB)):
        fig = go.Figure()
        for mode in modes:
            rows = _rows(result, mode)
            y = [(getattr(m, key) or 0) / scale for _, m in rows]
            if c.has_data(y):
                fig.add_bar(name=mode, x=[n for n, _ in rows], y=y)
        if fig.data:
            c.layout(fig, title, yaxis=c.value_axis(axis))
        out.append((name, fig if fig.data else None))
    return c.drawn(out, {"bench-speedup": "eager alone ran: its speedup over itself is 1",
                         "bench-capture": "nothing was captured or compiled",
                         "bench-memory": "no graph memory: nothing captured"})


def bench_blocks(go, folder: Path) -> list:
    result = load_bench(folder)
    return [c.banner([what_ran(result)]), _about(result), bench_html(result),
            *bench_figures(go, result)]
