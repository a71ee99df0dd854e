"""A generation job's set-up in a fresh process (issue 48: graph set-up <= 1.5 s at the 134M and
1.24B layouts, <= 5 s at 8B), with the kernels' warm-up on and off, with an empty Triton cache
or a primed one.

    python3 benchmarks/bench_fresh_setup.py [--cold-cache] [--layouts 134M,1.24B]
        [--ways warm-up,no-warm-up] [--prompts 512] [--new-tokens 128] [--repeat 1]
        [--timeout 280] [--set KEY=VALUE ...] [--json FILE] [--smoke]

Per layout (bench_decode_step.py's: graphrun's builtin Llama, seeded, bf16, saved as a Hugging
Face folder by benchmarks/hf_folder.py, its generation_config naming bench_continuous.py's stop
ids), a prompts file of bench_continuous.py's prompts as text, and the spec `graphrun init --hf
FOLDER --data prompts.jsonl --task generate` writes (slots: auto). Then, per way, --repeat
fresh processes `python -m graphrun run SPEC -q`, each timed from outside:
  warm-up     as shipped: the kernels warmed on a thread while the weights load
  no-warm-up  GRAPHRUN_KERNEL_WARM_UP=off: the first graph's set-up compiles them, as before
--cold-cache: every process gets an empty TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR of its
own (a fresh machine's first run); without it, one run (not reported) primes a cache folder of
this benchmark's that every later process shares (a machine's second run).
Printed per run, from its manifest: the engine's set-up (the phase "bucket setup" plus the
phases nested in it: the prefill graphs' "attention plans" and the wait for the warm-up,
"kernel warm-up": what the issue's target is about), the graphs' own set-up
(generation.graphs[].set_up_s summed) and their count, the warm-up's wait and its own time on its
thread, the model build, the setup before the stream, and the whole process's wall time; then a
table. --json (default $OUT/bench_fresh_setup.json, else ./) keeps every run's phases too.
--smoke: the tiny layout on whatever device there is (float32 on the CPU, where the warm-up is
skipped), 24 prompts, 16 new tokens: a check of the plumbing.
H200 budget: both layouts, both ways, about 3 minutes; 8B (--layouts 8B: a 16 GB folder) about
4 minutes more.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_generate_batch import child_env, timed_process  # noqa: E402

WAYS = {"warm-up": "on", "no-warm-up": "off"}  # -> GRAPHRUN_KERNEL_WARM_UP
TARGET_S = {"134M": 1.5, "1.24B": 1.5, "8B": 5.0}  # issue 48: the engine's set-up at most


def write_job(layout: str, work: Path, *, prompts: int, new: int, device, dtype,
              timeout: float) -> Path:
    """The layout's folder, its prompts file and the spec init writes for them."""
    from benchmarks.bench_continuous import prompts_of, stop_ids
    from benchmarks.bench_decode_step import LAYOUTS
    from benchmarks.hf_folder import write_folder, write_prompts

    vocab = LAYOUTS[layout]["vocab"]
    work.mkdir(parents=True)
    write_folder(layout, work / "model", device=device, dtype=dtype,
                 max_positions=512 + new, eos_ids=stop_ids(vocab))
    write_prompts(work / "prompts.jsonl", prompts_of(prompts, vocab))
    spec = work / "spec.yaml"
    init = [sys.executable, "-m", "graphrun", "init", "--hf", str(work / "model"), "--data",
            str(work / "prompts.jsonl"), "--task", "generate", "--max-new-tokens", str(new),
            "--temperature", "1", "--seed", "0", "--dtype", str(dtype).removeprefix("torch."),
            "--batch-size", "64", "-o", str(spec), "--out-dir", str(work / "out"), "--force"]
    _, failed = timed_process(init, ROOT, timeout)
    if failed:
        raise SystemExit(f"{layout}: graphrun init failed: {failed}")
    return spec


def run_job(spec: Path, out: Path, *, warm_up: str, cache: Path, timeout: float,
            sets: list[str] = ()) -> dict:
    """One fresh `graphrun run` process (sets: its --set overrides); what its manifest says of
    its set-up."""
    env = child_env(GRAPHRUN_KERNEL_WARM_UP=warm_up, TRITON_CACHE_DIR=str(cache / "triton"),
                    TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    argv = [sys.executable, "-m", "graphrun", "run", str(spec), "-q", "--overwrite",
            "--out", str(out), *[a for kv in sets for a in ("--set", kv)]]
    wall, failed = timed_process(argv, ROOT, timeout, env)
    if failed:
        return {"status": "failed", "note": failed, "process_wall_s": wall}
    m = json.loads((out / "manifest.json").read_text())
    gen, totals = m["generation"], m["totals"]
    phases = {p["name"]: p["s"] for p in m["phases"]["top"]}
    warm = gen.get("warm_up") or {}
    graphs = gen.get("graphs", [])
    wait = phases.get("kernel warm-up", 0.0)
    plans = phases.get("attention plans", 0.0)  # this thread's, built while the warm-up runs
    return {"status": "ok", "process_wall_s": wall,
            "engine_setup_s": phases.get("bucket setup", 0.0) + wait + plans,
            "warm_up_wait_s": wait, "attention_plans_s": plans,
            "warm_up_run_s": warm.get("run_s"),
            "warm_up_status": warm.get("status"), "warm_up_reason": warm.get("reason"),
            "graphs_setup_s": sum(g.get("set_up_s") or 0.0 for g in graphs),
            "first_graph_s": max((g.get("set_up_s") or 0.0 for g in graphs), default=0.0),
            "graphs": len(graphs), "slots": gen["slots"],
            # each graph's set-up and capture seconds, in set-up order: where a first run's
            # one-time costs land
            "per_graph": [[g["kind"], g["size"], g.get("set_up_s"), g.get("capture_s")]
                          for g in graphs],
            "model_build_s": phases.get("model build"), "setup_s": totals["setup_s"],
            "process_s": totals.get("process_wall_s"), "phases_s": phases,
            "output_tokens": gen["output_tokens"]}


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cold-cache", action="store_true",
                    help="an empty Triton and inductor cache for every process")
    ap.add_argument("--layouts", default="134M,1.24B")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1, help="processes per layout and way")
    ap.add_argument("--timeout", type=float, default=280.0, help="seconds per process")
    ap.add_argument("--json", default=str(Path(os.environ.get("OUT", ".")) /
                                          "bench_fresh_setup.json"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a spec override for every run (graphrun run --set), repeatable")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.layouts, a.prompts, a.new_tokens = "tiny", 24, 16
    layouts, ways = a.layouts.split(","), a.ways.split(",")
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        ap.error(f"unknown ways: {', '.join(unknown)} (give {', '.join(WAYS)})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and not a.smoke else torch.float32
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    cache_how = "cold (empty per process)" if a.cold_cache else "primed (shared, one run first)"
    print(f"# bench_fresh_setup: {', '.join(layouts)} on {gpu}, torch {torch.__version__}, "
          f"{str(dtype).removeprefix('torch.')}; {a.prompts} prompts, {a.new_tokens} new at most; "
          f"Triton cache {cache_how}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench_fresh_setup-",
                                 dir=os.environ.get("BENCH_WORK") or None))
    rows: dict[str, list[dict]] = {}
    try:
        for layout in layouts:
            t0 = time.perf_counter()
            spec = write_job(layout, work / layout, prompts=a.prompts, new=a.new_tokens,
                             device=device, dtype=dtype, timeout=a.timeout)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the folder's model is gone: the runs get the memory
            print(f"{layout}: folder, prompts and spec in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            shared = work / layout / "cache"
            if not a.cold_cache:
                primed = run_job(spec, work / layout / "prime", warm_up="on", cache=shared,
                                 timeout=a.timeout, sets=a.set)
                print(f"  primed the cache: {primed['status']} {primed.get('note', '')}"
                      .rstrip(), flush=True)
            for way in ways:
                for i in range(a.repeat):
                    cache = work / layout / f"cache-{way}-{i}" if a.cold_cache else shared
                    r = run_job(spec, work / layout / f"out-{way}-{i}", warm_up=WAYS[way],
                                cache=cache, timeout=a.timeout, sets=a.set)
                    rows.setdefault(f"{layout}/{way}", []).append(r)
                    print(f"  {way} #{i + 1}: " + (
                        f"engine set-up {r['engine_setup_s']:.2f} s (attention plans "
                        f"{r['attention_plans_s']:.2f}, warm-up wait "
                        f"{r['warm_up_wait_s']:.2f}, its run {r['warm_up_run_s'] or 0:.2f}, "
                        f"{r['warm_up_status']}), {r['graphs']} graphs "
                        f"{r['graphs_setup_s']:.2f} s, model build {r['model_build_s']:.2f} s, "
                        f"process {r['process_wall_s']:.2f} s"
                        if r["status"] == "ok" else f"{r['status']}: {r['note']}"), flush=True)
                    if r["status"] == "ok":
                        print("    set-up ms (capture ms) per graph: " + ", ".join(
                            f"{k} {n}={1e3 * (t or 0):.0f} ({1e3 * (c or 0):.0f})"
                            for k, n, t, c in r["per_graph"]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(rows, cache_how)
    Path(a.json).write_text(json.dumps({
        "environment": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": gpu,
                        "torch": torch.__version__, "dtype": str(dtype), "args": vars(a)},
        "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


def print_table(rows: dict[str, list[dict]], cache_how: str) -> None:
    """Medians over the runs of each layout and way."""
    print(f"\nTriton cache: {cache_how}; medians of the runs\n")
    print("| layout | way | engine set-up s | target s | warm-up wait s | warm-up run s | "
          "graphs | graphs' set-up s | largest graph s | model build s | setup s | "
          "process wall s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, runs in rows.items():
        layout, way = key.split("/")
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            print(f"| {layout} | {way} | failed: {runs[0].get('note', '')} |")
            continue

        def med(name: str) -> float:
            return statistics.median(r[name] or 0.0 for r in ok)

        target = TARGET_S.get(layout)
        print(f"| {layout} | {way} | {med('engine_setup_s'):.2f} | "
              f"{target if target else '-'} | {med('warm_up_wait_s'):.2f} | "
              f"{med('warm_up_run_s'):.2f} | {ok[0]['graphs']} | {med('graphs_setup_s'):.2f} | "
              f"{med('first_graph_s'):.2f} | {med('model_build_s'):.2f} | {med('setup_s'):.2f} | "
              f"{med('process_wall_s'):.2f} |")


if __name__ == "__main__":
    sys.exit(main())
