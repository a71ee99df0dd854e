"""graphrun against transformers' continuous batching (`model.generate_batch`, its paged cache),
each as a whole process, on bench_continuous.py's job (issue 48: graphrun's whole process
>= 5x generate_batch's on the varied job).

    python3 benchmarks/bench_generate_batch.py [--layout 134M] [--prompts 1024]
        [--new-tokens 128] [--stop-ids N] [--slots 64|auto] [--jobs varied,fixed]
        [--ways graphrun,generate_batch] [--hf-max-requests N] [--set KEY=VALUE]
        [--timeout 280] [--json FILE] [--smoke]

The model: graphrun's builtin Llama in one of bench_decode_step.py's layouts, seeded, built on
the device (bf16 on a GPU) and saved as a Hugging Face Llama folder (benchmarks/hf_folder.py),
so both ways load the very same weights. The prompts: bench_continuous.py's (--prompts of
16-512 tokens, median 51), as the text of a JSONL file whose word t<id> is token <id>.
Jobs, both sampled (temperature 1, no top-k or top-p, seed 0), --new-tokens at most:
  varied  the folder's generation_config.json names --stop-ids EOS ids (by default 560 per
          32,000 of the vocabulary: completions average about 45 of 128), as a model's own
  fixed   the same weights in a folder with no EOS id: every record generates them all
Ways, each a subprocess timed from before its start to its exit:
  graphrun        `python -m graphrun init --hf FOLDER --data prompts.jsonl --task generate
                  --max-new-tokens N --temperature 1 --seed 0 --dtype D --batch-size SLOTS`
                  (as a user writes the spec; its seconds printed apart), then `python -m
                  graphrun run SPEC -q` (--slots auto adds --set generate.slots=auto; --set
                  passes more). Its manifest gives the generate tokens/s (output tokens /
                  prefill + decode time), the graphs' set-up and the decode waste.
  generate_batch  a fresh Python (this script, --child): import transformers,
                  AutoModelForCausalLM.from_pretrained(FOLDER).to(device), then
                  model.generate_batch(the prompts' ids, GenerationConfig(max_new_tokens,
                  do_sample, temperature 1, top_k 0, top_p 1, the folder's EOS ids),
                  ContinuousBatchingConfig(seed 0, --hf-max-requests as
                  max_requests_per_batch; the rest transformers' own choice from the memory
                  left)). Its generate tokens/s: output tokens / the generation's span,
                  from its first request added to its last finished (after the manager's
                  set-up and warm-up, which the call's wall, also printed, holds).
Printed per job and way: whole-process wall, generate tokens/s, mean output tokens, records;
the ratio of generate_batch's whole process to graphrun's; all of it in --json (default
$OUT/bench_generate_batch.json, else ./).
--smoke: the tiny layout on whatever device there is (float32 on the CPU), 24 prompts, 16 new
tokens, 8 slots, and generate_batch given a small cache (on the CPU it sizes it from the
host's memory otherwise, which takes half a minute): a check of the plumbing.
H200 budget: the 134M layout about 1.5 min, the 1.24B about 2.5 min (one command each).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WAYS = ("graphrun", "generate_batch")
JOBS = ("varied", "fixed")
SMOKE_CACHE = dict(num_blocks=512, page_size=16, max_batch_tokens=1024)


def _hub_kernels() -> bool:
    """Whether this transformers loads hub kernels (then from_pretrained takes use_kernels)."""
    import transformers

    return hasattr(transformers.PreTrainedModel, "use_kernels")


def child_env(**extra: str) -> dict:
    """This environment with the project first on PYTHONPATH (the worktree's graphrun), and
    `extra`."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + rest), **extra}


def timed_process(argv: list[str], cwd: Path, timeout: float,
                  env: dict | None = None) -> tuple[float, str | None]:
    """(wall seconds from before its start to its exit, None or why it failed); env: the
    child's (default child_env())."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=cwd, env=env or child_env(), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t0, f"ran past {timeout:g} s; stopped"
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        said = next((ln for ln in lines if ln.lower().startswith("error")),
                    lines[-1] if lines else "no output")
        return wall, f"exit {proc.returncode}: {said[:300]}"
    return wall, None


# ---- graphrun ---------------------------------------------------------------------------------

def run_graphrun(folder: Path, prompts_file: Path, work: Path, *, new: int, slots: str,
                 dtype: str, sets: list[str], timeout: float) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    spec = work / "spec.yaml"
    init = [sys.executable, "-m", "graphrun", "init", "--hf", str(folder), "--data",
            str(prompts_file), "--task", "generate", "--max-new-tokens", str(new),
            "--temperature", "1", "--seed", "0", "--dtype", dtype,
            "--batch-size", slots if slots != "auto" else "64", "-o", str(spec),
            "--out-dir", str(work / "out"), "--force"]
    init_s, failed = timed_process(init, work, timeout)
    if failed:
        return {"status": "failed", "note": f"init: {failed}"}
    extra = (["--set", "generate.slots=auto"] if slots == "auto" else []) + \
        [x for s in sets for x in ("--set", s)]
    run = [sys.executable, "-m", "graphrun", "run", str(spec), "-q", "--overwrite", *extra]
    wall, failed = timed_process(run, work, timeout)
    if failed:
        return {"status": "failed", "note": f"run: {failed}", "init_s": init_s}
    m = json.loads((work / "out" / "manifest.json").read_text())
    gen, totals = m["generation"], m["totals"]
    phases = {p["name"]: p["s"] for p in m["phases"]["top"]}
    graphs = gen.get("graphs", [])
    return {"status": "ok", "process_wall_s": wall, "init_s": init_s,
            "generate_s": gen["prefill_s"] + gen["decode_s"],
            "generate_tokens_per_s": gen["output_tokens_per_s"],
            "output_tokens": gen["output_tokens"], "records": gen["records"],
            "mean_output_tokens": gen["output_tokens"] / max(1, gen["records"]),
            "stream_s": totals["stream_s"], "model_code": m["environment"].get("model_code"),
            "graph_setup_s": sum(g.get("set_up_s") or 0.0 for g in graphs),
            "graphs": len(graphs), "slots": gen["slots"], "wasted": gen["wasted_fraction"],
            "setup_s": totals["setup_s"], "imports_s": phases.get("interpreter and imports"),
            "phases_s": phases, "warm_up": gen.get("warm_up")}


# ---- transformers' generate_batch -------------------------------------------------------------

def run_generate_batch(folder: Path, ids_file: Path, work: Path, *, new: int, dtype: str,
                       max_requests: int | None, smoke: bool, timeout: float) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    result = work / "result.json"
    job = {"folder": str(folder), "ids": str(ids_file), "new": new, "dtype": dtype,
           "max_requests": max_requests, "cache": SMOKE_CACHE if smoke else {}}
    (work / "job.json").write_text(json.dumps(job))
    started = time.time()
    wall, failed = timed_process([sys.executable, __file__, "--child", str(work / "job.json"),
                                  str(result)], work, timeout)
    if failed:
        return {"status": "failed", "note": failed}
    got = json.loads(result.read_text())
    return {"status": "ok", "process_wall_s": wall, **got,
            "imports_s": got.pop("imports_done") - started,
            "generate_tokens_per_s": got["output_tokens"] / got["generate_s"],
            "mean_output_tokens": got["output_tokens"] / max(1, got["records"])}


def child(job_path: str, result_path: str) -> int:
    """--child: one generate_batch job in this fresh process."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    imports_done = time.time()
    job = json.loads(Path(job_path).read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    # .to(device), not device_map: that needs accelerate, which the GPU machine may lack
    # hub kernels off, as graphrun loads a folder (they are code from the Hub)
    no_hub = {"use_kernels": False} if _hub_kernels() else {}
    model = AutoModelForCausalLM.from_pretrained(job["folder"], dtype=getattr(torch, job["dtype"]),
                                                 **no_hub).to(device).eval()
    load_s = time.perf_counter() - t0
    prompts = json.loads(Path(job["ids"]).read_text())
    eos = model.generation_config.eos_token_id  # the folder's: the job's stop ids, or none
    config = GenerationConfig(max_new_tokens=job["new"], do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=0)
    cb = ContinuousBatchingConfig(seed=0, max_requests_per_batch=job["max_requests"],
                                  **job["cache"])
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb)
    if device.type == "cuda":
        torch.cuda.synchronize()
    call_s = time.perf_counter() - t0
    done = [o for o in out.values() if o.error is None]
    lengths = [len(o.generated_tokens) for o in done]
    # the first request added (after the manager's set-up and warm-up) to the last finished
    window = max(o.lifespan[1] for o in done) - min(o.created_time for o in done)
    Path(result_path).write_text(json.dumps({
        "imports_done": imports_done, "load_s": load_s, "generate_s": window, "call_s": call_s,
        "output_tokens": sum(lengths), "records": len(lengths),
        "failed_records": len(prompts) - len(lengths), "transformers": transformers.__version__,
        "attention": model.config._attn_implementation,
        "max_requests_per_batch": cb.max_requests_per_batch, "num_blocks": cb.num_blocks,
        "max_batch_tokens": cb.max_batch_tokens}))
    return 0


# ---- the run ----------------------------------------------------------------------------------

def no_eos_folder(src: Path, dst: Path) -> None:
    """The same weights (linked, else copied) with no EOS id: the fixed job's model."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        target = dst / f.name
        if f.suffix == ".safetensors":
            try:
                os.link(f, target)
                continue
            except OSError:
                pass
        shutil.copy(f, target)
    for name in ("config.json", "generation_config.json"):
        d = json.loads((dst / name).read_text())
        d["eos_token_id"] = None
        (dst / name).write_text(json.dumps(d, indent=2))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(*argv[1:3])
    import numpy as np
    import torch

    from benchmarks.bench_continuous import prompts_of, stop_ids
    from benchmarks.bench_decode_step import LAYOUTS
    from benchmarks.hf_folder import write_folder, write_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="134M", choices=sorted(LAYOUTS))
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--stop-ids", type=int, default=None,
                    help="EOS ids of the varied job (default: 560 per 32,000 of the vocab)")
    ap.add_argument("--slots", default="64", help="graphrun's slots: a number or auto")
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--hf-max-requests", type=int, default=None,
                    help="generate_batch's max_requests_per_batch (default: its own choice)")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="KEY=VALUE passed to graphrun run --set (repeatable)")
    ap.add_argument("--timeout", type=float, default=280.0, help="seconds per process")
    ap.add_argument("--json", default=str(Path(os.environ.get("OUT", ".")) /
                                          "bench_generate_batch.json"))
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.layout, a.prompts, a.new_tokens, a.slots = "tiny", 24, 16, "8"
    jobs, ways = a.jobs.split(","), a.ways.split(",")
    unknown = [j for j in jobs if j not in JOBS] + [w for w in ways if w not in WAYS]
    if unknown:
        ap.error(f"unknown: {', '.join(unknown)} (jobs: {', '.join(JOBS)}; ways: "
                 f"{', '.join(WAYS)})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and not a.smoke else torch.float32
    dtype_name = str(dtype).removeprefix("torch.")
    vocab = LAYOUTS[a.layout]["vocab"]
    prompts = prompts_of(a.prompts, vocab)
    stops = stop_ids(vocab, a.stop_ids)
    # graphrun's modules compiled first, as pip install compiles a package's (transformers'
    # were): a fresh checkout's first process would compile them inside its timed imports
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "graphrun")],
                   check=True, capture_output=True)
    work = Path(os.environ.get("BENCH_WORK") or "/tmp") / f"bench_generate_batch-{os.getpid()}"
    work.mkdir(parents=True)
    folders = {"varied": work / "model", "fixed": work / "model-no-eos"}
    wrote = write_folder(a.layout, folders["varied"], device=device, dtype=dtype,
                         max_positions=512 + a.new_tokens, eos_ids=stops)
    no_eos_folder(folders["varied"], folders["fixed"])
    write_prompts(work / "prompts.jsonl", prompts)
    (work / "ids.json").write_text(json.dumps(prompts))
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    lengths = [len(p) for p in prompts]
    print(f"# bench_generate_batch: {a.layout} on {gpu}, torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}, {dtype_name}; "
          f"{a.prompts} prompts of {min(lengths)}-{max(lengths)} tokens (median "
          f"{int(np.median(lengths))}), {a.new_tokens} new at most, {len(stops)} stop ids "
          f"(varied); folder written in {wrote['build_s'] + wrote['write_s']:.1f} s", flush=True)
    del prompts
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows = {}
    for name in jobs:
        for way in ways:
            print(f"  {name}: {way} ...", end="", flush=True)
            if way == "graphrun":
                r = run_graphrun(folders[name], work / "prompts.jsonl", work / f"{name}-graphrun",
                                 new=a.new_tokens, slots=a.slots, dtype=dtype_name,
                                 sets=a.sets, timeout=a.timeout)
            else:
                r = run_generate_batch(folders[name], work / "ids.json",
                                       work / f"{name}-generate_batch", new=a.new_tokens,
                                       dtype=dtype_name, max_requests=a.hf_max_requests,
                                       smoke=a.smoke, timeout=a.timeout)
            rows[f"{name}/{way}"] = r
            print(f" {r['status']} {r.get('note', '')}".rstrip(), flush=True)
    print_table(rows, jobs)
    shutil.rmtree(work, ignore_errors=True)
    out = {"environment": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": gpu,
                           "torch": torch.__version__, "dtype": dtype_name,
                           "transformers": __import__("transformers").__version__,
                           "args": vars(a), "stop_ids": len(stops), "folder": wrote},
           "rows": rows}
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


def print_table(rows: dict, jobs: list[str]) -> None:
    print("\n| job | way | whole process s | imports s | generate s | generate tokens/s | "
          "mean output tokens | records | notes |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for key, r in rows.items():
        job, way = key.split("/")
        if r["status"] != "ok":
            print(f"| {job} | {way} | | | | | | | {r['status']}: {r.get('note', '')} |")
            continue
        if way == "graphrun":
            note = (f"init {r['init_s']:.1f} s apart; {r['model_code']}'s model code; "
                    f"stream {r['stream_s']:.2f} s; "
                    f"{r['slots']} slots, {r['graphs']} graphs "
                    f"set up in {r['graph_setup_s']:.2f} s, setup {r['setup_s']:.2f} s, "
                    f"decode wasted {r['wasted']:.1%}")
        else:
            note = (f"from_pretrained {r['load_s']:.1f} s, generate_batch call "
                    f"{r['call_s']:.2f} s (set-up and warm-up in it), attention {r['attention']}, "
                    f"max_requests_per_batch {r['max_requests_per_batch'] or 'auto'}"
                    + (f", {r['failed_records']} records failed" if r["failed_records"] else ""))
        print(f"| {job} | {way} | {r['process_wall_s']:.2f} | {r['imports_s'] or 0:.2f} | "
              f"{r['generate_s']:.2f} | {r['generate_tokens_per_s']:,.0f} | "
              f"{r['mean_output_tokens']:.1f} | {r['records']} | {note} |")
    for job in jobs:
        ours, theirs = rows.get(f"{job}/graphrun"), rows.get(f"{job}/generate_batch")
        if ours and theirs and ours["status"] == theirs["status"] == "ok":
            print(f"- {job}: generate_batch's whole process / graphrun's: "
                  f"{theirs['process_wall_s'] / ours['process_wall_s']:.2f}x; generate tokens/s "
                  f"graphrun / generate_batch: "
                  f"{ours['generate_tokens_per_s'] / theirs['generate_tokens_per_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
