"""Generation: graphrun's whole process against Hugging Face generate and a hand-written CUDA
graph loop, on one GPU in one run, over the same prompts (issue 33, GENERATION.md).

    python3 benchmarks/bench_generate.py [--models 134M,1.24B] [--batches 1,16,64]
        [--ways eager,static,compile,hand,graphrun] [--prompts 1024] [--new-tokens 128]
        [--max-seconds 30] [--parts job,fixed] [--json FILE] [--smoke]

Models: Llama layouts built from a LlamaConfig with seeded random weights (timing does not
depend on the weights; nothing is downloaded), saved once with save_pretrained into a temporary
folder and loaded back with from_pretrained in bf16 (the setup column), so every way, graphrun's
subprocess included, runs the very same weights:
  134M   12 layers x 768, 12 heads, intermediate 2048, vocab 32000
  1.24B  16 layers x 2048, 32 heads, 8 KV heads, intermediate 8192, vocab 128256, tied embeddings

Prompts: --prompts token-id prompts, lengths 16-512 drawn log-normal (median about 56, long
tail), ids seeded; batches of --batch consecutive prompts in file order, left-padded to the
batch's longest. Every record gets exactly --new-tokens new tokens: the models have no EOS id
(random weights would stop at arbitrary places, and differently per way), so every way does the
same work. The folder's tokenizer is a word-level vocabulary whose word "t<id>" is token <id>,
so the prompts file graphrun reads holds text ("t17 t4005 ...") that tokenizes back to exactly
the ids the other ways are given (checked before the run).

Ways (part `job`, over the prompts):
  eager     model.generate(do_sample=False), the default dynamic cache
  static    generate(cache_implementation="static", disable_compile=True)
  compile   generate(cache_implementation="static"): on CUDA, transformers compiles the decode
            forward itself (CompileConfig: inductor, mode reduce-overhead), as its docs say to
            run it; dynamo is reset before each (model, batch), and inductor's on-disk caches
            are off, so compile and every recompile for a new shape count, as in a fresh process
  hand      prefill eagerly into a transformers StaticCache, one real decode step on a side
            stream, then that step (forward, argmax into the static token buffer, position + 1)
            captured with torch.cuda.graph and replayed; captured anew for every batch (its
            shape, and the cache's length, change)
  hand-process  the same hand-written loop in a fresh process of its own (this script, given
            the folder and the prompts), timed from its start to its exit like graphrun's: in
            the bench's own process the HF ways have already loaded every kernel the hand loop
            needs, which a process of its own (as graphrun's is) pays for; its imports
            (interpreter, torch, transformers) are reported apart, as graphrun's are
  graphrun  `python -m graphrun run SPEC` as a subprocess on a spec written here (model.hf
            over the saved folder, buckets batch [B] and seq [32..512], greedy, stop.eos none,
            jsonl); its whole process is timed and its manifest's generation section read. When
            this graphrun cannot run a generate: spec yet, the row says so in one line.
  graphrun-hf  the same with model.hf.implementation: transformers (transformers' Llama with
            graphrun's KV cache, instead of graphrun's own Llama; its import included)
  graphrun-compile  the graphrun way with model.compile: true (inductor's kernels inside
            graphrun's capture; its compilations included in the whole process)
Columns: tokens/s over the whole job (setup included: the model's from_pretrained for the
in-process ways, graphrun's whole process from interpreter start) and over generation alone;
TTFT and TPOT p50/p99 per record (TTFT: from the batch's start to its first token's logits, one
sync by a logits processor; TPOT: the rest of the batch / (new tokens - 1)); setup seconds;
whole-job wall; and the share of records whose tokens equal HF static-cache greedy (with the
mean common prefix), over the records both ran.

Time box: a way that would run past --max-seconds in one (model, batch) stops after the batch
that crosses it; the table says "k/N prompts" and the whole-job wall is projected (elapsed + the
remaining batches x the median batch so far). HF eager at batch 1 over 1,024 prompts would take
hours. graphrun's subprocess is given the prompts the hand loop's rate fits in --max-seconds
(all N when the hand loop did not run); its projection adds its streaming time (the manifest's
totals.stream_s) again for the prompts left out. Generation tokens/s are measured on what ran.

Part `fixed` (GENERATION.md's table): prompts of 128 tokens, 128 new, one generate call per
way and batch: eager, static, compile (its first call's seconds, then a second call's rate), the
hand loop's replay time per step (replay and the token's copy out, CUDA events), and the
bandwidth bound (weights + the KV cache read per step at the mean context / peak bandwidth).

Output: markdown tables on stdout, everything in --json (default bench_generate.json in $OUT,
the device's folder that comes back, or else here).
--smoke: a 2-layer layout, 24 prompts of 4-40 tokens, 8 new tokens, batches 1 and 4, float32,
on whatever device there is (on a CPU the hand loop runs its step eagerly and compile is
skipped): a check of the plumbing, and of the hand loop's tokens against HF static's.
Budget (the device runs 10 minutes a command at most): one model's `job` part at the default
--max-seconds 30 should take 7-8 minutes on the H200, the `fixed` part of both models about 3.
Run them as separate commands, each with its own --json:
    --models 134M --parts job     --models 1.24B --parts job     --parts fixed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# compile and every recompile count, as in a fresh process (set before torch is imported)
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.hf_folder import PAD, as_text, save_id_tokenizer  # noqa: E402

LAYOUTS = {
    "134M": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12, intermediate_size=2048, vocab_size=32000,
                 tie_word_embeddings=False),
    "1.24B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                  tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                 tie_word_embeddings=False),
}
WAYS = ("eager", "static", "compile", "hand", "hand-process", "graphrun", "graphrun-hf",
        "graphrun-compile")
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s, by GPU name
SEQ_BUCKETS = [32, 64, 128, 256, 512]
PERCENTILES = (50, 99)


# ---- prompts and the model ----------------------------------------------------------------------

def prompt_lengths(n: int, lo: int, hi: int, seed: int) -> np.ndarray:
    """Log-normal lengths clipped to [lo, hi]: most prompts short, a long tail, as real ones."""
    rng = np.random.default_rng(seed)
    median = max(lo, min(hi, 56))
    return np.clip(np.round(rng.lognormal(np.log(median), 0.8, n)), lo, hi).astype(int)


def make_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(1, vocab, int(k)).tolist() for k in prompt_lengths(n, lo, hi, seed)]


def llama_config(layout: str, max_positions: int):
    from transformers import LlamaConfig

    # no EOS: every record generates all its new tokens, the same work for every way
    return LlamaConfig(**LAYOUTS[layout], max_position_embeddings=max_positions,
                       bos_token_id=None, eos_token_id=None, pad_token_id=PAD)


def save_folder(layout: str, folder: Path, device: torch.device, dtype: torch.dtype,
                max_positions: int, seed: int = 0) -> None:
    """Seeded random weights in `dtype`, saved with save_pretrained, plus the tokenizer whose
    word t<id> is token <id> (so text prompts tokenize back to the benchmark's ids)."""
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(layout, max_positions))
    model.to(dtype).save_pretrained(folder)
    GenerationConfig(eos_token_id=None, pad_token_id=PAD, bos_token_id=None).save_pretrained(
        folder)
    save_id_tokenizer(folder, LAYOUTS[layout]["vocab_size"], max_positions)
    del model


def check_round_trip(folder: Path, prompts: list[list[int]]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    for ids in prompts[:8]:
        got = tok(as_text(ids))["input_ids"]
        assert got == ids, f"the id tokenizer does not round-trip: {ids[:8]} -> {got[:8]}"


def load_model(folder: Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    # .to(device), not device_map: that needs accelerate, which the GPU machine may lack
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    sync(device)
    return model, time.perf_counter() - t0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def left_pad(batch: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, mask: [B, longest], padding on the left as generate expects."""
    longest = max(map(len, batch))
    ids = torch.full((len(batch), longest), PAD, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for r, p in enumerate(batch):
        ids[r, longest - len(p):] = torch.tensor(p)
        mask[r, longest - len(p):] = 1
    return ids.to(device), mask.to(device)


# ---- one batch, each way ------------------------------------------------------------------------

@dataclass
class BatchRun:
    tokens: list[list[int]]  # [B][new]
    wall_s: float
    ttft_s: float
    step_us: float | None = None  # hand loop: replay (and token copy) per step


class FirstLogits:
    """A logits processor that syncs once, at the first token's logits: TTFT's clock."""

    def __init__(self, device):
        self.device, self.at = device, None

    def __call__(self, input_ids, scores):
        if self.at is None:
            sync(self.device)
            self.at = time.perf_counter()
        return scores


def hf_batch(model, batch: list[list[int]], new: int, way: str) -> BatchRun:
    from transformers import LogitsProcessorList

    device = model.device
    ids, mask = left_pad(batch, device)
    clock = FirstLogits(device)
    # no EOS id, so every row runs to max_new_tokens (min_new_tokens would only add a processor)
    kwargs = dict(max_new_tokens=new, do_sample=False, pad_token_id=PAD,
                  logits_processor=LogitsProcessorList([clock]))
    if way == "static":
        kwargs.update(cache_implementation="static", disable_compile=True)
    elif way == "compile":
        kwargs.update(cache_implementation="static")
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    sync(device)
    wall = time.perf_counter() - t0
    return BatchRun(out[:, ids.shape[1]:].tolist(), wall, (clock.at or t0 + wall) - t0)


def hand_batch(model, batch: list[list[int]], new: int) -> BatchRun:
    """Prefill eagerly into a StaticCache; one real decode step on a side stream (warm-up);
    capture that step and replay it for the rest. On a CPU the step runs eagerly."""
    from transformers import StaticCache

    device = model.device
    t0 = time.perf_counter()
    ids, mask = left_pad(batch, device)
    rows, length = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=length + new)
    # positions from the mask, as generate makes them (padded slots at 1)
    pos = mask.cumsum(-1) - 1
    pos.masked_fill_(mask == 0, 1)
    out = torch.empty((rows, new), dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                       use_cache=True, logits_to_keep=1).logits
        tok = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]: the static token buffer
        sync(device)
        ttft = time.perf_counter() - t0
        out[:, 0] = tok[:, 0]
        step_pos = pos[:, -1:] + 1  # [B, 1]
        # [B, length + new]: later columns are hidden by the causal mask until written
        full_mask = torch.cat([mask, torch.ones((rows, new), dtype=mask.dtype,
                                                device=device)], 1)

        def step():
            step_logits = model(input_ids=tok, attention_mask=full_mask, position_ids=step_pos,
                                cache=cache, use_cache=True).logits
            tok.copy_(step_logits[:, -1].argmax(-1, keepdim=True))
            step_pos.add_(1)

        step_us = None
        if new > 1:
            if device.type == "cuda":
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    step()  # a real step: warms up kernels and cuBLAS before capture
                torch.cuda.current_stream(device).wait_stream(side)
            else:
                step()
            out[:, 1] = tok[:, 0]
        if new > 2 and device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()  # recorded, not run
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for i in range(2, new):
                graph.replay()
                out[:, i].copy_(tok[:, 0])
            end.record()
            end.synchronize()
            step_us = start.elapsed_time(end) * 1e3 / (new - 2)
            del graph
        else:
            for i in range(2, new):
                step()
                out[:, i] = tok[:, 0]
    tokens = out.tolist()  # syncs
    return BatchRun(tokens, time.perf_counter() - t0, ttft, step_us)


# ---- a job: every batch of the prompts, time-boxed ----------------------------------------------

@dataclass
class Row:
    model: str
    batch: int
    way: str
    status: str = "ok"  # ok | skipped | failed
    note: str = ""
    prompts_run: int = 0
    prompts_total: int = 0
    output_tokens: int = 0
    setup_s: float = 0.0
    generate_s: float = 0.0  # the batches' time (graphrun: its prefill + decode)
    job_wall_s: float = 0.0  # setup + batches; projected when prompts_run < prompts_total
    projected: bool = False
    tokens_per_s_job: float = 0.0  # prompts_total x new / job_wall_s
    # graphrun's process pays the interpreter and its imports, which the in-process ways paid
    # before their timers started: the job less them is the like-for-like comparison
    imports_s: float = 0.0
    tokens_per_s_job_less_imports: float = 0.0
    tokens_per_s_generate: float = 0.0
    ttft_ms: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)
    equal_to_static: float | None = None
    mean_common_prefix: float | None = None
    graphrun: dict = field(default_factory=dict)  # its manifest's generation and totals

    def to_json(self) -> dict:
        return asdict(self)


def pct(values: list[float], scale: float = 1e3) -> dict:
    if not values:
        return {}
    return {f"p{p}": float(np.percentile(values, p)) * scale for p in PERCENTILES}


def run_job(way: str, model, setup_s: float, prompts: list[list[int]], batch: int, new: int,
            max_seconds: float, name: str) -> tuple[Row, dict[int, list[int]]]:
    """The prompts in batches of `batch`, file order, until done or past max_seconds."""
    row = Row(name, batch, way, prompts_total=len(prompts), setup_s=setup_s)
    if way == "compile":
        torch._dynamo.reset()
        if hasattr(model, "_compiled_call"):
            del model._compiled_call
    tokens, walls, ttft, tpot = {}, [], [], []
    starts = list(range(0, len(prompts), batch))
    for start in starts:
        part = prompts[start:start + batch]
        done = hand_batch(model, part, new) if way == "hand" else hf_batch(model, part, new, way)
        walls.append(done.wall_s)
        for r, toks in enumerate(done.tokens):
            tokens[start + r] = toks
            ttft.append(done.ttft_s)
            tpot.append((done.wall_s - done.ttft_s) / max(1, new - 1))
        if sum(walls) > max_seconds and start != starts[-1]:
            break
    row.prompts_run = len(tokens)
    row.output_tokens = len(tokens) * new
    row.generate_s = sum(walls)
    rest = len(starts) - len(walls)
    row.projected = rest > 0
    row.job_wall_s = setup_s + row.generate_s + rest * statistics.median(walls)
    row.tokens_per_s_job = row.tokens_per_s_job_less_imports = len(prompts) * new / row.job_wall_s
    row.tokens_per_s_generate = row.output_tokens / row.generate_s
    row.ttft_ms, row.tpot_ms = pct(ttft), pct(tpot)
    if row.projected:
        row.note = (f"{row.prompts_run}/{len(prompts)} prompts in the {max_seconds:g} s box; "
                    "whole job projected")
    return row, tokens


def child_env() -> dict:
    """This environment with the project first on PYTHONPATH, the rest kept (the GPU machine
    finds the wheels it lacks there)."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + rest)}


def run_hand_process(folder: Path, prompts: list[list[int]], batch: int, new: int,
                     max_seconds: float, dtype: str, work: Path, name: str,
                     timeout: float) -> tuple[Row, dict[int, list[int]]]:
    """The hand loop in a process of its own: wall from before its start to its exit, its
    imports (interpreter start to transformers imported) as the child measured them."""
    work.mkdir(parents=True, exist_ok=True)
    job = work / "hand-job.json"
    job.write_text(json.dumps({"folder": str(folder), "prompts": prompts, "batch": batch,
                               "new": new, "max_seconds": max_seconds, "name": name,
                               "dtype": dtype}))
    result = work / "hand-result.json"
    env = child_env()
    t0, started = time.perf_counter(), time.time()
    try:
        proc = subprocess.run([sys.executable, __file__, "--child-hand", str(job), str(result)],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Row(name, batch, "hand-process", "failed", f"ran past {timeout:g} s",
                   prompts_total=len(prompts)), {}
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return Row(name, batch, "hand-process", "failed", f"exit {proc.returncode}: {tail[0]}",
                   prompts_total=len(prompts)), {}
    got = json.loads(result.read_text())
    row = Row(**{**got["row"], "way": "hand-process"})
    # the child's timers: its setup and batches; the process adds its start, imports, exit
    rest = row.job_wall_s - row.setup_s - row.generate_s  # the projected batches, if any
    row.job_wall_s = wall + rest
    row.imports_s = got["imports_done"] - started
    row.tokens_per_s_job = len(prompts) * new / row.job_wall_s
    row.tokens_per_s_job_less_imports = len(prompts) * new / (row.job_wall_s - row.imports_s)
    return row, {int(k): v for k, v in got["tokens"].items()}


def child_hand(job_path: str, result_path: str) -> int:
    """--child-hand: one hand-loop job in this fresh process (run_hand_process's child)."""
    import transformers  # noqa: F401 - counted as the process's imports, as graphrun's are

    imports_done = time.time()
    job = json.loads(Path(job_path).read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, job["dtype"])
    model, setup_s = load_model(Path(job["folder"]), device, dtype)
    row, tokens = run_job("hand", model, setup_s, job["prompts"], job["batch"], job["new"],
                          job["max_seconds"], job["name"])
    Path(result_path).write_text(json.dumps({"row": row.to_json(), "tokens": tokens,
                                             "imports_done": imports_done}))
    return 0


GRAPHRUN_SPEC = """\
version: 1
name: bench-generate
device: {device}
model:
  hf: {{path: {folder}, class: AutoModelForCausalLM, implementation: {implementation}}}
  dtype: {dtype}
  compile: {compile}
data:
  path: prompts.jsonl
  id_field: id
  text: {{field: prompt, truncate: false}}
  batch_size: {batch}
generate:
  max_new_tokens: {new}
  sampling: {{method: greedy}}
  stop: {{eos: none}}
buckets:
  batch: [{batch}]
  seq: {seq}
output: {{dir: out, format: jsonl}}
"""


def run_graphrun(folder: Path, prompts: list[list[int]], count: int, batch: int, new: int,
                 device: torch.device, dtype: str, work: Path, name: str,
                 timeout: float, way: str = "graphrun") -> tuple[Row, dict[int, list[int]]]:
    """`python -m graphrun run` on the first `count` prompts as text; its whole process timed.
    way graphrun-hf: on transformers' model code; graphrun-compile: with model.compile."""
    row = Row(name, batch, way, prompts_total=len(prompts))
    work.mkdir(parents=True, exist_ok=True)
    with (work / "prompts.jsonl").open("w") as f:
        for i, ids in enumerate(prompts[:count]):
            f.write(json.dumps({"id": i, "prompt": as_text(ids)}) + "\n")
    longest = max(map(len, prompts[:count]))
    seq = [s for s in SEQ_BUCKETS if s < longest] + [next(s for s in SEQ_BUCKETS + [longest]
                                                          if s >= longest)]
    spec = work / "gen.yaml"
    spec.write_text(GRAPHRUN_SPEC.format(device=device.type, folder=json.dumps(str(folder)),
                                         dtype=dtype, batch=batch, new=new, seq=seq,
                                         implementation=("transformers" if way == "graphrun-hf"
                                                         else "auto"),
                                         compile=str(way == "graphrun-compile").lower()))
    env = child_env()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "graphrun", "run", str(spec)], cwd=work,
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        row.status, row.note = "failed", f"ran past {timeout:g} s; stopped"
        return row, {}
    wall = time.perf_counter() - t0
    manifest_path = work / "out" / "manifest.json"
    if proc.returncode != 0 or not manifest_path.is_file():
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        said = next((ln for ln in lines if ln.startswith("error:")), lines[-1] if lines else
                    "no output")  # the CLI's one message, not its remedies or a traceback's end
        row.status = "failed"
        row.note = f"graphrun could not run this generate: spec (exit {proc.returncode}): {said}"
        return row, {}
    manifest = json.loads(manifest_path.read_text())
    gen = manifest.get("generation")
    if not gen:
        row.status = "failed"
        row.note = "graphrun ran but its manifest has no generation section (not wired yet)"
        return row, {}
    tokens = {}
    for shard in sorted((work / "out").glob("*.jsonl")):
        if shard.name in ("rejects.jsonl", "latencies.jsonl"):
            continue
        for line in shard.read_text().splitlines():
            rec = json.loads(line)
            if "token_ids" in rec:
                tokens[int(rec["id"])] = rec["token_ids"]
    totals = manifest.get("totals", {})
    row.prompts_run = count
    row.output_tokens = int(gen.get("output_tokens", sum(map(len, tokens.values()))))
    row.setup_s = float(totals.get("setup_s", 0.0))
    row.generate_s = float(gen.get("prefill_s", 0.0)) + float(gen.get("decode_s", 0.0))
    row.projected = count < len(prompts)
    # projected: the process as it ran, plus its streaming time again for the prompts left out,
    # less the graphs set up on first use inside the stream (set up once, not per prompt)
    stream_s = float(totals.get("stream_s") or row.generate_s)
    first_use_s = sum(g.get("set_up_s") or 0.0 for g in gen.get("graphs", [])
                      if g.get("set_up", "first_use") == "first_use")
    row.job_wall_s = wall + max(0.0, stream_s - first_use_s) * (len(prompts) / count - 1)
    row.tokens_per_s_job = len(prompts) * new / row.job_wall_s
    row.tokens_per_s_generate = float(gen.get("output_tokens_per_s", 0.0))
    row.ttft_ms = {k: v for k, v in gen.get("ttft_ms", {}).items() if k in ("p50", "p99")}
    row.tpot_ms = {k: v for k, v in gen.get("tpot_ms", {}).items() if k in ("p50", "p99")}
    phases = {p["name"]: p["s"] for p in manifest.get("phases", {}).get("top", [])}
    row.imports_s = sum(s for n, s in phases.items() if n.startswith(("interpreter", "imports")))
    row.tokens_per_s_job_less_imports = len(prompts) * new / (row.job_wall_s - row.imports_s)
    row.graphrun = {"generation": gen, "process_wall_s": wall, "phases_s": phases,
                    "manifest_setup_s": row.setup_s, "stream_s": stream_s,
                    "graphs_set_up_s": first_use_s}
    if row.projected:
        row.note = (f"{count}/{len(prompts)} prompts (what the hand loop's rate fits in the "
                    "box); whole job projected")
    return row, tokens


def compare(tokens: dict[int, list[int]], reference: dict[int, list[int]]) -> tuple:
    both = [i for i in tokens if i in reference]
    if not both:
        return None, None
    equal = sum(tokens[i] == reference[i] for i in both) / len(both)
    prefix = []
    for i in both:
        a, b = tokens[i], reference[i]
        n = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        prefix.append(n)
    return equal, float(np.mean(prefix))


# ---- the fixed-shape rows -----------------------------------------------------------------------

def fixed_rows(model, name: str, batches: list[int], ways: list[str], prompt: int, new: int,
               peak: float | None) -> list[dict]:
    from graphrun.generate.mbu import weight_bytes_per_step

    device, out = model.device, []
    vocab = model.config.vocab_size
    bound_bytes = weight_bytes_per_step(model)
    for b in batches:
        prompts = make_prompts(b, vocab, prompt, prompt, seed=7)
        row = {"model": name, "batch": b, "prompt": prompt, "new": new}
        for way in ways:
            if way in ("graphrun", "graphrun-hf", "graphrun-compile", "hand-process"):
                continue
            if way == "compile" and device.type != "cuda":
                row["compile"] = "skipped: transformers compiles only on an accelerator"
                continue
            if way == "hand":
                done = hand_batch(model, prompts, new)
                row["hand_step_us"] = done.step_us
                row["hand_tokens_per_s"] = b * 1e6 / done.step_us if done.step_us else None
                continue
            if way == "compile":
                torch._dynamo.reset()
                if hasattr(model, "_compiled_call"):
                    del model._compiled_call
                first = hf_batch(model, prompts, new, way)
                row["compile_first_call_s"] = first.wall_s
            else:
                hf_batch(model, prompts, 2, way)  # warm-up, untimed
            done = hf_batch(model, prompts, new, way)
            row[f"{way}_tokens_per_s"] = b * new / done.wall_s
        if peak:
            kv = kv_bytes_per_step(model.config, b, prompt + new // 2)
            row["bound_tokens_per_s"] = b * peak / (bound_bytes + kv)
        out.append(row)
    return out


def kv_bytes_per_step(config, rows: int, context: int) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * rows * config.num_hidden_layers * config.num_key_value_heads * head_dim * \
        context * 2  # keys and values, bf16


# ---- the run ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child-hand"]:
        return child_hand(*argv[1:3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="134M,1.24B")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--parts", default="job,fixed")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--fixed-prompt", type=int, default=128)
    ap.add_argument("--max-seconds", type=float, default=30.0, help="time box per way and "
                    "(model, batch)")
    ap.add_argument("--peak-bandwidth", type=float, default=None, help="bytes/s (default: by "
                    "GPU name)")
    ap.add_argument("--json", default=str(Path(os.environ.get("OUT", ".")) /
                                          "bench_generate.json"), help="default: $OUT/ or ./")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.prompts, args.min_len, args.max_len = "tiny", 24, 4, 40
        args.new_tokens, args.fixed_prompt = 8, 16
        if args.batches == "1,16,64":
            args.batches = "1,4"
        args.max_seconds = min(args.max_seconds, 20.0)
    ways = [w for w in args.ways.split(",") if w]
    unknown = [w for w in ways if w not in WAYS] + [m for m in args.models.split(",")
                                                   if m not in LAYOUTS]
    if unknown:
        ap.error(f"unknown: {', '.join(unknown)} (ways: {', '.join(WAYS)}; models: "
                 f"{', '.join(LAYOUTS)})")
    batches = [int(b) for b in args.batches.split(",")]
    parts = args.parts.split(",")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and not args.smoke else torch.float32
    dtype_name = str(dtype).replace("torch.", "")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = args.peak_bandwidth or next((v for k, v in PEAK_BANDWIDTH.items()
                                        if gpu and k in gpu), None)
    # graphrun's last prompt bucket rounds the longest prompt up to a bucket value
    widest = next(s for s in SEQ_BUCKETS + [args.max_len] if s >= args.max_len)
    max_positions = widest + max(args.new_tokens, args.fixed_prompt + args.new_tokens)
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": gpu, "device": str(device),
           "torch": torch.__version__, "dtype": dtype_name, "cuda": torch.version.cuda,
           "transformers": __import__("transformers").__version__, "commit": _commit(),
           "args": vars(args)}
    print(f"# bench_generate: {gpu or device}, torch {torch.__version__}, "
          f"transformers {env['transformers']}, {dtype_name}, commit {env['commit']}")
    rows, fixed = [], []
    tmp = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    for name in args.models.split(","):
        folder = tmp / name
        save_folder(name, folder, device, dtype, max_positions)
        model, setup_s = load_model(folder, device, dtype)
        print(f"\n## {name}: {sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M "
              f"parameters; from_pretrained {setup_s:.2f} s", flush=True)
        prompts = make_prompts(args.prompts, model.config.vocab_size, args.min_len,
                               args.max_len)
        lengths = np.array([len(p) for p in prompts])
        print(f"{len(prompts)} prompts of {lengths.min()}-{lengths.max()} tokens (median "
              f"{int(np.median(lengths))}), {args.new_tokens} new tokens each", flush=True)
        hf_batch(model, prompts[:2], 2, "eager")  # CUDA context, cuBLAS: not any way's cost
        if "job" in parts:
            check_round_trip(folder, prompts)
            for b in batches:
                rows += job_rows(ways, model, setup_s, prompts, b, args, folder, device,
                                 dtype_name, tmp / f"{name}-b{b}", name)
        if "fixed" in parts:
            fixed += fixed_rows(model, name, batches, ways, args.fixed_prompt, args.new_tokens,
                                peak)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_tables(rows, fixed, args)
    Path(args.json).write_text(json.dumps({"environment": env, "job": [r.to_json() for r in rows],
                                           "fixed": fixed}, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


def job_rows(ways, model, setup_s, prompts, b, args, folder, device, dtype_name, work,
             name) -> list[Row]:
    out, reference, hand_rate = [], None, None
    order = sorted(ways, key=lambda w: w != "static")  # static first: the reference tokens
    for way in order:
        print(f"  {name} batch {b}: {way} ...", end="", flush=True)
        if way == "compile" and device.type != "cuda":
            row = Row(name, b, way, "skipped", "transformers compiles only on an accelerator",
                      prompts_total=len(prompts))
            tokens = {}
        elif way == "hand-process":
            row, tokens = run_hand_process(folder, prompts, b, args.new_tokens,
                                           args.max_seconds, dtype_name, work, name,
                                           timeout=max(180.0, 4 * args.max_seconds))
        elif way in ("graphrun", "graphrun-hf", "graphrun-compile"):
            count = len(prompts)
            if hand_rate:  # prompts per second of the hand loop: what fits in the box
                count = min(count, max(b, int(hand_rate * args.max_seconds) // b * b))
            row, tokens = run_graphrun(folder, prompts, count, b, args.new_tokens, device,
                                       dtype_name, work / way, name,
                                       timeout=max(180.0, 4 * args.max_seconds), way=way)
        else:
            try:
                row, tokens = run_job(way, model, setup_s, prompts, b, args.new_tokens,
                                      args.max_seconds, name)
            except Exception as e:  # noqa: BLE001 - one way failing leaves the others' rows
                row = Row(name, b, way, "failed", f"{type(e).__name__}: {e}".splitlines()[0],
                          prompts_total=len(prompts))
                tokens = {}
        release(device)  # the compile way's graphs and pools, before the next way or process
        if way == "static":
            reference = tokens
        if way == "hand" and row.status == "ok":
            hand_rate = row.prompts_run / row.generate_s
        if reference and tokens:
            row.equal_to_static, row.mean_common_prefix = compare(tokens, reference)
        print(f" {row.status} {row.note}".rstrip(), flush=True)
        out.append(row)
    return sorted(out, key=lambda r: WAYS.index(r.way))


def release(device: torch.device) -> None:
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_tables(rows: list[Row], fixed: list[dict], args) -> None:
    if rows:
        print(f"\n### The job: {args.prompts} prompts of {args.min_len}-{args.max_len} tokens, "
              f"{args.new_tokens} new tokens, batches in file order\n")
        print("| model | batch | way | tokens/s (job) | tokens/s (job less imports) | "
              "tokens/s (generate) | TTFT p50 / p99 ms | TPOT p50 / p99 ms | setup s | "
              "imports s | whole job s | = HF static | note |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in rows:
            if r.status != "ok":
                print(f"| {r.model} | {r.batch} | {r.way} | | | | | | | | | | {r.status}: "
                      f"{r.note} |")
                continue
            eq = ("" if r.equal_to_static is None else
                  f"{r.equal_to_static:.0%} (prefix {r.mean_common_prefix:.0f})")
            wall = f"{'~' if r.projected else ''}{r.job_wall_s:,.1f}"
            print(f"| {r.model} | {r.batch} | {r.way} | {r.tokens_per_s_job:,.0f} | "
                  f"{r.tokens_per_s_job_less_imports:,.0f} | "
                  f"{r.tokens_per_s_generate:,.0f} | {_pp(r.ttft_ms)} | {_pp(r.tpot_ms)} | "
                  f"{r.setup_s:.2f} | {r.imports_s:.2f} | {wall} | {eq} | {r.note} |")
    ours = [r for r in rows if r.status == "ok" and r.graphrun]
    if ours:
        print("\n### graphrun's graphs: MBU (generation.mbu), graphs captured / compiled, "
              "set-up seconds on first use (compilation included)\n")
        print("| model | batch | way | MBU | graphs | captured | compiled | first-use set-up s |")
        print("|---|---:|---|---:|---:|---:|---:|---:|")
        for r in ours:
            gen = r.graphrun["generation"]
            graphs = gen.get("graphs", [])
            mbu = gen.get("mbu")
            print(f"| {r.model} | {r.batch} | {r.way} | "
                  f"{'' if mbu is None else f'{mbu:.1%}'} | {len(graphs)} | "
                  f"{sum(g.get('status') == 'captured' for g in graphs)} | "
                  f"{sum(g.get('compiled') is True for g in graphs)} | "
                  f"{r.graphrun['graphs_set_up_s']:.2f} |")
        reasons = {g["reason"] for r in ours for g in r.graphrun["generation"].get("graphs", [])
                   if g.get("reason")}
        for reason in sorted(reasons):
            print(f"- reason: {reason}")
    if fixed:
        print(f"\n### Fixed shape: prompt {args.fixed_prompt} tokens, {args.new_tokens} new, one "
              "generate call (tokens/s)\n")
        print("| model | batch | HF eager | HF static | HF static + compile (first call) | "
              "hand loop: replay per step | bandwidth bound |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for f in fixed:
            comp = f.get("compile")
            if "compile_tokens_per_s" in f:
                comp = f"{f['compile_tokens_per_s']:,.0f} ({f['compile_first_call_s']:.1f} s)"
            hand = (f"{f['hand_step_us']:,.0f} us ({f['hand_tokens_per_s']:,.0f})"
                    if f.get("hand_step_us") else "")
            print(f"| {f['model']} | {f['batch']} | {_n(f.get('eager_tokens_per_s'))} | "
                  f"{_n(f.get('static_tokens_per_s'))} | {comp or ''} | {hand} | "
                  f"{_n(f.get('bound_tokens_per_s'))} |")


def _pp(d: dict) -> str:
    return f"{d['p50']:,.1f} / {d['p99']:,.1f}" if d.get("p50") is not None else ""


def _n(v) -> str:
    return "" if v is None else f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
