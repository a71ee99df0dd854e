"""Run the shipped pipelines on the CPU and print the sha256 of every output they write.

    PYTHONPATH=$PWD python3 scripts/check_outputs.py [--root DIR] [--keep DIR]

Each pipeline in pipelines/ runs through `python3 -m graphrun run SPEC --out TMP/<name>` (with
--root, the graphrun tree under DIR runs, pipelines and data from DIR too), then every output
shard and rejects.jsonl is hashed: .npy files by their array (dtype, shape and bytes, so the
.npy header's layout cannot differ a hash), other files by their bytes. The manifest,
latencies, journal and run.json are left out: they carry times, paths and dates. Two trees give
bit-identical outputs when their printed lines are equal (`diff` them).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SKIP = {"manifest.json", "latencies.jsonl", "journal.jsonl", "run.json"}


def digest(path: Path) -> str:
    if path.suffix == ".npy":
        a = np.load(path, allow_pickle=False)
        h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_pipeline(root: Path, spec: Path, out: Path) -> None:
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "graphrun", "run", str(spec), "--out", str(out),
                           "-q"], cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{spec.name} failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                    help="the graphrun tree to run (default: this one)")
    ap.add_argument("--keep", type=Path, default=None, help="write the outputs here")
    args = ap.parse_args()
    root = args.root.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        base = args.keep.resolve() if args.keep else Path(tmp)
        for spec in sorted((root / "pipelines").glob("*.yaml")):
            out = base / spec.stem
            run_pipeline(root, spec, out)
            for f in sorted(out.iterdir()):
                if f.is_file() and f.name not in SKIP:
                    print(f"{spec.stem}/{f.name} {digest(f)}")


if __name__ == "__main__":
    main()
