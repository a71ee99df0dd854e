"""Where a large model's weights hold up a fresh `graphrun run` (issue 49: "the input hash
waits on the weights"): a Llama folder of --layout (default 8B: 16 GB of bf16 weights) and a
small prompts file, one generation spec written by `graphrun init --task generate`, and that
spec run --runs times as whole processes (the first with an empty digest cache, the later ones
where GRAPHRUN_HASH_CACHE kept the digests of the first).

    python3 benchmarks/bench_hash_wait.py [--layout 8B] [--prompts 256] [--new-tokens 32]
        [--runs 2] [--cold] [--json FILE] [--smoke]

The folder: graphrun's builtin Llama of the layout (bench_decode_step.py's table), seeded on
the device and saved as safetensors shards of at most 5 GB with their index
(benchmarks/hf_folder.py; the weights are the builtin's seeded values, not zeros). Its files
are in the page cache after writing, as after a download; --cold drops them from it (fsync,
then posix_fadvise DONTNEED) before every run, as on a machine that has not read them.
Printed per run, from its manifest: the phases of the process (the "input hash wait" among
them, and any other phase of at least 0.05 s), graphrun's setup, the phases before the stream
(the wait before the first batch), time to first output, the process's wall from outside,
and the digests section (read: hashed this run; cache: kept from an earlier run by path,
size, mtime and inode).
--smoke: the tiny layout on the CPU (its weights are below the digest cache's 64 MiB, so every
run reads them; `--smoke --layout 134M` shows the cache on the CPU, in a minute).
H200 budget, 8B: the folder about 1 min (built on the GPU, 16 GB written), each run about
1 min (16 GB of weights loaded, graphs set up for 32 slots): under 4 min in all.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_continuous import prompts_of  # noqa: E402
from benchmarks.bench_decode_step import LAYOUTS  # noqa: E402
from benchmarks.hf_folder import write_folder, write_prompts  # noqa: E402

SHOWN_S = 0.05  # phases shorter than this are left out of the table


def evict(folder: Path) -> None:
    """The folder's files out of the page cache (clean pages only: fsync first)."""
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def graphrun(argv: list[str], cwd: Path, env: dict, timeout: float) -> float:
    """Wall seconds of `python -m graphrun ARGV` from before its start to its exit."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "graphrun", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-5:])
        sys.exit(f"graphrun {argv[0]} failed (exit {proc.returncode}):\n{tail}")
    return time.perf_counter() - t0


def summary(m: dict, wall: float) -> dict:
    totals, digests = m["totals"], m.get("digests") or {}
    model = digests.get("model") or {}
    how = {}
    for source in model.values():
        how[source] = how.get(source, 0) + 1
    phases = [(p["name"], p["s"]) for p in m["phases"]["top"]]
    names = [n for n, _ in phases]
    before = sum(s for n, s in phases[:names.index("stream")]) if "stream" in names else None
    return {"process_wall_s": wall, "manifest_process_wall_s": totals.get("process_wall_s"),
            "before_stream_s": before,
            "setup_s": totals.get("setup_s"), "input_hash_s": totals.get("input_hash_s"),
            "time_to_first_output_s": totals.get("time_to_first_output_s"),
            "phases_s": {p["name"]: p["s"] for p in m["phases"]["top"]},
            "digest_input": digests.get("input"), "digest_model": how,
            "digest_model_files": model, "status": m["status"]}


def print_table(runs: list[dict]) -> None:
    shown = {n for r in runs for n, s in r["phases_s"].items()
             if s >= SHOWN_S or n == "input hash wait"}
    names = [n for n in dict.fromkeys(n for r in runs for n in r["phases_s"]) if n in shown]
    heads = " | ".join(f"run {i + 1}" for i in range(len(runs)))
    print(f"\n| seconds | {heads} |")
    print("|---|" + "---:|" * len(runs))
    for n in names:
        print(f"| phase: {n} | " + " | ".join(f"{r['phases_s'].get(n, 0.0):.2f}" for r in runs)
              + " |")
    for key, label in (("input_hash_s", "input hash waited (totals.input_hash_s)"),
                       ("setup_s", "graphrun setup (totals.setup_s)"),
                       ("before_stream_s", "before the first batch (the phases before stream)"),
                       ("time_to_first_output_s", "time to first output"),
                       ("manifest_process_wall_s", "process wall (manifest)"),
                       ("process_wall_s", "process wall (from outside)")):
        print(f"| {label} | " + " | ".join(f"{r[key] or 0:.2f}" for r in runs) + " |")
    print("| digests: input | " + " | ".join(str(r["digest_input"]) for r in runs) + " |")
    print("| digests: model files | " + " | ".join(
        ", ".join(f"{k} {v}" for k, v in r["digest_model"].items()) for r in runs) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default=None, choices=sorted(LAYOUTS),
                    help="default 8B (--smoke: tiny)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the folder from the page cache "
                    "before every run")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    ap.add_argument("--json", default=str(Path(os.environ.get("OUT", ".")) /
                                          "bench_hash_wait.json"))
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.layout, a.prompts, a.new_tokens = a.layout or "tiny", 8, 4
    a.layout = a.layout or "8B"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype_name = str(dtype).removeprefix("torch.")
    work = Path(os.environ.get("BENCH_WORK") or "/tmp") / f"bench_hash_wait-{os.getpid()}"
    work.mkdir(parents=True)
    try:
        wrote = write_folder(a.layout, work / "model", device=device, dtype=dtype,
                             max_positions=512 + a.new_tokens)
        gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        print(f"# bench_hash_wait: {a.layout} on {gpu}, torch {torch.__version__}, "
              f"{dtype_name}: {wrote['weight_bytes'] / 1e9:.2f} GB of weights in "
              f"{wrote['shards']} shard(s), built in {wrote['build_s']:.1f} s, written in "
              f"{wrote['write_s']:.1f} s", flush=True)
        write_prompts(work / "prompts.jsonl", prompts_of(a.prompts, LAYOUTS[a.layout]["vocab"]))
        rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + rest),
               "GRAPHRUN_HASH_CACHE": str(work / "hash-cache")}  # empty before the first run
        init_s = graphrun(["init", "--hf", str(work / "model"), "--data",
                           str(work / "prompts.jsonl"), "--task", "generate",
                           "--max-new-tokens", str(a.new_tokens), "--dtype", dtype_name,
                           "-o", str(work / "spec.yaml"), "--out-dir", str(work / "out")],
                          work, env, a.timeout)
        print(f"graphrun init: {init_s:.1f} s", flush=True)
        runs = []
        for i in range(a.runs):
            if a.cold:
                evict(work / "model")
            wall = graphrun(["run", str(work / "spec.yaml"), "-q", "--overwrite"], work, env,
                            a.timeout)
            m = json.loads((work / "out" / "manifest.json").read_text())
            runs.append(summary(m, wall))
            print(f"run {i + 1}: {wall:.1f} s, input hash wait "
                  f"{runs[-1]['phases_s'].get('input hash wait', 0.0):.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(runs)
    out = {"environment": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": gpu,
                           "torch": torch.__version__, "dtype": dtype_name, "args": vars(a),
                           "folder": wrote, "init_s": init_s},
           "runs": runs}
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
