"""Make the small input files the shipped pipelines read (committed; rerun to regenerate).

    python examples/make_data.py [--records N] [--out examples/data]

scores.npy:   MLP scorer inputs, [N, 64] float32.
decode.jsonl: one decode step per line: {"id": "req-000001", "tokens": [t], "positions": p};
              one in 500 is bad (a token or position out of range, a field missing, a
              wrong shape), for data.on_bad_record: skip to reject.
texts.jsonl:  variable-length token records for the encoder: {"id", "tokens": [...],
              "mask": [1, ...]} with lengths 3..64.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def make_scores(path: Path, n: int, rng: np.random.Generator) -> None:
    np.save(path, rng.standard_normal((n, 64), dtype=np.float32))


# Every BAD_EVERY-th record (from BAD_FIRST) is broken in one of these ways, so that the
# decoder-step pipeline (data.on_bad_record: skip) shows rejects.jsonl with its reasons.
BAD_FIRST, BAD_EVERY = 350, 500
BAD_KINDS = (
    lambda rec, vocab, max_len: {**rec, "tokens": [vocab + 7]},  # token id out of range
    lambda rec, vocab, max_len: {**rec, "positions": max_len},  # position past the cache
    lambda rec, vocab, max_len: {k: v for k, v in rec.items() if k != "positions"},  # missing
    lambda rec, vocab, max_len: {**rec, "tokens": [1, 2]},  # two tokens for a [1] input
)


def make_decode(path: Path, n: int, rng: np.random.Generator, vocab: int = 1000,
                max_len: int = 128) -> None:
    with open(path, "w") as f:
        for i in range(n):
            rec = {"id": f"req-{i:06d}", "tokens": [int(rng.integers(vocab))],
                   "positions": int(rng.integers(max_len))}
            if i >= BAD_FIRST and (i - BAD_FIRST) % BAD_EVERY == 0:
                kind = BAD_KINDS[(i - BAD_FIRST) // BAD_EVERY % len(BAD_KINDS)]
                rec = kind(rec, vocab, max_len)
            f.write(json.dumps(rec) + "\n")


def make_texts(path: Path, n: int, rng: np.random.Generator, vocab: int = 1000,
               max_len: int = 64) -> None:
    with open(path, "w") as f:
        for i in range(n):
            length = int(rng.integers(3, max_len + 1))
            rec = {"id": i, "tokens": rng.integers(vocab, size=length).tolist(),
                   "mask": [1] * length}
            f.write(json.dumps(rec) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    make_scores(args.out / "scores.npy", args.records, rng)
    make_decode(args.out / "decode.jsonl", args.records, rng)
    make_texts(args.out / "texts.jsonl", args.records // 4, rng)


if __name__ == "__main__":
    main()
