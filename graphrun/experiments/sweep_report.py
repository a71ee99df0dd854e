"""A sweep's table (terminal) and charts (graphrun report on a sweep folder)."""

from __future__ import annotations

import json
from pathlib import Path

from graphrun.experiments.sweep import Sweep


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def sweep_table(result: Sweep):
    from rich.table import Table

    table = Table(title=f"sweep of {result.spec}" + (
        f" (first {result.stop} records each)" if result.stop else "") + "; * = Pareto front "
        "(records/s against graph memory)")
    tokens = generation(result)  # a generation spec's variants: their tokens/s too
    for col in ("", "variant", *result.grid, "records/s", *(["tokens/s"] if tokens else []),
                "p50 us", "p99 us", "capture s", "graph MiB", "padding waste", "verify",
                "= first"):
        table.add_column(col, justify="left" if col in ("", "variant", *result.grid)
                         else "right")
    for v in result.variants:
        values = [json.dumps(v.overrides[k]) for k in result.grid]
        if v.status == "failed":
            table.add_row("", v.name.split("_")[0], *values, f"failed: {v.error}",
                          *[""] * (8 if tokens else 7))
            continue
        equal = "-" if v.outputs_equal_first is None else (
            "yes" if v.outputs_equal_first else "NO")
        table.add_row("*" if v.pareto else "", v.name.split("_")[0], *values,
                      _fmt(v.records_per_s, ",.1f"),
                      *([_fmt(v.output_tokens_per_s, ",.1f")] if tokens else []),
                      _fmt(v.p50_us, ",.0f"),
                      _fmt(v.p99_us, ",.0f"), _fmt(v.capture_s, ".2f"),
                      _fmt((v.memory_bytes or 0) / 2**20, ",.1f"),
                      _fmt(100 * v.padding_waste if v.padding_waste is not None else None,
                           ".1f") + "%", v.verify or "-", equal)
    return table


def generation(result: Sweep) -> bool:
    return any(v.output_tokens_per_s is not None for v in result.variants)


def load_sweep(folder: Path) -> Sweep:
    return Sweep.model_validate_json((Path(folder) / "sweep.json").read_text())


def _tick(v) -> str:
    """A variant's tick label: its number, then each overridden key's last part and value."""
    return "<br>".join([v.name.split("_")[0], *(f"{k.rsplit('.', 1)[-1]}={json.dumps(x)}"
                                                 for k, x in v.overrides.items())])


def sweep_figures(go, folder: Path) -> list:
    """A line naming the charts left out, then records/s per variant (the front starred), the
    throughput-memory scatter with its front where variants took graph memory, padding waste
    and latency per variant."""
    from graphrun.experiments import charts as c

    result = load_sweep(folder)
    done = [v for v in result.variants if v.status == "completed"]
    names = [_tick(v) for v in done]
    rate = go.Figure()
    rate.add_bar(name="records/s", x=names, y=[v.records_per_s for v in done],
                 marker={"color": ["#2e8b57" if v.pareto else "#7f8fa6" for v in done]},
                 text=["*" if v.pareto else "" for v in done], textposition="outside",
                 textfont={"size": 20})
    c.layout(rate, "Records/s per variant (* and green: the front)",
             yaxis=c.value_axis("records/s"))
    out = [("throughput", rate)]
    if generation(result):
        tokens = go.Figure()
        tokens.add_bar(name="output tokens/s", x=names, y=[v.output_tokens_per_s for v in done])
        c.layout(tokens, "Output tokens/s per variant", yaxis=c.value_axis("tokens/s"))
        out.append(("tokens", tokens))
    mib = [(v.memory_bytes or 0) / 2**20 for v in done]
    if c.has_data(mib):  # without graph memory (eager) every point sits on x = 0
        front = sorted((m, v.records_per_s, v.name) for m, v in zip(mib, done) if v.pareto)
        scatter = go.Figure()
        scatter.add_scatter(name="variants", mode="markers+text", x=mib,
                            y=[v.records_per_s for v in done], text=[v.name for v in done],
                            textposition="top center", marker={"size": 10})
        scatter.add_scatter(name="Pareto front", mode="lines+markers", x=[f[0] for f in front],
                            y=[f[1] for f in front], text=[f[2] for f in front],
                            marker={"size": 14, "symbol": "star"})
        c.layout(scatter, "Throughput against graph memory (front: nothing faster with less "
                 "memory)", xaxis=c.value_axis("graph memory MiB"),
                 yaxis=c.value_axis("records/s"))
        out.append(("pareto", scatter))
    else:
        out.append(("pareto", None))
    waste = [None if v.padding_waste is None else 100 * v.padding_waste for v in done]
    if c.has_data(waste):
        padding = go.Figure()
        padding.add_bar(name="padding waste", x=names, y=waste)
        c.layout(padding, "Padding waste per variant: padded work (rows x positions) run",
                 yaxis=c.percent_axis("padded %"))
        out.append(("padding", padding))
    else:
        out.append(("padding", None))
    div, unit = c.time_unit([v.p99_us for v in done] + [v.p50_us for v in done])
    latency = go.Figure()
    latency.add_bar(name="p50", x=names, y=c.scaled([v.p50_us for v in done], div))
    latency.add_bar(name="p99", x=names, y=c.scaled([v.p99_us for v in done], div))
    c.layout(latency, "End-to-end batch latency per variant", yaxis=c.value_axis(unit))
    out.append(("variant-latency", latency))
    return c.drawn(out, {"pareto": "no variant took graph memory (eager): every point would "
                         "sit at 0 MiB", "padding": "no variant padded"})


def sweep_html(folder: Path) -> str:
    """The sweep's table for the report page, failed variants with their error."""
    import html

    result = load_sweep(folder)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in (
        "front", "variant", *result.grid, "records/s", "p50 us", "p99 us", "capture s",
        "graph MiB", "padding waste", "verify", "= first"))
    rows = []
    for v in result.variants:
        cells = ["*" if v.pareto else "", v.name, *(json.dumps(v.overrides[k])
                                                    for k in result.grid)]
        if v.status == "failed":
            cells.append(f"failed: {v.error}")
        else:
            cells += [_fmt(v.records_per_s, ",.1f"), _fmt(v.p50_us, ",.0f"),
                      _fmt(v.p99_us, ",.0f"), _fmt(v.capture_s, ".2f"),
                      _fmt((v.memory_bytes or 0) / 2**20, ",.1f"),
                      _fmt(None if v.padding_waste is None else 100 * v.padding_waste, ".1f"),
                      v.verify or "-", "-" if v.outputs_equal_first is None else
                      ("yes" if v.outputs_equal_first else "NO")]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
                    + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"
