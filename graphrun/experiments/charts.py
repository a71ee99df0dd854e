"""What every page of `graphrun report` shares: plotly itself, axes with readable ticks, the rule
that a chart or trace is drawn only when it holds data, the line saying what ran, HTML tables.
"""

from __future__ import annotations

import html
import math
from typing import Iterable, Optional

from graphrun.base.errors import GraphrunError
from graphrun.base.extras import install_hint

NICE = (1.0, 2.0, 2.5, 5.0, 10.0)  # tick steps are one of these times a power of ten


def plotly():
    try:
        import plotly.graph_objects as go
    except ImportError:
        raise GraphrunError(f"graphrun report needs plotly: {install_hint('report')}") from None
    return go


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def has_data(values: Iterable) -> bool:
    """At least one finite value that is not zero: a trace of zeros or blanks draws nothing."""
    return any(finite(v) and v != 0 for v in values)


def nice_step(span: float, *, integer: bool = False, target: int = 6) -> float:
    """A tick step of 1, 2, 2.5 or 5 times a power of ten giving about `target` ticks over
    span; at least 1, and never 2.5, on an axis of counts."""
    if not finite(span) or span <= 0:
        return 1.0
    raw = span / target
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in NICE:
        step = m * mag
        if step >= raw and (not integer or step == int(step)):
            break
    return max(1.0, float(round(step))) if integer else step


def count_axis(title: str, values: Iterable) -> dict:
    """A y axis of counts from 0: integer ticks (a count of 1 is not drawn at 0.2 steps)."""
    top = max([v for v in values if finite(v)] or [1])
    return {"title": title, "rangemode": "tozero", "tickformat": ",d",
            "tick0": 0, "dtick": nice_step(top, integer=True)}


def value_axis(title: str) -> dict:
    return {"title": title, "rangemode": "tozero"}


def percent_axis(title: str = "%") -> dict:
    return {"title": title, "rangemode": "tozero", "ticksuffix": "%"}


def time_unit(values_us: Iterable) -> tuple[float, str]:
    """(divisor, unit) for latencies given in us: ms once they reach tens of thousands."""
    top = max([v for v in values_us if finite(v)] or [0])
    return (1e3, "ms") if top >= 2e4 else (1.0, "us")


def scaled(values: Iterable, divisor: float) -> list:
    return [v / divisor if finite(v) else None for v in values]


def layout(fig, title: str, **kw) -> None:
    """One look for every chart: the title, grouped bars, a legend that does not cover them."""
    fig.update_layout(title=title, barmode="group", showlegend=True, margin={"t": 60}, **kw)


def where(device: Optional[str], gpu: Optional[str] = None) -> str:
    if not device or device.startswith("cpu"):
        return "on the CPU"
    return f"on {gpu} ({device})" if gpu else f"on {device}"


def what_ran(statuses: list[str], device: Optional[str], gpu: Optional[str] = None,
             unit: str = "bucket", reasons: Iterable[str] = ()) -> tuple[str, bool]:
    """The line at the top of a page: (text, eager only). statuses: of the buckets (or graphs)
    that were set up, each captured or eager."""
    captured = sum(s == "captured" for s in statuses)
    eager = sum(s == "eager" for s in statuses)
    place = where(device, gpu)
    if not captured:
        return f"eager {place}: nothing was captured", True
    text = f"CUDA graphs {place}: {captured} {unit}{'s' * (captured != 1)} captured"
    if eager:
        why = next(iter(r for r in reasons if r), None)
        text += f", {eager} eager" + (f" ({why})" if why else "")
    return text, False


def banner(lines: list[tuple[str, bool]]) -> str:
    """The list at the top of a page: one line per run, marked eager or graph."""
    items = "".join(f'<li class="{"eager" if eager else "graph"}">{html.escape(text)}</li>'
                    for text, eager in lines)
    return f'<ul class="what-ran" id="what-ran">{items}</ul>'


def drawn(figures: list[tuple[str, object]], reasons: dict[str, str]) -> list:
    """The figures that hold data, after a line naming those left out and why."""
    left = [f"{name} ({reasons.get(name, 'no data')})" for name, fig in figures if fig is None]
    note = (f'<p class="left-out">Left out, having nothing to draw: {html.escape("; ".join(left))}'
            "</p>") if left else ""
    return [note, *[(n, f) for n, f in figures if f is not None]]


def table(head: list[str], rows: list[list], cls: str = "") -> str:
    """An HTML table, every cell escaped."""
    th = "".join(f"<th>{html.escape(str(c))}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f'<table class="{cls}"><tr>{th}</tr>{body}</table>'


def fmt(x, spec: str, suffix: str = "") -> str:
    return format(x, spec) + suffix if finite(x) else "-"
