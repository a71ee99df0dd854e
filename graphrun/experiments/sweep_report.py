"""A sweep's table (terminal) and charts (graphrun report on a sweep folder)."""

from __future__ import annotations

import json
from pathlib import Path

from graphrun.base.units import MiB
from graphrun.experiments.stats import range_text
from graphrun.experiments.sweep import Sweep


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


PICKS = {"recommended": "recommended", "within_noise": "within noise"}


def _pick(v) -> str:
    if v.broken:
        return "breaks " + "; ".join(v.broken)
    return PICKS.get(v.pick or "", "")


def recommendation_lines(result: Sweep) -> list[str]:
    """The answer, in words: what to pick (or that nothing is beyond the noise), the spec
    lines to change, and why."""
    rec = result.recommendation
    if rec is None:
        return []
    label = OBJECTIVE_LABELS[rec.objective]
    limits = [f"{k.replace('_', '-')} {v:g}" for k, v in
              result.constraints.model_dump().items() if v is not None]
    under = f" under --{', --'.join(limits)}" if limits else ""
    if rec.variant is not None:
        head = f"recommended for {label}{under}: {rec.variant}"
    elif rec.within_noise:
        head = (f"no significant difference in {label}{under} between "
                f"{', '.join(rec.within_noise)}: no winner named")
    else:
        head = f"nothing to recommend for {label}{under}"
    lines = [head]
    for o in rec.options:
        lines.append(f"  {o.variant}: " + (change_text(o) if o.changes else "the spec as it is"))
    lines += [f"  why: {w}" for w in rec.why]
    return lines


def change_text(o) -> str:
    return (" ".join(f"--set {a}" for a in o.set_args) + "  (" + "; ".join(
        f"{c.key}: {json.dumps(c.base)} -> {json.dumps(c.value)}" for c in o.changes) + ")")


OBJECTIVE_LABELS = {"records_per_s": "records/s", "tokens_per_s": "output tokens/s",
                    "p99_ms": "p99 latency"}


def sweep_table(result: Sweep):
    from rich.table import Table

    table = Table(title=f"sweep of {result.spec}" + (
        f" (first {result.stop} records each)" if result.stop else "") + f"; {result.repeats} "
        f"repeat{'s' if result.repeats > 1 else ''} per variant, alternated: medians and "
        "min..max; * = Pareto front (records/s against graph memory)")
    tokens = generation(result)  # a generation spec's variants: their tokens/s too
    cols = ("", "variant", *result.grid, "records/s", "range",
            *(["tokens/s", "range "] if tokens else []), "p50 us", "p99 us", "p99 range",
            "capture s", "graph MiB", "padding waste", "verify", "= first", "pick")
    for col in cols:
        table.add_column(col, justify="left" if col in ("", "variant", "pick", *result.grid)
                         else "right")
    for v in result.variants:
        values = [json.dumps(v.overrides[k]) for k in result.grid]
        if v.status == "failed":
            table.add_row("", v.name.split("_")[0], *values, f"failed: {v.error}",
                          *[""] * (len(cols) - len(values) - 3))
            continue
        equal = "-" if v.outputs_equal_first is None else (
            "yes" if v.outputs_equal_first else "NO")
        table.add_row("*" if v.pareto else "", v.name.split("_")[0], *values,
                      _fmt(v.records_per_s, ",.1f"), range_text(v.records_per_s_spread, ",.1f"),
                      *([_fmt(v.output_tokens_per_s, ",.1f"),
                         range_text(v.output_tokens_per_s_spread, ",.1f")] if tokens else []),
                      _fmt(v.p50_us, ",.0f"), _fmt(v.p99_us, ",.0f"),
                      range_text(v.p99_us_spread, ",.0f"), _fmt(v.capture_s, ".2f"),
                      _fmt((v.memory_bytes or 0) / MiB, ",.1f"),
                      _fmt(100 * v.padding_waste if v.padding_waste is not None else None,
                           ".1f") + "%", v.verify or "-", equal, _pick(v))
    return table


def generation(result: Sweep) -> bool:
    return any(v.output_tokens_per_s is not None for v in result.variants)


def load_sweep(folder: Path) -> Sweep:
    from graphrun.experiments.compare import load_result

    return load_result(folder, "sweep.json", Sweep)


def _tick(v) -> str:
    """A variant's tick label: its number, then each overridden key's last part and value."""
    return "<br>".join([v.name.split("_")[0], *(f"{k.rsplit('.', 1)[-1]}={json.dumps(x)}"
                                                 for k, x in v.overrides.items())])


def ranges(spreads: list, medians: list, divisor: float = 1.0) -> dict:
    """Error bars from each bar's median down to its repeats' min and up to their max."""
    up = [None if s is None or m is None else (s.max - m) / divisor
          for s, m in zip(spreads, medians)]
    down = [None if s is None or m is None else (m - s.min) / divisor
            for s, m in zip(spreads, medians)]
    return {"type": "data", "symmetric": False, "array": up, "arrayminus": down,
            "visible": True}


def titled(title: str, result: Sweep, metric: str) -> str:
    """A chart's title, with the rule's verdict beneath it on the chart of the objective."""
    import html

    rec = result.recommendation
    if rec is None or rec.objective != metric:
        return title
    return f"{title}<br><sup>{html.escape(recommendation_lines(result)[0])}</sup>"


def sweep_figures(go, folder: Path) -> list:
    """A line naming the charts left out, then records/s per variant (the front starred), the
    throughput-memory scatter with its front where variants took graph memory, padding waste
    and latency per variant. Bars are medians with each variant's min..max over its repeats;
    the objective's chart says the winner rule's verdict."""
    from graphrun.experiments import charts as c

    result = load_sweep(folder)
    done = [v for v in result.variants if v.status == "completed"]
    names = [_tick(v) for v in done]
    rate = go.Figure()
    rate.add_bar(name="records/s", x=names, y=[v.records_per_s for v in done],
                 error_y=ranges([v.records_per_s_spread for v in done],
                                [v.records_per_s for v in done]),
                 marker={"color": ["#2e8b57" if v.pareto else "#7f8fa6" for v in done]},
                 text=["*" if v.pareto else "" for v in done], textposition="outside",
                 textfont={"size": 20})
    c.layout(rate, titled("Records/s per variant (* and green: the front; bars: min..max of "
                          "the repeats)", result, "records_per_s"),
             yaxis=c.value_axis("records/s"))
    out = [("throughput", rate)]
    if generation(result):
        tokens = go.Figure()
        tokens.add_bar(name="output tokens/s", x=names, y=[v.output_tokens_per_s for v in done],
                       error_y=ranges([v.output_tokens_per_s_spread for v in done],
                                      [v.output_tokens_per_s for v in done]))
        c.layout(tokens, titled("Output tokens/s per variant (bars: min..max of the repeats)",
                                result, "tokens_per_s"), yaxis=c.value_axis("tokens/s"))
        out.append(("tokens", tokens))
    mib = [(v.memory_bytes or 0) / MiB for v in done]
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
    for name, key in (("p50", "p50_us"), ("p99", "p99_us")):
        medians = [getattr(v, key) for v in done]
        latency.add_bar(name=name, x=names, y=c.scaled(medians, div), error_y=ranges(
            [getattr(v, f"{key}_spread") for v in done], medians, div))
    c.layout(latency, titled("End-to-end batch latency per variant (bars: min..max of the "
                             "repeats)", result, "p99_ms"), yaxis=c.value_axis(unit))
    out.append(("variant-latency", latency))
    return c.drawn(out, {"pareto": "no variant took graph memory (eager): every point would "
                         "sit at 0 MiB", "padding": "no variant padded"})


def recommendation_html(result: Sweep) -> str:
    """The page's first screen: the recommendation (or "no significant difference"), the spec
    lines to change, and why; the evidence (the table, the charts) follows it."""
    import html

    lines = recommendation_lines(result)
    if not lines:
        return ""
    rec = result.recommendation
    options = "".join(
        f"<li><b>{html.escape(o.variant)}</b>: " + (
            "<code>" + html.escape(" ".join(f"--set {a}" for a in o.set_args)) + "</code>"
            if o.set_args else "the spec as it is") + (
            "<pre>" + html.escape("\n".join(f"{c.key}: {json.dumps(c.value)}"
                                            f"    # was {json.dumps(c.base)}"
                                            for c in o.changes)) + "</pre>"
            if o.changes else "") + "</li>" for o in rec.options)
    why = "".join(f"<li>{html.escape(w)}</li>" for w in rec.why)
    return (f'<section class="recommendation" data-significant="'
            f'{"yes" if rec.variant else "no"}"><h2>{html.escape(lines[0])}</h2>'
            f"<ul>{options}</ul><h3>why</h3><ul>{why}</ul>"
            f"<p><small>{html.escape(rec.rule)}</small></p></section>")


def sweep_html(folder: Path) -> str:
    """The recommendation, then the sweep's table (medians and ranges of the repeats), failed
    variants with their error."""
    import html

    result = load_sweep(folder)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in (
        "front", "variant", *result.grid, "records/s", "records/s range", "p50 us", "p99 us",
        "p99 range", "capture s", "graph MiB", "padding waste", "verify", "= first", "pick"))
    rows = []
    for v in result.variants:
        cells = ["*" if v.pareto else "", v.name, *(json.dumps(v.overrides[k])
                                                    for k in result.grid)]
        if v.status == "failed":
            cells.append(f"failed: {v.error}")
        else:
            cells += [_fmt(v.records_per_s, ",.1f"), range_text(v.records_per_s_spread, ",.1f"),
                      _fmt(v.p50_us, ",.0f"), _fmt(v.p99_us, ",.0f"),
                      range_text(v.p99_us_spread, ",.0f"), _fmt(v.capture_s, ".2f"),
                      _fmt((v.memory_bytes or 0) / MiB, ",.1f"),
                      _fmt(None if v.padding_waste is None else 100 * v.padding_waste, ".1f"),
                      v.verify or "-", "-" if v.outputs_equal_first is None else
                      ("yes" if v.outputs_equal_first else "NO"), _pick(v)]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
                    + "</tr>")
    caption = (f"<caption>{result.repeats} repeat{'s' if result.repeats > 1 else ''} per "
               "variant, alternated; medians and min..max</caption>")
    return (recommendation_html(result)
            + f"<table>{caption}<tr>{head}</tr>{''.join(rows)}</table>")
