"""`graphrun report DIR...`: one self-contained HTML page of charts from run folders (several
are drawn side by side), a sweep folder or a bench folder.

Charts are plotly figures: interactive (hover, zoom, toggling a run) and self-contained, with
plotly.js inlined once into the page, so the file opens offline (no CDN). A run's charts come
from its manifest.json and latencies.jsonl; a sweep's from sweep.json; a bench's from bench.json.

The page says first what ran (eager on the CPU, or how many buckets were captured on which GPU),
then its numbers; a chart that would hold no data (capture on the eager backend, speedup with
eager alone) is left out rather than drawn empty.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Optional, Union

from graphrun.base.units import MiB
from graphrun.experiments import charts as c
from graphrun.experiments.compare import load_manifest

MAX_POINTS = 5000  # latency-over-the-run points per run (SVG); longer runs are thinned evenly
PHASES = ("read", "stage", "read_wait", "launch", "device_wait", "write")
FIRST_REJECTS = 5  # rejects shown per run; rejects.jsonl has them all

LEFT_OUT = {"latency": "no batch ran", "batches": "no batch ran",
            "padding": "no padded rows or positions", "setup": "no warm-up or capture ran (eager on the CPU needs neither)",
            "memory": "no graph memory: nothing captured",
            "phases": "no host phase times", "timeline": "no latencies.jsonl"}

Block = Union[str, tuple[str, object]]  # a page is HTML and (name, figure) in order


def _label(folder: Path, labels: list[str]) -> str:
    name = folder.resolve().name
    return name if name not in labels else str(folder)


def _ran(manifest: dict) -> list[dict]:
    return [b for b in manifest["buckets"] if b.get("batches")]


def _set_up(manifest: dict) -> list[dict]:
    return [b for b in manifest["buckets"] if b["status"] not in ("skipped", "unused")]


# ---- what ran --------------------------------------------------------------------------------


def what_ran(m: dict) -> tuple[str, bool]:
    """(the run's line for the top of the page, eager only)."""
    env = m.get("environment") or {}
    gen = m.get("generation")
    if gen and gen.get("graphs"):
        items, unit = [g for g in gen["graphs"] if g["status"] in ("captured", "eager")], "graph"
    else:
        items, unit = _set_up(m), "bucket"
    if not env:  # the run failed before its device was set up
        text, eager = "no device was set up: no batch ran", True
    else:
        text, eager = c.what_ran([i["status"] for i in items], env.get("device"),
                                 env.get("gpu"), unit,
                                 [i.get("reason") for i in items if i["status"] == "eager"])
    if m["status"] != "completed":
        text = f"{m['status']}" + (f" ({m['error']})" if m.get("error") else "") + "; " + text
    return text, eager


# ---- a run's charts --------------------------------------------------------------------------


def samples_for(p: float) -> int:
    """The samples a percentile needs to say more than the largest of them: p90 needs 10,
    p99 100; the median, any number."""
    return 1 if p <= 50 else math.ceil(100 / (100 - p))


def latency_chart(go, runs):
    values = [v for _, m in runs for b in _ran(m) for v in
              list(b["latency_us"].get("e2e", {}).values()) + [b.get("eager_us")]]
    div, unit = c.time_unit(values)
    fig = go.Figure()
    short = {}  # percentile -> batches it needs, where a bucket ran fewer
    for label, m in runs:
        pcts = list(m["spec"].get("report", {}).get("percentiles", [50, 90, 99]))
        buckets = _ran(m)
        for p in pcts:
            key, need = f"p{p:g}", samples_for(p)
            y = c.scaled([b["latency_us"].get("e2e", {}).get(key) if b["batches"] >= need
                          else None for b in buckets], div)
            if any(b["batches"] < need for b in buckets):
                short[key] = need
            if c.has_data(y):
                fig.add_bar(name=f"{label} e2e {key}", x=[b["name"] for b in buckets], y=y)
        eager = [b for b in buckets if b.get("eager_us")]
        if eager:
            fig.add_scatter(name=f"{label} eager median", mode="markers",
                            x=[b["name"] for b in eager],
                            y=c.scaled([b["eager_us"] for b in eager], div),
                            marker={"symbol": "diamond", "size": 11})
    if not fig.data:
        return None
    note = (" (" + ", ".join(f"{k} only of a bucket of {n}+ batches" for k, n in short.items())
            + ")") if short else ""
    c.layout(fig, f"End-to-end latency per bucket (percentiles; eager where measured){note}",
             yaxis=c.value_axis(unit))
    return fig


def batches_chart(go, runs):
    fig = go.Figure()
    for label, m in runs:
        buckets = _ran(m)
        fig.add_bar(name=f"{label} batches", x=[b["name"] for b in buckets],
                    y=[b["batches"] for b in buckets])
    if not any(c.has_data(t.y) for t in fig.data):
        return None
    c.layout(fig, "Batches per bucket",
             yaxis=c.count_axis("batches", [v for t in fig.data for v in t.y]))
    return fig


def bucket_padding(b: dict) -> dict[str, float]:
    """A bucket's padding in %: of its rows, and of its positions per other axis."""
    rows = b["records"] + b["padded_rows"]
    out = {"rows": 100 * b["padded_rows"] / rows if rows else 0.0}
    for axis, padded in (b.get("padded_positions") or {}).items():
        slots = rows * b["sizes"].get(axis, 0)
        out[f"{axis} positions"] = 100 * padded / slots if slots else 0.0
    return out


def padding_chart(go, runs):
    """Padded rows and padded positions per axis, per bucket: the positions are the real waste
    of a variable-length axis, which the rows alone hide."""
    per_run = [(label, _ran(m), [bucket_padding(b) for b in _ran(m)]) for label, m in runs]
    kinds = list(dict.fromkeys(k for _, _, pads in per_run for p in pads for k in p))
    kinds = [k for k in kinds if c.has_data(p.get(k) for _, _, pads in per_run for p in pads)]
    if not kinds:
        return None
    fig = go.Figure()
    for label, buckets, pads in per_run:
        for k in kinds:
            if not any(k in p for p in pads):  # this run has no such axis
                continue
            fig.add_bar(name=f"{label} padded {k}", x=[b["name"] for b in buckets],
                        y=[p.get(k, 0.0) for p in pads])
    c.layout(fig, "Padding per bucket: % of rows run, % of positions run per axis",
             yaxis=c.percent_axis("padded %"))
    return fig


def setup_chart(go, runs):
    """Capture and warm-up seconds per bucket; capture left out where nothing was captured."""
    fig = go.Figure()
    for key, what in (("capture_s", "capture"), ("warmup_s", "warm-up")):
        if not c.has_data(b.get(key) for _, m in runs for b in _set_up(m)):
            continue
        for label, m in runs:
            buckets = _set_up(m)
            fig.add_bar(name=f"{label} {what} s", x=[b["name"] for b in buckets],
                        y=[b.get(key) or 0.0 for b in buckets])
    if not fig.data:
        return None
    captured = any(b["status"] == "captured" for _, m in runs for b in m["buckets"])
    c.layout(fig, "Set-up per bucket: " + ("capture and warm-up seconds" if captured else
                                           "warm-up seconds (eager: nothing captured)"),
             yaxis=c.value_axis("s"))
    return fig


def memory_chart(go, runs):
    if not c.has_data(b.get("memory_bytes") for _, m in runs for b in m["buckets"]):
        return None
    fig = go.Figure()
    for label, m in runs:
        buckets = _set_up(m)
        fig.add_bar(name=f"{label} graph MiB", x=[b["name"] for b in buckets],
                    y=[(b.get("memory_bytes") or 0) / MiB for b in buckets])
    c.layout(fig, "Graph memory per bucket (the capture pool's growth)",
             yaxis=c.value_axis("MiB"))
    return fig


def phases_chart(go, runs):
    fig = go.Figure()
    for label, m in runs:
        phases = m["totals"].get("host_phase_s", {})
        keys = [p for p in PHASES if p in phases] + [p for p in phases if p not in PHASES]
        if c.has_data(phases.values()):
            fig.add_bar(name=label, y=keys, x=[phases[k] for k in keys], orientation="h")
    if not fig.data:
        return None
    c.layout(fig, "Host seconds per phase of the stream (summed per thread)",
             xaxis=c.value_axis("s"), yaxis={"autorange": "reversed"})
    return fig


def _latencies(folder: Path) -> list[dict]:
    path = folder / "latencies.jsonl"
    if not path.is_file():
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    step = max(1, len(rows) // MAX_POINTS)
    return rows[::step]


def timeline_chart(go, runs, folders):
    rows = {label: _latencies(folder) for (label, _), folder in zip(runs, folders)}
    values = [r["e2e_us"] for rs in rows.values() for r in rs]
    if not c.has_data(values):
        return None
    div, unit = c.time_unit(values)
    fig = go.Figure()
    for label, rs in rows.items():
        if rs:
            fig.add_scatter(name=label, mode="markers", marker={"size": 5},
                            x=[r["batch"] for r in rs], y=c.scaled([r["e2e_us"] for r in rs], div),
                            text=[r.get("bucket", "") for r in rs])
    positive = [v for v in values if c.finite(v) and v > 0]
    wide = bool(positive) and max(positive) > 20 * min(positive)  # log only for a wide spread
    c.layout(fig, "End-to-end latency of each batch over the run",
             xaxis=c.count_axis("batch", [r["batch"] for rs in rows.values() for r in rs]),
             yaxis={"title": unit, "type": "log", "dtick": 1} if wide else c.value_axis(unit))
    fig.update_xaxes(rangemode="normal")
    return fig


# ---- a run's tables --------------------------------------------------------------------------


def _positions(t: dict) -> str:
    ratios = t.get("padding_ratio_positions") or {}
    return ", ".join(f"{a} {100 * r:.1f}%" for a, r in ratios.items()) or "-"


def _summary(folders: list[Path], manifests: list[dict]) -> str:
    rows = []
    for folder, m in zip(folders, manifests):
        t, env = m["totals"], m.get("environment") or {}
        rows.append([str(folder), m["status"],
                     f"{env.get('device', '-')} / {env.get('backend', '-')}",
                     f"{t['records_in']:,}", f"{t['records_out']:,}",
                     f"{t['records_rejected']:,}", f"{t['batches']:,}",
                     f"{t['records_per_s']:,.1f}", f"{t['wall_s']:.2f}",
                     f"{100 * t['padding_ratio']:.1f}%", _positions(t),
                     f"{len(m.get('warnings') or []):,}"])
    return c.table(["run", "status", "device / backend", "records in", "out", "rejected",
                    "batches", "records/s", "wall s", "padded rows", "padded positions",
                    "warnings"], rows, "summary")


def first_rejects(folder: Path, m: dict, n: int = FIRST_REJECTS) -> list[dict]:
    path = (m.get("rejects") or {}).get("path")
    if not path or not (folder / path).is_file():
        return []
    out = []
    with open(folder / path) as f:
        for line in f:
            if len(out) == n:
                break
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _notes(folders: list[Path], manifests: list[dict], labels: list[str]) -> str:
    """Every run's warnings and its first rejects with their reasons and input lines."""
    parts = []
    for folder, m, label in zip(folders, manifests, labels):
        count = (m.get("rejects") or {}).get("count") or m["totals"]["records_rejected"]
        warnings = m.get("warnings") or []
        if not count and not warnings:
            continue
        who = f"{label}: " if len(folders) > 1 else ""
        if count:
            shown = first_rejects(folder, m)
            parts.append(f"<h3>{html.escape(who)}{count:,} rejected record"
                         f"{'s' * (count != 1)}" + (f" (the first {len(shown)}; "
                         f"{html.escape(str(m['rejects'].get('path')))} has them all)"
                         if len(shown) < count else "") + "</h3>")
            parts.append(c.table(["record", "id", "where", "reason"],
                                 [[r.get("index", "-"), r.get("id", "-"), r.get("where", "-"),
                                   r.get("reason", "-")] for r in shown], "rejects"))
        if warnings:
            parts.append(f"<h3>{html.escape(who)}{len(warnings)} warning"
                         f"{'s' * (len(warnings) != 1)}</h3><ul class=\"warnings\">"
                         + "".join(f"<li>{html.escape(w)}</li>" for w in warnings) + "</ul>")
    return ('<section id="notes"><h2>Rejects and warnings</h2>' + "".join(parts)
            + "</section>") if parts else ""


# ---- a generation job ------------------------------------------------------------------------


def _pcts(d: dict) -> str:
    return " / ".join(f"{v:,.1f}" for v in d.values()) if d else "-"


def _graphs(gen: dict) -> str:
    counts: dict[str, int] = {}
    for g in gen.get("graphs") or []:
        key = f"{g['kind']} {g['status']}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items()) or "-"


def _graph_name(g: dict) -> str:
    """decode rows=64, prefill tokens=512 (a --gpus worker's: with its rank); a manifest of the
    static engine: its (batch, length)."""
    if "size" in g:
        rank = f" rank {g['rank']}" if g.get("rank") is not None else ""
        return f"{g['kind']} {'tokens' if g['kind'] == 'prefill' else 'rows'}={g['size']}{rank}"
    return f"{g['kind']} b{g['batch']} len {g['length']}"


def _prefix_cell(g: dict) -> str:
    """`9,100 / 31,000 (77%)`; a manifest from before the prefix cache: -."""
    if "prompt_tokens_computed" not in g:
        return "-"
    return (f"{g['prompt_tokens_computed']:,} / {g['prompt_tokens_reused']:,} "
            f"({100 * g['prefix_hit_rate']:.0f}%)")


def generation_html(runs: list[tuple[str, dict]]) -> str:
    rows = []
    head = None
    for label, m in runs:
        g = m.get("generation")
        if not g:
            continue
        keys = "/".join(g["ttft_ms"]) or "p50"
        head = head or ["run", "output tokens/s", "prompts", "prompt tokens",
                        "prompt tokens computed / reused (hit rate)", "output tokens",
                        f"TTFT ms ({keys})", f"TPOT ms ({keys})", "finish reasons",
                        "decode row-steps wasted", "slot occupancy", "KV blocks mean / peak",
                        "KV cache MiB", "MBU",
                        "decode steps waiting on the host", "prompts cut / rejected", "graphs"]
        waited = g.get("host_bound_steps")
        rows.append([label, f"{g['output_tokens_per_s']:,.1f}", f"{g['records']:,}",
                     f"{g['prompt_tokens']:,}", _prefix_cell(g), f"{g['output_tokens']:,}",
                     _pcts(g["ttft_ms"]),
                     _pcts(g["tpot_ms"]),
                     ", ".join(f"{k} {v:,}" for k, v in g["finish_reasons"].items()) or "-",
                     f"{100 * g['wasted_fraction']:.1f}%",
                     c.fmt(100 * g["slot_occupancy"] if g.get("slots") else None, ".1f", "%"),
                     (f"{g['kv_blocks_mean']:,.0f} / {g['kv_blocks_peak']:,}"
                      if g.get("kv_blocks") else "-"),
                     f"{g['kv_cache_bytes'] / MiB:,.1f}", c.fmt(
                         None if g.get("mbu") is None else 100 * g["mbu"], ".1f", "%"),
                     "-" if waited is None else f"{waited:,} of {g['decode_steps']:,}",
                     f"{g.get('prompts_truncated', 0):,} / {g.get('prompts_rejected', 0):,}",
                     _graphs(g)])
    if not rows:
        return ""
    return ('<section id="generation"><h2>Generation</h2>' + c.table(head, rows, "generation")
            + "</section>")


def generation_figures(go, runs) -> list[tuple[str, object]]:
    """TTFT and TPOT percentiles per run, and each graph's set-up time where graphs were set up
    (captured or timed)."""
    gens = [(label, m["generation"]) for label, m in runs if m.get("generation")]
    records = {label: (m.get("totals") or {}).get("records_out") or 0 for label, m in runs}
    out = []
    for key, name, title in (("ttft_ms", "ttft", "Time to first token (per prompt)"),
                             ("tpot_ms", "tpot", "Time per output token after the first")):
        fig = go.Figure()
        for label, g in gens:
            n = records.get(label, 0)
            kept = {p: v for p, v in g[key].items() if n >= samples_for(float(p[1:]))}
            if len(kept) > 1:  # the median alone is in the table already
                fig.add_bar(name=label, x=list(kept), y=list(kept.values()))
        if fig.data:
            c.layout(fig, f"{title}, percentiles", yaxis=c.value_axis("ms"))
            out.append((f"generation-{name}", fig))
    fig = go.Figure()
    for label, g in gens:
        graphs = [x for x in g.get("graphs") or [] if c.finite(x.get("set_up_s"))]
        if c.has_data(x["set_up_s"] for x in graphs):
            fig.add_bar(name=f"{label} set-up s",
                        x=[_graph_name(x) for x in graphs],
                        y=[x["set_up_s"] for x in graphs])
    if fig.data:
        c.layout(fig, "Set-up seconds per generation graph (warm-up, capture, verification)",
                 yaxis=c.value_axis("s"))
        out.append(("generation-graphs", fig))
    return out


# ---- pages -----------------------------------------------------------------------------------


def compare_html(folders: list[Path], labels: list[str]) -> str:
    """Two runs: `graphrun compare`'s answer first: the verdict, the spec difference, whether
    the outputs are equal and whether the timing differs beyond the noise."""
    from graphrun.experiments.compare import compare, outputs_line

    result = compare(*folders)
    diff = [[d["key"], json.dumps(d["a"]), json.dumps(d["b"])] for d in result["spec_diff"]]
    spec = (c.table(["spec key", labels[0], labels[1]], diff, "spec-diff") if diff
            else "<p>specs are identical</p>")
    notes = "".join(f"<p>{html.escape(n)}</p>" for n in result["notes"])
    return (f'<section class="compare"><h2>{html.escape(labels[1])} against '
            f"{html.escape(labels[0])}</h2><p><b>{html.escape(result['verdict'])}</b></p>"
            f"{spec}{notes}<p>{html.escape(outputs_line(result['outputs']))}</p></section>")


def run_blocks(folders: list[Path]) -> list[Block]:
    go = c.plotly()
    labels: list[str] = []
    manifests = []
    for folder in folders:
        labels.append(_label(folder, labels))
        manifests.append(load_manifest(folder))
    runs = list(zip(labels, manifests))
    lines = [what_ran(m) for m in manifests]
    if len(runs) > 1:
        lines = [(f"{label}: {text}", eager) for label, (text, eager) in zip(labels, lines)]
    blocks: list[Block] = [c.banner(lines)]
    if len(folders) == 2:
        blocks.append(compare_html(folders, labels))
    blocks += [_summary(folders, manifests), _notes(folders, manifests, labels)]
    if any(m.get("generation") for m in manifests):
        blocks += [generation_html(runs), *generation_figures(go, runs)]
    figures = [("latency", latency_chart(go, runs)), ("batches", batches_chart(go, runs)),
               ("padding", padding_chart(go, runs)), ("setup", setup_chart(go, runs)),
               ("memory", memory_chart(go, runs)), ("phases", phases_chart(go, runs)),
               ("timeline", timeline_chart(go, runs, folders))]
    return blocks + ["<h2>Per bucket</h2>", *c.drawn(figures, LEFT_OUT)]


def sweep_figures(folder: Path) -> list[tuple[str, object]]:
    from graphrun.experiments.sweep_report import sweep_figures as figures

    return [b for b in figures(c.plotly(), folder) if isinstance(b, tuple)]


def sweep_ran(folder: Path) -> Optional[tuple[str, bool]]:
    """What the sweep's variants ran on, from their manifests (None when none has one)."""
    from graphrun.experiments.sweep_report import load_sweep

    lines = []
    for v in load_sweep(folder).variants:
        path = folder / v.name / "manifest.json"
        if v.status == "completed" and path.is_file():
            lines.append(what_ran(json.loads(path.read_text())))
    if not lines:
        return None
    if all(eager for _, eager in lines):
        text = lines[0][0].split(":")[0]
        return (f"{text}: nothing was captured in any variant; graph memory is 0 for all, so "
                "the throughput-memory front is left out and * marks the fastest"), True
    return "; ".join(dict.fromkeys(t for t, _ in lines)), False


def sweep_blocks(folder: Path) -> list[Block]:
    from graphrun.experiments.sweep_report import sweep_html

    ran = sweep_ran(folder)
    from graphrun.experiments.sweep_report import sweep_figures as figures

    return [c.banner([ran]) if ran else "", sweep_html(folder), *figures(c.plotly(), folder)]


def bench_figures(folder: Path) -> list[tuple[str, object]]:
    from graphrun.experiments.bench_report import bench_figures as figures, load_bench

    return [b for b in figures(c.plotly(), load_bench(folder)) if isinstance(b, tuple)]


STYLE = ("body{font-family:system-ui,sans-serif;margin:24px;color:#222}"
         "table{border-collapse:collapse;margin:12px 0}td,th{border:1px solid #ccc;"
         "padding:4px 8px;text-align:right}td:first-child,th:first-child{text-align:left}"
         "table.rejects td,table.rejects th,ul.warnings{text-align:left;"
         "font-family:ui-monospace,monospace;font-size:13px}.what-ran{list-style:none;padding:0;margin:8px 0 16px}"
         ".what-ran li{padding:8px 12px;margin:4px 0;font-size:17px;border-left:6px solid}"
         ".what-ran li.eager{background:#fff4e0;border-color:#e69500}"
         ".what-ran li.graph{background:#e8f4ea;border-color:#2e8b57}"
         ".left-out{color:#666}.chart{height:440px;margin:18px 0}")


def render(folders: list[Path]) -> str:
    """The page: what ran, the tables, then every chart that has data; plotly.js inlined once."""
    folders = [Path(f) for f in folders]
    if len(folders) == 1 and (folders[0] / "sweep.json").is_file():
        blocks = sweep_blocks(folders[0])
    elif len(folders) == 1 and (folders[0] / "bench.json").is_file():
        from graphrun.experiments.bench_report import bench_blocks

        blocks = bench_blocks(c.plotly(), folders[0])
    else:
        alone = next((f for f in folders for name in ("sweep.json", "bench.json")
                      if (f / name).is_file() and not (f / "manifest.json").is_file()), None)
        if alone is not None:  # it said "no manifest.json: not a run folder" of it
            from graphrun.base.errors import InputError

            kind = "sweep" if (alone / "sweep.json").is_file() else "bench"
            raise InputError(f"a {kind} folder is reported on its own: `graphrun report "
                             f"{alone}`; run folders are compared together", where=str(alone))
        blocks = run_blocks(folders)
    parts, first = [], True
    for block in blocks:
        if isinstance(block, str):
            parts.append(block)
            continue
        name, fig = block
        div = fig.to_html(full_html=False, include_plotlyjs=first, div_id=f"chart-{name}",
                          config={"displaylogo": False, "responsive": True})
        first = False
        parts.append(f'<div class="chart" data-chart="{name}">{div}</div>')
    title = "graphrun report: " + ", ".join(html.escape(str(f)) for f in folders)
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<style>{STYLE}</style></head><body><h1>{title}</h1>"
            f"{''.join(parts)}</body></html>\n")


def write_report(folders: list[Path], out: Path) -> Path:
    from graphrun.base.errors import OutputError
    from graphrun.base.nofollow import open_file

    out = Path(out)
    text = render(folders)
    try:  # an OSError here was a traceback; a link is refused as every output file's is
        out.parent.mkdir(parents=True, exist_ok=True)
        with open_file(out, "w") as f:
            f.write(text)
    except (FileExistsError, NotADirectoryError):  # mkdir's "File exists" named no file
        above = next(p for p in out.parents if p.exists())
        raise OutputError(f"cannot write {out}: {above} is a file, not a folder") from None
    except OSError as err:
        raise OutputError(f"cannot write {out}: {err.strerror or err}") from None
    return out
