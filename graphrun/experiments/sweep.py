"""`graphrun sweep SPEC --grid KEY=[V1,V2] ... --out DIR`: every combination of the grid as a
spec variant (overrides as --set writes them), each run on the first N records in a fresh
process (one variant's memory cannot leak into the next) into DIR/<variant>/, `repeats` times,
alternating the variants (v0 v1 v2 v0 v1 v2: drift hits all of them); repeats after the first go
to DIR/repeats/<variant>/r<k>/. Then DIR/sweep.json (schemas/sweep.schema.json): per variant the
median and range of its repeats, the Pareto front of throughput against graph memory, and the
recommendation: the best variant on the objective among those meeting the constraints, named
only beyond the noise (stats.RULE), with the spec keys to change. A variant that fails is a row
with its error.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field

from graphrun.base.nofollow import open_file
from graphrun.base.units import MiB
from graphrun.base.errors import GraphrunError, Problem, SpecError, first_message
from graphrun.experiments.stats import RULE, Spread, spread, verdict

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "sweep.schema.json"


class Variant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="Its folder under the sweep's folder.")
    overrides: dict[str, Any] = Field(..., description="Grid key -> value of this variant.")
    status: Literal["completed", "failed"]
    error: Optional[str] = Field(None, description="Why it failed (the run's last error line).")
    repeats: int = Field(1, description="Repeats that completed (each a fresh process).")
    folders: list[str] = Field(default_factory=list, description="Each repeat's run folder, "
                               "relative to the sweep's, in the order run.")
    records_per_s: Optional[float] = Field(None, description="Median over the repeats.")
    records_per_s_spread: Optional[Spread] = None
    output_tokens_per_s: Optional[float] = Field(
        None, description="Generation variants: the manifest's generation.output_tokens_per_s "
        "(new tokens / prefill and decode time), median over the repeats; null for a "
        "forward-pass spec.")
    output_tokens_per_s_spread: Optional[Spread] = None
    p50_us: Optional[float] = Field(None, description="End-to-end batch latency over a "
                                    "repeat's batches; median over the repeats.")
    p50_us_spread: Optional[Spread] = None
    p99_us: Optional[float] = Field(None, description="Median over the repeats.")
    p99_us_spread: Optional[Spread] = None
    capture_s: Optional[float] = None
    memory_bytes: Optional[int] = Field(None, description="Graph memory (capture pool growth).")
    padding_waste: Optional[float] = Field(
        None, description="1 - real / padded work (rows x positions) of the records it ran; a "
        "generation job's: its prefills' padding as run (generation.prefill_padding).")
    verify: Optional[Literal["passed", "failed", "off"]] = Field(
        None, description="Its buckets' verification: off where none was checked "
        "(capture.verify off, or nothing captured: the eager backend, e.g. the CPU).")
    outputs_equal_first: Optional[bool] = Field(
        None, description="Outputs equal to the first completed variant's within its verify "
        "tolerance, over the records both hold; null for that variant itself.")
    pareto: bool = Field(False, description="On the front: no other variant is at least as "
                         "fast with at most as much memory, and strictly better in one.")
    broken: list[str] = Field(default_factory=list, description="The constraints it breaks "
                              "(never recommended), one sentence each.")
    pick: Optional[Literal["recommended", "within_noise"]] = Field(
        None, description="recommended: the sweep's recommendation; within_noise: no winner, "
        "and this variant is not separated from the best.")


OBJECTIVES = {  # name -> (Variant field, its spread, label, higher is better, unit scale)
    "records_per_s": ("records_per_s", "records_per_s_spread", "records/s", True, 1.0),
    "tokens_per_s": ("output_tokens_per_s", "output_tokens_per_s_spread", "output tokens/s",
                     True, 1.0),
    "p99_ms": ("p99_us", "p99_us_spread", "p99 latency ms", False, 1e-3),
}
Objective = Literal["records_per_s", "tokens_per_s", "p99_ms"]


class Constraints(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_memory_mib: Optional[float] = Field(None, description="Graph memory (capture pool "
                                            "growth; none on a CPU), the largest repeat's.")
    max_p99_ms: Optional[float] = Field(None, description="End-to-end batch p99, the "
                                        "repeats' median.")


class SpecChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str
    base: Any = Field(None, description="The value in the spec as given (with --set).")
    value: Any


class Option(BaseModel):
    model_config = ConfigDict(extra="forbid")

    variant: str
    changes: list[SpecChange] = Field(..., description="Grid keys whose value differs from "
                                      "the base spec's; empty: the spec as it is.")
    set_args: list[str] = Field(..., description="The same as --set KEY=VALUE arguments.")


class Recommendation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    objective: Objective
    variant: Optional[str] = Field(None, description="The recommended variant, named only "
                                   "when it beats every other one beyond the noise (rule).")
    within_noise: list[str] = Field(
        default_factory=list, description="No winner: the best median and every variant not "
        "separated from it, best first (any of them is as good as the sweep can tell).")
    options: list[Option] = Field(..., description="The recommended variant's changes, or each "
                                  "within-noise variant's.")
    why: list[str] = Field(..., description="The reasons, one sentence each.")
    rule: str = RULE


class Sweep(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"title": "graphrun sweep"})

    spec: str
    grid: dict[str, list[Any]]
    stop: Optional[int] = Field(None, description="Records each variant ran (the first N).")
    repeats: int = Field(1, description="Runs per variant, alternating the variants.")
    objective: Objective = "records_per_s"
    constraints: Constraints = Field(default_factory=Constraints)
    variants: list[Variant]
    recommendation: Optional[Recommendation] = None


def schema_text() -> str:
    return json.dumps(Sweep.model_json_schema(), indent=2) + "\n"


def parse_grid(items: tuple[str, ...]) -> dict[str, list[Any]]:
    """--grid capture.warmup_iters=[1,3] -> {"capture.warmup_iters": [1, 3]} (YAML values)."""
    grid = {}
    for item in items:
        key, sep, raw = item.partition("=")
        try:
            values = yaml.safe_load(raw) if sep else None
        except yaml.YAMLError:
            values = None
        if not key.strip() or not isinstance(values, list) or not values:
            raise SpecError([Problem(f"--grid {item}", "", "expected --grid KEY=[V1,V2,...] "
                                     "with at least one value, e.g. "
                                     "--grid data.batch_size=[8,32]")])
        grid[key.strip()] = values
    if not grid:
        raise SpecError([Problem("--grid", "", "give at least one --grid KEY=[V1,V2,...]")])
    return grid


def variants(grid: dict[str, list[Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(folder name, overrides) per combination, in grid order."""
    out = []
    for i, combo in enumerate(itertools.product(*grid.values())):
        chosen = dict(zip(grid, combo))
        label = "_".join(f"{k.split('.')[-1]}-{json.dumps(v, separators=(',', ':'))}"
                         for k, v in chosen.items())
        out.append((f"v{i:02d}_" + re.sub(r"[^A-Za-z0-9_.,=-]+", "", label)[:80], chosen))
    return out


def _overrides(chosen: dict[str, Any]) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in chosen.items()]


def run_variant(spec: Path, base: list[str], chosen: dict, out: Path, stop: int | None) -> str:
    """Run one variant in a fresh process; '' when it completed, else its error line."""
    cmd = [sys.executable, "-m", "graphrun", "run", str(spec), "--out", str(out),
           "--overwrite", "-q"]
    for item in list(base) + _overrides(chosen):
        cmd += ["--set", item]
    if stop is not None:
        cmd += ["--stop", str(stop)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode == 0:
        return ""
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}"


def _e2e(folder: Path) -> list[float]:
    lat = folder / "latencies.jsonl"
    if not lat.is_file():
        return []
    return [json.loads(x)["e2e_us"] for x in lat.read_text().splitlines() if x.strip()]


def measure(spec: Path, base: list[str], name: str, chosen: dict, out: Path,
            folders: list[Path], stop: int | None, first: Path | None) -> Variant:
    """A completed variant's row from its repeats' manifests and latencies; padding, verify
    and outputs from its first repeat (the folder out/<name>)."""
    from graphrun.experiments.compare import bucket_verified, compare_outputs, load_manifest
    from graphrun.generate.records import with_implied_io
    from graphrun.plan.planner import evaluate, histogram
    from graphrun.spec.load import load_spec

    manifests = [load_manifest(f) for f in folders]
    e2e = [_e2e(f) for f in folders]
    m = manifests[0]
    verdicts = [v for x in manifests for v in map(bucket_verified, x["buckets"]) if v is not None]
    # a generation spec's implied inputs: the prompts' lengths are read as a run reads them
    pspec = with_implied_io(load_spec(spec, list(base) + _overrides(chosen)))
    equal = None
    if first is not None:
        o = compare_outputs(first, load_manifest(first), folders[0], m)
        equal = bool(o.equal or (o.within_tolerance and not o.only_a and not o.only_b))
    rate = spread([x["totals"]["records_per_s"] for x in manifests])
    tokens = spread([(x.get("generation") or {}).get("output_tokens_per_s") for x in manifests])
    p50 = spread([float(np.percentile(x, 50)) if x else None for x in e2e])
    p99 = spread([float(np.percentile(x, 99)) if x else None for x in e2e])
    memory = [x["totals"]["capture_memory_bytes"] for x in manifests]
    return Variant(
        name=name, overrides=chosen, status="completed", repeats=len(folders),
        folders=[str(f.relative_to(out)) for f in folders],
        records_per_s=rate.median, records_per_s_spread=rate,
        output_tokens_per_s=tokens and tokens.median, output_tokens_per_s_spread=tokens,
        p50_us=p50 and p50.median, p50_us_spread=p50, p99_us=p99 and p99.median,
        p99_us_spread=p99, capture_s=float(np.median([x["totals"]["capture_s"]
                                                      for x in manifests])),
        memory_bytes=max(memory) if all(x is not None for x in memory) else None,
        # a generation job's prefills pack their prompts: its padding as run, not the planner's
        # rows x positions of a forward pass's batches
        padding_waste=(m["generation"].get("prefill_padding") if m.get("generation")
                       else evaluate(histogram(pspec, stop=stop), pspec.buckets).waste),
        verify="off" if not verdicts else ("passed" if all(verdicts) else "failed"),
        outputs_equal_first=equal)


def mark_pareto(rows: list[Variant]) -> None:
    done = [r for r in rows if r.status == "completed" and r.records_per_s is not None]
    for r in done:
        mem = r.memory_bytes or 0
        r.pareto = not any(
            o is not r and o.records_per_s >= r.records_per_s and (o.memory_bytes or 0) <= mem
            and (o.records_per_s > r.records_per_s or (o.memory_bytes or 0) < mem)
            for o in done)


def every_bucket(base: list[str], grid: dict) -> list[str]:
    """capture.lazy: false unless --set or the grid says: a variant's capture time and graph
    memory are those of all its buckets, not only of those its first --stop records select."""
    if "capture.lazy" in grid or any(s.split("=")[0].strip() == "capture.lazy" for s in base):
        return base
    return ["capture.lazy=false", *base]


def check_constraints(rows: list[Variant], limits: Constraints) -> None:
    """Each completed variant's broken constraints, in words."""
    for r in rows:
        if r.status != "completed":
            continue
        mib = (r.memory_bytes or 0) / MiB
        if limits.max_memory_mib is not None and mib > limits.max_memory_mib:
            r.broken.append(f"graph memory {mib:,.1f} MiB > --max-memory-mib "
                            f"{limits.max_memory_mib:g}")
        if limits.max_p99_ms is not None:
            if r.p99_us is None:
                r.broken.append("no batch latencies to hold to --max-p99-ms")
            elif r.p99_us / 1e3 > limits.max_p99_ms:
                r.broken.append(f"p99 {r.p99_us / 1e3:,.2f} ms (median of its repeats) > "
                                f"--max-p99-ms {limits.max_p99_ms:g}")
        if r.verify == "failed":
            r.broken.append("its replay did not match eager (verify failed)")


def _at(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _same(base: Any, value: Any, base_dir: Path | None) -> bool:
    """The base spec's value equals the override; a path the spec holds resolved counts equal
    to the same path relative to the spec's folder."""
    if base == value:
        return True
    return (base_dir is not None and isinstance(base, str) and isinstance(value, str)
            and Path(base).is_absolute() and str((base_dir / value).resolve()) == base)


def option(row: Variant, base_spec: dict, base_dir: Path | None = None) -> Option:
    changes = [SpecChange(key=k, base=_at(base_spec, k), value=v) for k, v in
               row.overrides.items() if not _same(_at(base_spec, k), v, base_dir)]
    return Option(variant=row.name, changes=changes,
                  set_args=_overrides({c.key: c.value for c in changes}))


def recommend(rows: list[Variant], objective: str, base_spec: dict,
              base_dir: Path | None = None) -> Recommendation:
    """The best variant on the objective among those that completed within the constraints,
    named only beyond the noise; otherwise those within the noise of the best."""
    _, spread_field, label, higher, scale = OBJECTIVES[objective]
    done = [r for r in rows if r.status == "completed"]
    eligible = [r for r in done if not r.broken and getattr(r, spread_field) is not None]
    why = [f"{r.name} is left out: {'; '.join(r.broken)}" for r in done if r.broken]
    why += [f"{r.name} is left out: it failed ({r.error})" for r in rows if r.status == "failed"]
    if not eligible:
        return Recommendation(objective=objective, options=[],
                              why=["no variant completed within the constraints", *why])

    def scaled(s: Spread) -> Spread:
        return Spread(median=s.median * scale, min=s.min * scale, max=s.max * scale, n=s.n,
                      values=[v * scale for v in s.values])

    v = verdict({r.name: scaled(getattr(r, spread_field)) for r in eligible}, label,
                higher=higher, fmt=",.2f" if scale != 1.0 else ",.1f")
    by_name = {r.name: r for r in rows}
    if v.winner is not None:
        by_name[v.winner].pick = "recommended"
        picked = [by_name[v.winner]]
    else:
        picked = [by_name[n] for n in v.within_noise]
        for r in picked:
            r.pick = "within_noise"
    options = [option(r, base_spec, base_dir) for r in picked]
    lines = [v.text]
    lines += [f"{r.name}'s outputs differ from the first variant's: check that they are the "
              "outputs you want" for r in picked if r.outputs_equal_first is False]
    if v.winner is None and len(picked) > 1:
        lines.append("any of these is as good as this sweep can tell: pick on other grounds "
                     "(graph memory, capture time) or run more --repeats")
    return Recommendation(objective=objective, variant=v.winner,
                          within_noise=v.within_noise, options=options, why=lines + why)


def default_repeats(spec: Path, base: list[str]) -> int:
    """3 on a CUDA device (enough for a range and a winner); 2 on a CPU (a range, kept fast)."""
    from graphrun.engine.device import resolve_device
    from graphrun.spec.load import load_spec

    return 3 if resolve_device(load_spec(spec, base).device).type == "cuda" else 2


def sweep(spec: Path, grid: dict[str, list[Any]], out: Path, *, stop: int | None = None,
          base: list[str] = (), repeats: int | None = None, objective: str | None = None,
          constraints: Constraints | None = None, echo=print) -> Sweep:
    from graphrun.spec.load import load_spec

    base = every_bucket(list(base), grid)
    base_spec = load_spec(spec, base)  # the base spec itself must be valid: one message
    if objective is None:
        objective = "tokens_per_s" if base_spec.generate is not None else "records_per_s"
    elif objective == "tokens_per_s" and base_spec.generate is None:
        raise SpecError([Problem("--objective tokens_per_s", "", "only a generation spec (one "
                                 "with generate:) makes tokens: use records_per_s or p99_ms")])
    repeats = repeats or default_repeats(spec, base)
    constraints = constraints or Constraints()
    out.mkdir(parents=True, exist_ok=True)
    plan = variants(grid)
    errors: dict[str, str] = {}
    for name, chosen in plan:
        try:
            load_spec(spec, list(base) + _overrides(chosen))
        except GraphrunError as err:
            errors[name] = first_message(err)
            echo(f"{name}: failed: {errors[name]}")
    folders: dict[str, list[Path]] = {name: [] for name, _ in plan}
    for k in range(repeats):  # round-robin: every variant once per round
        for name, chosen in plan:
            if name in errors:
                continue
            folder = out / name if k == 0 else out / "repeats" / name / f"r{k + 1}"
            echo(f"{name}: running" + (f" (repeat {k + 1}/{repeats})" if repeats > 1 else ""))
            error = run_variant(spec, list(base), chosen, folder, stop)
            if error:
                errors[name] = error
                echo(f"{name}: failed: {error}")
                continue
            folders[name].append(folder)
            t = load_manifest_totals(folder)
            echo(f"{name}: {t['records_per_s']:,.1f} records/s" + (
                f", {t['tokens']:,.1f} output tokens/s" if t["tokens"] is not None else ""))
    rows: list[Variant] = []
    first: Path | None = None
    for name, chosen in plan:
        if name in errors:
            rows.append(Variant(name=name, overrides=chosen, status="failed",
                                error=errors[name]))
            continue
        rows.append(measure(spec, list(base), name, chosen, out, folders[name], stop, first))
        first = first or folders[name][0]
    mark_pareto(rows)
    check_constraints(rows, constraints)
    result = Sweep(spec=str(spec), grid=grid, stop=stop, repeats=repeats, objective=objective,
                   constraints=constraints, variants=rows,
                   recommendation=recommend(rows, objective, base_spec.model_dump(mode="json"),
                                            base_spec.base_dir))
    with open_file(out / "sweep.json", "w") as f:  # never through a link
        f.write(result.model_dump_json(indent=2) + "\n")
    return result


def load_manifest_totals(folder: Path) -> dict:
    from graphrun.experiments.compare import load_manifest

    m = load_manifest(folder)
    return {"records_per_s": m["totals"]["records_per_s"],
            "tokens": (m.get("generation") or {}).get("output_tokens_per_s")}
