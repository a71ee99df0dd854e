"""Repeated measurements, their spread, and the rule that names a winner only beyond the noise.

bench and sweep measure every candidate (a mode, a variant) several times, alternating them
(A B C A B C) so that drift of the machine hits all; each candidate's repeats give a median and
a range. A candidate wins only when it is separated from every other one (RULE); otherwise the
answer is "no significant difference" and the candidates within the noise are all shown.
compare has one run a side: there the runs' own per-batch latencies are the sample (batch_noise).
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

MIN_REPEATS = 3  # two noise-only sets of 2 fail to overlap 1 time in 3; of 3, 1 in 10
MIN_BATCHES = 5  # fewer batches a side give no quartiles worth comparing
RULE = (f"a winner is named only when, over at least {MIN_REPEATS} repeats each, its worst "
        "repeat beats every other candidate's best (the ranges do not overlap) and its median "
        "beats theirs by more than the wider of the two ranges; otherwise: no significant "
        "difference")
BATCH_RULE = (f"beyond the noise when, over at least {MIN_BATCHES} batches each, the two runs' "
              "interquartile ranges of per-batch latency do not overlap")


class Spread(BaseModel):
    """One quantity measured once per repeat."""

    model_config = ConfigDict(extra="forbid")

    median: float
    min: float
    max: float
    n: int = Field(..., description="Repeats measured.")
    values: list[float] = Field(..., description="Each repeat's value, in the order run.")


def spread(values: Sequence[float | None]) -> Optional[Spread]:
    got = [float(v) for v in values if v is not None]
    if not got:
        return None
    return Spread(median=float(np.median(got)), min=min(got), max=max(got), n=len(got),
                  values=got)


def range_text(s: Optional[Spread], fmt: str, scale: float = 1.0) -> str:
    """min..max of a spread; '-' for one repeat (no range)."""
    return "-" if s is None or s.n < 2 else f"{s.min * scale:{fmt}}..{s.max * scale:{fmt}}"


def separated(a: Spread, b: Spread, higher: bool) -> bool:
    """a beats b beyond the noise (RULE)."""
    if min(a.n, b.n) < MIN_REPEATS:
        return False
    wider = max(a.max - a.min, b.max - b.min)
    if higher:
        return a.min > b.max and a.median - b.median > wider
    return a.max < b.min and b.median - a.median > wider


class Verdict(BaseModel):
    """Which candidate is best on one metric, and whether that is beyond the noise."""

    model_config = ConfigDict(extra="forbid")

    metric: str
    better: Literal["higher", "lower"]
    winner: Optional[str] = Field(None, description="Named only beyond the noise (rule).")
    best: Optional[str] = Field(None, description="The best median, beyond the noise or not.")
    within_noise: list[str] = Field(
        default_factory=list, description="No winner: the best and every candidate not "
        "separated from it, best first.")
    text: str
    rule: str = RULE


def _show(s: Spread, fmt: str) -> str:
    if s.n == 1:
        return f"{s.median:{fmt}} (1 repeat)"
    return f"{s.median:{fmt}} ({s.min:{fmt}}..{s.max:{fmt}}, {s.n} repeats)"


def verdict(candidates: dict[str, Spread], metric: str, *, higher: bool,
            fmt: str = ",.1f") -> Verdict:
    """The winner of candidates (name -> spread of the metric), or the ones within the noise."""
    better = "higher" if higher else "lower"
    if not candidates:
        return Verdict(metric=metric, better=better, text="nothing to rank")
    ranked = sorted(candidates, key=lambda k: candidates[k].median, reverse=higher)
    best = ranked[0]
    if len(ranked) == 1:
        return Verdict(metric=metric, better=better, winner=best, best=best,
                       text=f"{best}: the only candidate, {metric} "
                       f"{_show(candidates[best], fmt)}")
    close = [k for k in ranked[1:] if not separated(candidates[best], candidates[k], higher)]
    runner = ranked[1]
    if not close:
        return Verdict(metric=metric, better=better, winner=best, best=best,
                       text=f"{best} wins beyond the noise: {metric} "
                       f"{_show(candidates[best], fmt)} against the runner-up {runner}'s "
                       f"{_show(candidates[runner], fmt)}")
    few = min(candidates[k].n for k in [best, *close]) < MIN_REPEATS
    why = (f"fewer than {MIN_REPEATS} repeats cannot tell noise from a difference (--repeats "
           f"{MIN_REPEATS} or more)" if few else "their ranges overlap, or their medians are "
           "closer than their ranges are wide")
    shown = "; ".join(f"{k} {_show(candidates[k], fmt)}" for k in [best, *close])
    return Verdict(metric=metric, better=better, best=best, within_noise=[best, *close],
                   text=f"no significant difference in {metric} between "
                   f"{', '.join([best, *close])}: {shown}; {why}")


class BatchNoise(BaseModel):
    """Two runs' per-batch latencies (one run a side): is B's difference beyond their noise?"""

    model_config = ConfigDict(extra="forbid")

    a_batches: int
    b_batches: int
    a_median_us: Optional[float] = None
    b_median_us: Optional[float] = None
    a_iqr_us: Optional[list[float]] = Field(None, description="A's 25th and 75th percentile.")
    b_iqr_us: Optional[list[float]] = None
    ratio: Optional[float] = Field(None, description="B's median / A's.")
    significant: bool = Field(..., description="Beyond the noise (rule).")
    text: str
    rule: str = BATCH_RULE


def batch_noise(a: Sequence[float], b: Sequence[float]) -> BatchNoise:
    """BATCH_RULE over two runs' end-to-end latencies of the batches (us)."""
    na, nb = len(a), len(b)
    if not na or not nb:
        return BatchNoise(a_batches=na, b_batches=nb, significant=False,
                          text="no per-batch latencies on one side: nothing to judge")
    qa, qb = (np.percentile(np.asarray(x, float), [25, 50, 75]) for x in (a, b))
    ratio = float(qb[1] / qa[1]) if qa[1] else None
    common = dict(a_batches=na, b_batches=nb, a_median_us=float(qa[1]),
                  b_median_us=float(qb[1]), a_iqr_us=[float(qa[0]), float(qa[2])],
                  b_iqr_us=[float(qb[0]), float(qb[2])], ratio=ratio)
    if min(na, nb) < MIN_BATCHES:
        return BatchNoise(**common, significant=False,
                          text=f"too few batches ({na} and {nb}; {MIN_BATCHES} or more each) "
                          "to tell a difference from noise: no significant difference")
    apart = qb[0] > qa[2] or qa[0] > qb[2]
    b_x = f"B/A median {ratio:.3g}" if ratio is not None else "B/A median -"
    if not apart:
        return BatchNoise(**common, significant=False,
                          text=f"no significant difference: {b_x}, within the noise (the "
                          "interquartile ranges of per-batch latency overlap)")
    side = "faster" if qb[1] < qa[1] else "slower"
    return BatchNoise(**common, significant=True,
                      text=f"B is {side} beyond the batches' noise: {b_x} (the interquartile "
                      "ranges do not overlap); one run a side cannot rule out a difference "
                      "between the two processes (load, clocks): repeat with graphrun sweep "
                      "--repeats")
