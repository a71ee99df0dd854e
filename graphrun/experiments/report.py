"""`graphrun report DIR...`: one self-contained HTML page of charts from run folders (several
are drawn side by side), a sweep folder or a bench folder.

Charts are plotly figures: interactive (hover, zoom, toggling a run) and self-contained, with
plotly.js inlined once into the page, so the file opens offline (no CDN). A run's charts come
from its manifest.json and latencies.jsonl; a sweep's from sweep.json.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from graphrun.experiments.compare import load_manifest
from graphrun.base.errors import GraphrunError

MAX_POINTS = 5000  # latency-over-the-run points per run (SVG); longer runs are thinned evenly
PHASES = ("read", "stage", "read_wait", "launch", "device_wait", "write")


def _plotly():
    try:
        import plotly.graph_objects as go
    except ImportError:
        raise GraphrunError("graphrun report needs plotly: pip install 'graphrun[report]'"
                            ) from None
    return go


def _label(folder: Path, labels: list[str]) -> str:
    name = folder.resolve().name
    return name if name not in labels else str(folder)


def _ran(manifest: dict) -> list[dict]:
    return [b for b in manifest["buckets"] if b.get("batches")]


def latency_chart(go, runs):
    fig = go.Figure()
    for label, m in runs:
        pcts = list(m["spec"].get("report", {}).get("percentiles", [50, 90, 99]))
        buckets = _ran(m)
        for p in pcts:
            key = f"p{p:g}"
            fig.add_bar(name=f"{label} e2e {key}", x=[b["name"] for b in buckets],
                        y=[b["latency_us"].get("e2e", {}).get(key) for b in buckets])
        eager = [b for b in buckets if b.get("eager_us")]
        if eager:
            fig.add_scatter(name=f"{label} eager median", mode="markers",
                            x=[b["name"] for b in eager], y=[b["eager_us"] for b in eager],
                            marker={"symbol": "diamond", "size": 11})
    fig.update_layout(title="End-to-end latency per bucket (percentiles; eager where measured)",
                      yaxis_title="us", barmode="group")
    return fig


def batches_chart(go, runs):
    fig = go.Figure()
    for label, m in runs:
        buckets = _ran(m)
        names = [b["name"] for b in buckets]
        fig.add_bar(name=f"{label} batches", x=names, y=[b["batches"] for b in buckets])
        waste = [100 * b["padded_rows"] / max(1, b["records"] + b["padded_rows"])
                 for b in buckets]
        fig.add_scatter(name=f"{label} padded rows %", x=names, y=waste, yaxis="y2",
                        mode="lines+markers")
    fig.update_layout(title="Batches and padded rows per bucket", barmode="group",
                      yaxis={"title": "batches"},
                      yaxis2={"title": "padded rows %", "overlaying": "y", "side": "right",
                              "rangemode": "tozero"})
    return fig


def capture_chart(go, runs):
    fig = go.Figure()
    for label, m in runs:
        buckets = [b for b in m["buckets"] if b["status"] not in ("skipped", "unused")]
        names = [b["name"] for b in buckets]
        fig.add_bar(name=f"{label} capture s", x=names,
                    y=[b.get("capture_s") or 0.0 for b in buckets])
        fig.add_bar(name=f"{label} warm-up s", x=names,
                    y=[b.get("warmup_s") or 0.0 for b in buckets])
        fig.add_scatter(name=f"{label} graph memory MiB", x=names, yaxis="y2",
                        mode="lines+markers",
                        y=[(b.get("memory_bytes") or 0) / 2**20 for b in buckets])
    eager = all(b["status"] in ("eager", "unused") for _, m in runs for b in m["buckets"])
    title = "Capture and warm-up time, graph memory per bucket"
    fig.update_layout(title=title + (" (eager backend: nothing captured)" if eager else ""),
                      barmode="group", yaxis={"title": "s"},
                      yaxis2={"title": "MiB", "overlaying": "y", "side": "right",
                              "rangemode": "tozero"})
    return fig


def phases_chart(go, runs):
    fig = go.Figure()
    for label, m in runs:
        phases = m["totals"].get("host_phase_s", {})
        keys = [p for p in PHASES if p in phases] + [p for p in phases if p not in PHASES]
        fig.add_bar(name=label, y=keys, x=[phases[k] for k in keys], orientation="h")
    fig.update_layout(title="Host seconds per phase of the stream (summed per thread)",
                      xaxis_title="s", barmode="group", yaxis={"autorange": "reversed"})
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
    fig = go.Figure()
    for (label, _), folder in zip(runs, folders):
        rows = _latencies(folder)
        fig.add_scatter(name=label, mode="markers", marker={"size": 4},
                          x=[r["batch"] for r in rows], y=[r["e2e_us"] for r in rows],
                          text=[r.get("bucket", "") for r in rows])
    fig.update_layout(title="End-to-end latency of each batch over the run",
                      xaxis_title="batch", yaxis_title="us", yaxis_type="log")
    return fig


def run_figures(folders: list[Path]) -> list[tuple[str, object]]:
    go = _plotly()
    labels: list[str] = []
    runs = []
    for folder in folders:
        labels.append(_label(folder, labels))
        runs.append((labels[-1], load_manifest(folder)))
    return [("latency", latency_chart(go, runs)), ("batches", batches_chart(go, runs)),
            ("capture", capture_chart(go, runs)), ("phases", phases_chart(go, runs)),
            ("timeline", timeline_chart(go, runs, folders))]


def sweep_figures(folder: Path) -> list[tuple[str, object]]:
    from graphrun.experiments.sweep_report import sweep_figures as figures

    return figures(_plotly(), folder)


def bench_figures(folder: Path) -> list[tuple[str, object]]:
    """A bench folder: latency per bucket and mode, speedup over eager, capture and memory."""
    from graphrun.experiments.bench import Bench

    go = _plotly()
    result = Bench.model_validate_json((folder / "bench.json").read_text())
    modes = list(dict.fromkeys(m.mode for b in result.buckets for m in b.modes))
    latency, speedup, capture = go.Figure(), go.Figure(), go.Figure()
    for mode in modes:
        rows = [(b.name, m) for b in result.buckets for m in b.modes if m.mode == mode]
        names = [n for n, _ in rows]
        latency.add_bar(name=f"{mode} p50", x=names, y=[m.latency_us["p50"] for _, m in rows])
        latency.add_scatter(name=f"{mode} p99", x=names, mode="markers",
                            y=[m.latency_us["p99"] for _, m in rows])
        speedup.add_bar(name=mode, x=names, y=[m.speedup for _, m in rows])
        capture.add_bar(name=f"{mode} capture s", x=names, y=[m.capture_s or 0 for _, m in rows])
        capture.add_scatter(name=f"{mode} MiB", x=names, yaxis="y2", mode="lines+markers",
                            y=[(m.memory_bytes or 0) / 2**20 for _, m in rows])
    latency.update_layout(title="Step latency per bucket and mode (p50 bars, p99 markers)",
                          yaxis_title="us", barmode="group")
    speedup.update_layout(title="Speedup over eager (p50)", yaxis_title="x", barmode="group")
    capture.update_layout(title="Capture (or first-call) time and graph memory per bucket",
                          barmode="group", yaxis={"title": "s"},
                          yaxis2={"title": "MiB", "overlaying": "y", "side": "right",
                                  "rangemode": "tozero"})
    return [("bench-latency", latency), ("bench-speedup", speedup), ("bench-capture", capture)]


def _summary(folders: list[Path]) -> str:
    rows = []
    for folder in folders:
        m = load_manifest(folder)
        t = m["totals"]
        env = m.get("environment") or {}
        rows.append(
            f"<tr><td>{html.escape(str(folder))}</td><td>{html.escape(m['status'])}</td>"
            f"<td>{t['records_out']:,}</td><td>{t['records_per_s']:,.1f}</td>"
            f"<td>{t['wall_s']:.2f}</td><td>{100 * t['padding_ratio']:.1f}%</td>"
            f"<td>{html.escape(str(env.get('device', '-')))} / "
            f"{html.escape(str(env.get('backend', '-')))}</td></tr>")
    head = ("<tr><th>run</th><th>status</th><th>records out</th><th>records/s</th>"
            "<th>wall s</th><th>padded rows</th><th>device / backend</th></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


STYLE = ("body{font-family:system-ui,sans-serif;margin:24px;color:#222}"
         "table{border-collapse:collapse;margin:12px 0}td,th{border:1px solid #ccc;"
         "padding:4px 8px;text-align:right}td:first-child,th:first-child{text-align:left}"
         ".chart{height:440px;margin:18px 0}")


def render(folders: list[Path]) -> str:
    """The page: a summary table, then every chart; plotly.js inlined once."""
    folders = [Path(f) for f in folders]
    if len(folders) == 1 and (folders[0] / "sweep.json").is_file():
        from graphrun.experiments.sweep_report import sweep_html

        figures, summary = sweep_figures(folders[0]), sweep_html(folders[0])
    elif len(folders) == 1 and (folders[0] / "bench.json").is_file():
        figures, summary = bench_figures(folders[0]), ""
    else:
        figures, summary = run_figures(folders), _summary(folders)
    parts = []
    for i, (name, fig) in enumerate(figures):
        div = fig.to_html(full_html=False, include_plotlyjs=(i == 0), div_id=f"chart-{name}",
                          config={"displaylogo": False, "responsive": True})
        parts.append(f'<div class="chart" data-chart="{name}">{div}</div>')
    title = "graphrun report: " + ", ".join(html.escape(str(f)) for f in folders)
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<style>{STYLE}</style></head><body><h1>{title}</h1>{summary}"
            f"{''.join(parts)}</body></html>\n")


def write_report(folders: list[Path], out: Path) -> Path:
    out = Path(out)
    text = render(folders)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out
