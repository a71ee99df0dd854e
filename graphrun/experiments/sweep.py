"""`graphrun sweep SPEC --grid KEY=[V1,V2] ... --out DIR`: every combination of the grid as a
spec variant (overrides as --set writes them), each run on the first N records in a fresh
process (one variant's memory cannot leak into the next) into DIR/<variant>/, then
DIR/sweep.json (schemas/sweep.schema.json) and a table with the Pareto front of throughput
against graph memory. A variant that fails is a row with its error.
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

from graphrun.base.errors import GraphrunError, Problem, SpecError

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "sweep.schema.json"


class Variant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="Its folder under the sweep's folder.")
    overrides: dict[str, Any] = Field(..., description="Grid key -> value of this variant.")
    status: Literal["completed", "failed"]
    error: Optional[str] = Field(None, description="Why it failed (the run's last error line).")
    records_per_s: Optional[float] = None
    output_tokens_per_s: Optional[float] = Field(
        None, description="Generation variants: the manifest's generation.output_tokens_per_s "
        "(new tokens / prefill and decode time); null for a forward-pass spec.")
    p50_us: Optional[float] = Field(None, description="End-to-end batch latency, all batches.")
    p99_us: Optional[float] = None
    capture_s: Optional[float] = None
    memory_bytes: Optional[int] = Field(None, description="Graph memory (capture pool growth).")
    padding_waste: Optional[float] = Field(
        None, description="1 - real / padded work (rows x positions) of the records it ran.")
    verify: Optional[Literal["passed", "failed", "off"]] = Field(
        None, description="Its buckets' verification: off where none was checked "
        "(capture.verify off, or nothing captured: the eager backend, e.g. the CPU).")
    outputs_equal_first: Optional[bool] = Field(
        None, description="Outputs equal to the first completed variant's within its verify "
        "tolerance, over the records both hold; null for that variant itself.")
    pareto: bool = Field(False, description="On the front: no other variant is at least as "
                         "fast with at most as much memory, and strictly better in one.")


class Sweep(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"title": "graphrun sweep"})

    spec: str
    grid: dict[str, list[Any]]
    stop: Optional[int] = Field(None, description="Records each variant ran (the first N).")
    variants: list[Variant]


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


def measure(spec: Path, base: list[str], name: str, chosen: dict, out: Path, stop: int | None,
            first: Path | None) -> Variant:
    """A completed variant's row from its manifest, latencies and (re-read) input."""
    from graphrun.experiments.compare import bucket_verified, compare_outputs, load_manifest
    from graphrun.generate.records import with_implied_io
    from graphrun.plan.planner import evaluate, histogram
    from graphrun.spec.load import load_spec

    m = load_manifest(out)
    t = m["totals"]
    e2e = []
    lat = out / "latencies.jsonl"
    if lat.is_file():
        e2e = [json.loads(x)["e2e_us"] for x in lat.read_text().splitlines() if x.strip()]
    verdicts = [v for v in map(bucket_verified, m["buckets"]) if v is not None]
    # a generation spec's implied inputs: the prompts' lengths are read as a run reads them
    pspec = with_implied_io(load_spec(spec, list(base) + _overrides(chosen)))
    equal = None
    if first is not None:
        o = compare_outputs(first, load_manifest(first), out, m)
        equal = bool(o.equal or (o.within_tolerance and not o.only_a and not o.only_b))
    return Variant(
        name=name, overrides=chosen, status="completed", records_per_s=t["records_per_s"],
        output_tokens_per_s=(m.get("generation") or {}).get("output_tokens_per_s"),
        p50_us=float(np.percentile(e2e, 50)) if e2e else None,
        p99_us=float(np.percentile(e2e, 99)) if e2e else None,
        capture_s=t["capture_s"], memory_bytes=t["capture_memory_bytes"],
        padding_waste=evaluate(histogram(pspec, stop=stop), pspec.buckets).waste,
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


def sweep(spec: Path, grid: dict[str, list[Any]], out: Path, *, stop: int | None = None,
          base: list[str] = (), echo=print) -> Sweep:
    from graphrun.spec.load import load_spec

    base = every_bucket(list(base), grid)
    load_spec(spec, base)  # the base spec itself must be valid: one message, no sweep
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Variant] = []
    first: Path | None = None
    for name, chosen in variants(grid):
        folder = out / name
        echo(f"{name}: running")
        try:
            load_spec(spec, list(base) + _overrides(chosen))
            error = run_variant(spec, list(base), chosen, folder, stop)
        except GraphrunError as err:
            error = str(err).splitlines()[0]
        if error:
            rows.append(Variant(name=name, overrides=chosen, status="failed", error=error))
            echo(f"{name}: failed: {error}")
            continue
        rows.append(measure(spec, list(base), name, chosen, folder, stop, first))
        tokens = rows[-1].output_tokens_per_s
        echo(f"{name}: {rows[-1].records_per_s:,.1f} records/s"
             + (f", {tokens:,.1f} output tokens/s" if tokens is not None else ""))
        first = first or folder
    mark_pareto(rows)
    result = Sweep(spec=str(spec), grid=grid, stop=stop, variants=rows)
    (out / "sweep.json").write_text(result.model_dump_json(indent=2) + "\n")
    return result
