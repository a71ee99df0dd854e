"""`graphrun compare A B`: two run folders side by side, from their manifest.json and outputs
(or two bench folders: step latency per bucket and mode).

The spec difference as key paths, per-bucket latency ratios (B over A), the totals, and whether
the outputs are equal: by sha256 when both runs wrote the same files, else value by value over
the records both hold (A's outputs are held in memory, keyed by record id). Whether a latency
difference is beyond the noise is judged on the runs' own per-batch latencies (latencies.jsonl,
stats.batch_noise), per bucket and over all batches; two bench folders by their repeats.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from graphrun.base.errors import InputError
from graphrun.experiments.stats import batch_noise, verdict
from graphrun.spec.keys import VerifySpec, allowed_picks

TOTALS = ("records_out", "batches", "records_per_s", "wall_s", "setup_s", "stream_s",
          "capture_s", "capture_memory_bytes", "padding_ratio")
GENERATION_TOTALS = ("output_tokens", "output_tokens_per_s")  # a generation run's, from its section


COUNTS = ("records_in", "records_out", "records_rejected")  # in every manifest's totals


def load_manifest(folder: Path) -> dict:
    path = Path(folder) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        if (Path(folder) / "run.json").is_file():  # a run's folder, killed before its manifest
            raise InputError("no manifest.json: the run in this folder has not finished (it "
                             "was killed, or is still running); finish it with `graphrun run "
                             f"SPEC --out {folder} --resume`, then try again",
                             where=str(folder)) from None
        raise InputError("no manifest.json: not a run folder (run `graphrun run` into it "
                         "first)", where=str(folder)) from None
    except (OSError, ValueError) as exc:
        raise InputError(f"unreadable manifest.json: {exc}", where=str(path)) from None
    # another JSON file under that name was a KeyError or TypeError deep in compare or report
    kinds = {"spec": dict, "totals": dict, "buckets": list, "files": list}
    wrong = [k for k, kind in kinds.items() if not isinstance(manifest, dict)
             or not isinstance(manifest.get(k), kind)]
    if wrong:
        raise InputError(f"not a graphrun manifest (no {', '.join(wrong)} of the right type): "
                         "give the folder `graphrun run` wrote", where=str(path))
    # the counts every manifest has held: one missing was a KeyError in the table it fills
    lacking = [k for k in COUNTS if not isinstance(manifest["totals"].get(k), int)]
    if lacking:
        raise InputError(f"a damaged manifest: totals lacks {', '.join(lacking)}: run the job "
                         "again into this folder (--overwrite), or give another run's folder",
                         where=str(path))
    return manifest


def load_result(folder: Path, name: str, model):
    """bench.json or sweep.json (name) of folder as its pydantic model; an unreadable or
    foreign file is one InputError, not pydantic's report and a traceback."""
    from pydantic import ValidationError

    path = Path(folder) / name
    try:
        return model.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise InputError(f"unreadable {name}: {exc.strerror or exc}", where=str(path)) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        at = ".".join(str(x) for x in first["loc"])
        raise InputError(f"not a {name} graphrun wrote ({exc.error_count()} problem(s); the "
                         f"first: {at + ': ' if at else ''}{first['msg']}): give the folder "
                         f"`graphrun {name.split('.')[0]}` wrote", where=str(path)) from None


def bucket_verified(bucket: dict) -> bool | None:
    """A manifest bucket's verification: True when every lane's graph passed, None where none
    was checked (capture.verify off, a skipped bucket)."""
    lanes = bucket.get("lanes")
    checks = [lane["verify"] for lane in lanes if lane.get("verify")] if isinstance(
        lanes, list) else []
    if not checks and isinstance(bucket.get("verify"), dict):  # a manifest from before lanes
        checks = [bucket["verify"]]
    return all(c["passed"] for c in checks) if checks else None


def spec_diff(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Key paths whose values differ: [("capture.warmup_iters", 3, 5), ...]; a key missing on
    one side reads as None."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in list(a) + [k for k in b if k not in a]:
            out += spec_diff(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
        return out
    return [] if a == b else [(path, a, b)]


def _ratio(a, b) -> float | None:
    if a is None or b is None or not a:
        return None
    return b / a


def batch_latencies(folder: Path) -> dict[str, list[float]]:
    """bucket -> end-to-end us of each of its batches, from the run's latencies.jsonl ({} when
    the run has none)."""
    path = Path(folder) / "latencies.jsonl"
    out: dict[str, list[float]] = {}
    if not path.is_file():
        return out
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out.setdefault(row.get("bucket", ""), []).append(float(row["e2e_us"]))
    return out


def bucket_rows(ma: dict, mb: dict, la: dict | None = None, lb: dict | None = None
                ) -> list[dict]:
    """Per bucket that ran batches in either run: batches and e2e p50/p99 (us) of each, B/A,
    and whether the difference is beyond the batches' noise (la, lb: batch_latencies)."""
    la, lb = la or {}, lb or {}
    a = {x["name"]: x for x in ma["buckets"]}
    b = {x["name"]: x for x in mb["buckets"]}
    rows = []
    for name in list(a) + [n for n in b if n not in a]:
        row: dict[str, Any] = {"bucket": name}
        for side, got in (("a", a.get(name)), ("b", b.get(name))):
            e2e = (got or {}).get("latency_us", {}).get("e2e", {})
            row[f"{side}_batches"] = (got or {}).get("batches")
            row[f"{side}_p50_us"] = e2e.get("p50")
            row[f"{side}_p99_us"] = e2e.get("p99")
        row["p50_ratio"] = _ratio(row["a_p50_us"], row["b_p50_us"])
        row["p99_ratio"] = _ratio(row["a_p99_us"], row["b_p99_us"])
        noise = batch_noise(la.get(name, []), lb.get(name, []))
        row["significant"], row["noise"] = noise.significant, noise.text
        if row["a_batches"] or row["b_batches"]:  # buckets no batch reached say nothing
            rows.append(row)
    return rows


def totals_rows(ma: dict, mb: dict) -> list[dict]:
    """The totals of both runs and B/A; a generation run's output tokens and tokens/s too."""
    pairs = [(k, ma["totals"].get(k), mb["totals"].get(k)) for k in TOTALS]
    ga, gb = ma.get("generation") or {}, mb.get("generation") or {}
    if ga or gb:
        pairs += [(k, ga.get(k), gb.get(k)) for k in GENERATION_TOTALS]
    return [{"total": k, "a": a, "b": b, "ratio": _ratio(a, b)} for k, a, b in pairs]


# ---- outputs ------------------------------------------------------------------------------------

def read_outputs(folder: Path, manifest: dict) -> Iterator[tuple[Any, dict[str, np.ndarray]]]:
    """(record id, {output: array}) for every row of the run's output files, in file order."""
    names = list(manifest["spec"]["outputs"])
    if not names and manifest["spec"].get("generate"):  # implied outputs: the new tokens
        names = ["token_ids"]
    paths = [Path(folder) / f["path"] for f in manifest["files"]]
    for path in paths:
        if path.name.endswith(".jsonl"):
            with open(path, "rb") as f:
                for line in f:
                    rec = json.loads(line)
                    yield rec["id"], {n: np.asarray(rec[n], np.float64) for n in names}
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path).to_pydict()
            for i, rid in enumerate(table["id"]):
                yield rid, {n: np.asarray(table[n][i], np.float64) for n in names}
        elif path.name.endswith(".ids.npy"):
            stem = path.name[: -len(".ids.npy")]
            ids = np.load(path).tolist()
            arrays = {n: np.load(path.with_name(f"{stem}.{n}.npy"), mmap_mode="r")
                      for n in names}
            for i, rid in enumerate(ids):
                yield rid, {n: np.asarray(arrays[n][i], np.float64) for n in names}


@dataclass
class OutputsResult:
    equal: bool
    how: str  # "sha256" or "values"
    common: int = 0  # records both runs hold
    only_a: int = 0
    only_b: int = 0
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    shape_mismatch: int = 0
    within_tolerance: bool | None = None  # A's verify rtol/atol, over the common records
    picks_differ: dict[str, int] = field(default_factory=dict)  # picked ids: records differing


def picked_outputs(spec: dict) -> set[str]:
    """The outputs holding picked ids (argmax, top-k ids), from a manifest's spec."""
    picked = set()
    for name, o in spec.get("outputs", {}).items():
        topk, reduce = o.get("topk"), o.get("reduce") or []
        if (topk.get("take", "ids") == "ids") if topk else (reduce[-1:] == ["argmax"]):
            picked.add(name)
    return picked


def _files(m: dict) -> list[tuple[str, str]]:
    return sorted((f["path"], f["sha256"]) for f in m["files"])


def compare_outputs(a_dir: Path, ma: dict, b_dir: Path, mb: dict) -> OutputsResult:
    if _files(ma) == _files(mb) and ma["files"]:
        return OutputsResult(True, "sha256", common=ma["totals"]["records_out"],
                             within_tolerance=True)
    held = dict(read_outputs(a_dir, ma))
    verify = ma["spec"].get("capture", {}).get("verify", {})
    rtol, atol = verify.get("rtol", 1e-3), verify.get("atol", 1e-3)
    picks = picked_outputs(ma["spec"])
    res = OutputsResult(False, "values", within_tolerance=True)
    seen = set()
    for rid, outs in read_outputs(b_dir, mb):
        mine = held.get(rid)
        if mine is None:
            res.only_b += 1
            continue
        seen.add(rid)
        res.common += 1
        for name, value in outs.items():
            other = mine.get(name)
            if other is None or other.shape != value.shape:
                res.shape_mismatch += 1
                res.within_tolerance = False
                continue
            if value.size:
                diff = float(np.max(np.abs(value - other)))
                if math.isnan(diff) or diff > res.max_abs_diff.get(name, -1.0):
                    res.max_abs_diff[name] = diff
                if name in picks:  # ids of near-tied scores may swap: counted, judged below
                    res.picks_differ[name] = res.picks_differ.get(name, 0) + bool(diff)
                elif not np.allclose(value, other, rtol=rtol, atol=atol, equal_nan=True):
                    res.within_tolerance = False
    share = verify.get("picked_rows", VerifySpec.model_fields["picked_rows"].default)
    if any(n > allowed_picks(share, res.common) for n in res.picks_differ.values()):
        res.within_tolerance = False
    res.only_a = len(held) - len(seen)
    res.equal = (res.shape_mismatch == 0 and res.only_a == res.only_b == 0
                 and all(v == 0 for v in res.max_abs_diff.values()))
    return res


def compare_bench(a: Path, b: Path) -> dict:
    """Two bench folders: per bucket and mode, p50 and p99 of each and B/A."""
    from graphrun.experiments.bench import Bench

    ba, bb = (load_result(x, "bench.json", Bench) for x in (a, b))
    rows = []
    theirs = {(k.name, m.mode): m for k in bb.buckets for m in k.modes}
    for bucket in ba.buckets:
        for m in bucket.modes:
            other = theirs.get((bucket.name, m.mode))
            if other is None:
                continue
            judged = (verdict({"A": m.p50_spread_us, "B": other.p50_spread_us}, "p50 us",
                              higher=False) if m.p50_spread_us and other.p50_spread_us
                      else None)
            rows.append({"bucket": bucket.name, "mode": m.mode,
                         "a_p50_us": m.latency_us["p50"], "b_p50_us": other.latency_us["p50"],
                         "p50_ratio": _ratio(m.latency_us["p50"], other.latency_us["p50"]),
                         "a_p99_us": m.latency_us["p99"], "b_p99_us": other.latency_us["p99"],
                         "p99_ratio": _ratio(m.latency_us["p99"], other.latency_us["p99"]),
                         "significant": bool(judged and judged.winner),
                         "noise": judged.text if judged else "no repeats recorded (a bench "
                         "from before repeats): no significant difference claimed"})
    return {"a": str(a), "b": str(b), "kind": "bench", "devices": [ba.device, bb.device],
            "buckets": rows, "timing": timing_line(rows)}


def timing_line(rows: list[dict]) -> str:
    beyond = [f"{r['bucket']}" + (f" {r['mode']}" if "mode" in r else "") for r in rows
              if r["significant"]]
    if not beyond:
        return "timing: no significant difference in any bucket (within the noise)"
    return f"timing: beyond the noise in {', '.join(beyond)}; within it elsewhere"


def compare(a: Path, b: Path) -> dict:
    """Everything `graphrun compare` shows, JSON-able."""
    if (Path(a) / "bench.json").is_file() and (Path(b) / "bench.json").is_file():
        return compare_bench(a, b)
    ma, mb = load_manifest(a), load_manifest(b)
    la, lb = batch_latencies(a), batch_latencies(b)
    outputs = compare_outputs(a, ma, b, mb)
    overall = batch_noise([x for v in la.values() for x in v], [x for v in lb.values() for x in v])
    return {"a": str(a), "b": str(b),
            "spec_diff": [{"key": k, "a": va, "b": vb}
                          for k, va, vb in spec_diff(ma["spec"], mb["spec"])],
            "notes": [n for n in (status_note("A", ma), status_note("B", mb),
                                  resumed_note("A", ma), resumed_note("B", mb)) if n],
            "buckets": bucket_rows(ma, mb, la, lb), "totals": totals_rows(ma, mb),
            "outputs": asdict(outputs), "only_timing_differs": outputs.equal,
            "timing": overall.model_dump(), "verdict": verdict_line(outputs.equal, overall)}


def status_note(name: str, m: dict) -> str | None:
    """Where a run did not complete: its status and why, first, so that outputs compared over
    what it committed are not read as a finished run's."""
    status = m.get("status", "completed")
    if status == "completed":
        return None
    why = (m.get("error") or "").splitlines()[0] if m.get("error") else ""
    return (f"{name}'s run did not complete (status {status}{': ' + why if why else ''}): "
            f"its outputs are the {m.get('totals', {}).get('records_out', 0):,} records it "
            "committed")


def resumed_note(name: str, m: dict) -> str | None:
    """Where a run was resumed: records_out is its whole output, its other totals are its last
    attempt's."""
    if m.get("resumed_from") is None:
        return None
    t = m["totals"]
    out, earlier = t["records_out"], t.get("earlier_records_out", 0)
    return (f"{name} was resumed (--resume) at record {m['resumed_from']}: its records_out is "
            f"its whole output, its other totals are its last attempt's ({out - earlier:,} of "
            f"its {out:,} records out)")


def verdict_line(identical: bool, overall) -> str:
    """The answer first: are the outputs the same, and is the timing difference real?"""
    head = ("outputs identical: only timing differs. " if identical else "")
    return (f"{head}Timing over all batches: {overall.text}; the totals are one number a run, "
            "with no spread of their own")


# ---- the table ----------------------------------------------------------------------------------

def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def latency(us) -> str:
    """A latency in the unit that reads: us below 10 ms, ms below 1 s, else s."""
    if us is None:
        return "-"
    if us < 10_000:
        return f"{us:,.0f} us" if us >= 100 else f"{us:.3g} us"
    if us < 1_000_000:
        return f"{us / 1e3:.1f} ms"
    return f"{us / 1e6:,.2f} s"


def _table(title: str, head: tuple[str, ...], rows: list[tuple[str, ...]], left: int = 1):
    """A table whose first column is never cut (bucket names differ only at their end:
    batch=16,prompt=128 / =256) and whose cells never wrap; a header of two words takes two
    lines. left: columns aligned left."""
    from rich.table import Table

    table = Table(title=title)
    for i, col in enumerate(head):
        width = max((len(r[i]) for r in rows), default=1) if i == 0 else None
        table.add_column(col if i < left else col.replace(" ", "\n", 1), no_wrap=True,
                         justify="left" if i < left else "right", min_width=width)
    for r in rows:
        table.add_row(*r)
    return table


def print_compare(result: dict, console) -> None:
    from rich.table import Table

    a, b = result["a"], result["b"]
    console.print(f"A = {a}\nB = {b}")
    if result.get("kind") == "bench":
        console.print(_table(
            f"bench step latency, on {' vs '.join(result['devices'])}",
            ("bucket", "mode", "A p50", "B p50", "B/A p50", "A p99", "B p99", "B/A p99",
             "beyond noise"),
            [(r["bucket"], r["mode"], latency(r["a_p50_us"]), latency(r["b_p50_us"]),
              _num(r["p50_ratio"]), latency(r["a_p99_us"]), latency(r["b_p99_us"]),
              _num(r["p99_ratio"]), "yes" if r["significant"] else "no")
             for r in result["buckets"]], left=2))
        console.print(result["timing"], soft_wrap=True)
        return
    diff = Table(title="spec difference")
    for col in ("key", "A", "B"):
        diff.add_column(col)
    for d in result["spec_diff"]:
        diff.add_row(d["key"], json.dumps(d["a"]), json.dumps(d["b"]))
    console.print(diff if result["spec_diff"] else "specs are identical")
    for note in result.get("notes", []):
        console.print(note, soft_wrap=True)
    console.print(_table(
        "per bucket, end-to-end latency",
        ("bucket", "A batches", "B batches", "A p50", "B p50", "B/A p50", "A p99", "B p99",
         "B/A p99", "beyond noise"),
        [(r["bucket"], _num(r["a_batches"]), _num(r["b_batches"]), latency(r["a_p50_us"]),
          latency(r["b_p50_us"]), _num(r["p50_ratio"]), latency(r["a_p99_us"]),
          latency(r["b_p99_us"]), _num(r["p99_ratio"]), "yes" if r["significant"] else "no")
         for r in result["buckets"]]))
    console.print(_table("totals", ("total", "A", "B", "B/A"), [
        (r["total"], _num(r["a"]), _num(r["b"]), _num(r["ratio"])) for r in result["totals"]]))
    console.print(outputs_line(result["outputs"]))
    console.print(result["verdict"], soft_wrap=True)


def outputs_line(o: dict) -> str:
    if o["how"] == "sha256":
        return "outputs: identical (same files, same sha256)"
    diffs = ", ".join(f"{k} {v:.3g}" for k, v in o["max_abs_diff"].items()) or "none"
    if not o["common"]:
        return (f"outputs: not compared, no record is in both runs ({o['only_a']} only in A, "
                f"{o['only_b']} only in B)")
    verdict = "equal" if o["equal"] else (
        "within A's verify tolerance" if o["within_tolerance"] else "DIFFERENT")
    extra = f"; {o['only_a']} only in A, {o['only_b']} only in B" if (
        o["only_a"] or o["only_b"]) else ""
    extra += f"; {o['shape_mismatch']} shape mismatches" if o["shape_mismatch"] else ""
    extra += "".join(f"; {name}: other ids in {n} records" for name, n in
                     o.get("picks_differ", {}).items() if n)
    return (f"outputs: {verdict} over {o['common']} records both hold; largest absolute "
            f"difference: {diffs}{extra}")
