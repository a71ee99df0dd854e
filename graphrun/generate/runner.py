"""GenerationRunner: a generation spec's engine, as the feed drives every engine (feed/protocols.py
Engine): staged parts of record batches in, one completion per record out, in order.

The feed's three steps keep their threads: the stager hands each part's prompts (token ids from
data.text, read and tokenized by read/) to a host slot; the launcher runs the part's whole
generation (prefill, then decode steps replayed until every row stops, Generator.generate), so
the device never waits on Python between tokens; the completer decodes the new tokens to text
(off the launching thread) and writes the records. The manifest's buckets are the prefill
buckets (batch rows x prompt length) the parts ran on; every graph, prefill and decode, is in
its generation section.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from graphrun.base.dtypes import torch_dtype
from graphrun.base.phases import phase
from graphrun.engine.buckets import Bucket
from graphrun.engine.device import resolve_backend, resolve_device
from graphrun.engine.launch import concat_rows
from graphrun.generate.llama import (Checkpoint, OwnLM, build_llama, find_checkpoint,
                                     load_checkpoint)
from graphrun.generate.config import BatchResult, GenerateConfig, Sampling
from graphrun.generate.decode_attention import runs_on
from graphrun.generate.generator import Generator
from graphrun.generate.hf_attention import eos_ids_of
from graphrun.generate.mbu import kv_bytes_per_token, mbu, peak_bandwidth, weight_bytes_per_step
from graphrun.manifest.keys import BucketReport
from graphrun.manifest.sections import Generation, GraphSetup, generation_summary
from graphrun.spec.generate import PROMPT_AXIS
from graphrun.spec.keys import BATCH, PipelineSpec

# the builtin causal LMs a generation spec may name (model.builtin)
GENERATE_BUILDERS = {"llama": build_llama}


@dataclass
class PrefillBucket:
    """What ran on one prefill bucket: the manifest's bucket row."""

    batches: int = 0
    records: int = 0
    padded_rows: int = 0
    padded_positions: int = 0


@dataclass
class Generated:
    """A launched part: its completions, ready; result() decodes their text (the completer's
    thread) and hands back the rows to write."""

    result_: BatchResult
    decode_text: object  # token ids -> text
    times: dict[str, float] = field(default_factory=dict)

    def wait(self) -> dict[str, float]:
        return self.times

    def result(self) -> tuple[dict, dict[str, float]]:
        done = self.result_.completions
        texts = [self.decode_text(c.token_ids) for c in done]
        outs = {"token_ids": [np.asarray(c.token_ids, dtype=np.int64) for c in done],
                "text": np.array(texts, dtype=str),
                "finish_reason": np.array([c.finish_reason for c in done], dtype=str),
                "prompt_tokens": np.array([c.prompt_tokens for c in done], dtype=np.int64),
                "output_tokens": np.array([c.output_tokens for c in done], dtype=np.int64)}
        return outs, self.times


class GenerationRunner:
    """The model on its device, graphrun's KV cache, and a Generator over the spec's buckets."""

    def __init__(self, spec: PipelineSpec, *, log=None, needs=None, started=None):
        self.spec, self.log = spec, log or (lambda msg: None)
        t0 = time.perf_counter()
        with phase("cuda context") if started else nullcontext():
            self.device = started.wait() if started else resolve_device(spec.device)
        self.backend = resolve_backend(spec.capture.backend, self.device)
        self.cuda = self.device.type == "cuda"
        self.batch_buckets = sorted(spec.buckets[BATCH])
        self.prompt_buckets = sorted(spec.buckets[PROMPT_AXIS])
        self.max_batch = self.batch_buckets[-1]
        self.slot_bytes = self.max_batch * self.prompt_buckets[-1] * 8
        self.first_use_s = 0.0
        with phase("model build"):
            model, self.model_code = self._model()
        # the weights a decode step reads (generation.mbu)
        self.param_bytes = weight_bytes_per_step(model)
        self.config = generate_config(spec, model)
        from graphrun.models.hf import tokenizer_folder

        self.tokenizer_folder = tokenizer_folder(spec)
        with phase("bucket setup"):
            self.generator = Generator(
                model, config=self.config, batch_buckets=self.batch_buckets,
                prompt_buckets=self.prompt_buckets, device=self.device,
                dtype=spec.model.dtype, backend=self.backend,
                verify=spec.capture.verify.enabled, lazy=spec.capture.lazy,
                memory_budget_mib=spec.capture.memory_budget_mib,
                compile=spec.model.compile, log=self.log)
        self._slots: dict[int, tuple[list[list[int]], list]] = {}  # slot -> (prompts, ids)
        self.buckets: dict[Bucket, PrefillBucket] = {}
        self.results: list[BatchResult] = []  # every part's, for the generation section
        self.output_tokens = 0  # of the parts generated so far: the progress's tokens/s
        self._decode = None
        self.launcher = self  # the feed's engine (feed/protocols.Engine): it launches its parts
        self.setup_s = time.perf_counter() - t0

    def _model(self):
        return build_generation_model(self.spec, self.device)

    # -- the feed's engine ---------------------------------------------------------------------

    def explain(self, exc: BaseException) -> str | None:
        return None  # the generator's own errors say where and what to do

    def host_slots(self, count: int) -> int:
        return count

    def current_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def device_context(self):
        return torch.cuda.device(self.device) if self.cuda else nullcontext()

    def stage(self, fields: dict, n: int, lengths: dict, slot: int, ids=None) -> Bucket:
        """The part's prompts (unpadded token ids) and record ids (each record's sampling
        stream) kept for its launch; its prefill bucket."""
        tokens, real = fields["input_ids"], lengths[PROMPT_AXIS]
        prompts = [np.asarray(tokens[i])[:int(real[i])].tolist() for i in range(n)]
        record_ids = list(range(n)) if ids is None else (
            ids.tolist() if isinstance(ids, np.ndarray) else list(ids))
        self._slots[slot] = (prompts, record_ids)
        rows = self.batch_buckets[int(np.searchsorted(self.batch_buckets, n))]
        longest = max(len(p) for p in prompts)
        width = self.prompt_buckets[int(np.searchsorted(self.prompt_buckets, longest))]
        return Bucket((rows, width), (BATCH, PROMPT_AXIS))

    def launch(self, bucket: Bucket, slot: int, n: int, lengths: dict, *,
               stream=None) -> Generated:
        """The part's whole generation, on the launching thread: prefill, then the decode
        steps, replayed back to back until every row has stopped."""
        prompts, record_ids = self._slots.pop(slot)
        return self._generate(bucket, prompts, record_ids)

    def run_rows(self, fields: dict, n: int, lengths: dict, ids=None) -> tuple[dict, list]:
        """A part larger than every batch bucket (data.oversize eager): in chunks of the
        largest, as split would run it."""
        parts: dict[str, list] = {}
        ran = []
        for start in range(0, n, self.max_batch):
            stop = min(n, start + self.max_batch)
            part = {k: v[start:stop] for k, v in fields.items()}
            sub = {a: v[start:stop] for a, v in lengths.items()}
            bucket = self.stage(part, stop - start, sub, -1,
                                ids=None if ids is None else ids[start:stop])
            got = self.launch(bucket, -1, stop - start, sub)
            rows, times = got.result()
            for k, v in rows.items():
                parts.setdefault(k, []).append(v)
            ran.append((bucket, times))
        return {k: concat_rows(v) for k, v in parts.items()}, ran

    def _generate(self, bucket: Bucket, prompts: list[list[int]], record_ids: list) -> Generated:
        t0 = time.perf_counter()
        result = self.generator.generate(prompts, record_ids)
        self.results.append(result)
        self.output_tokens += sum(c.output_tokens for c in result.completions)
        seen = self.buckets.setdefault(bucket, PrefillBucket())
        seen.batches += 1
        seen.records += len(prompts)
        seen.padded_rows += bucket.batch - len(prompts)
        seen.padded_positions += bucket.sizes[1] * len(prompts) - sum(map(len, prompts))
        times = {"prefill": result.prefill_s * 1e6, "decode": result.decode_s * 1e6,
                 "e2e": (time.perf_counter() - t0) * 1e6}
        return Generated(result, self._text_decoder(), times)

    def _text_decoder(self):
        """token ids -> text, special tokens skipped (as HF's decode(skip_special_tokens))."""
        if self._decode is None:
            from graphrun.models.hf import fast_tokenizer, remote_code

            tok = fast_tokenizer(self.tokenizer_folder, remote_code(self.spec))
            self._decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
        return self._decode

    def try_every_bucket(self) -> int:
        """One synthetic batch per (batch, prompt) bucket, generated: `validate --load`'s check
        that the model prefills and decodes at every shape before a long run. Returns how many."""
        count = 0
        for rows in self.batch_buckets:
            for width in self.prompt_buckets:
                self.generator.generate([[1] * width for _ in range(rows)], list(range(rows)))
                count += 1
        return count

    # -- the manifest --------------------------------------------------------------------------

    def bucket_reports(self) -> list[BucketReport]:
        reports = []
        for bucket in sorted(self.buckets, key=lambda b: b.sizes):
            seen = self.buckets[bucket]
            reports.append(BucketReport(
                name=bucket.name, sizes=dict(zip(bucket.axes, bucket.sizes)),
                status="captured" if self.backend == "cuda-graph" else "eager",
                batches=seen.batches, records=seen.records, padded_rows=seen.padded_rows,
                padded_positions={PROMPT_AXIS: seen.padded_positions}))
        return reports

    def generation_section(self, percentiles, rejected: int = 0,
                           truncated: int = 0) -> Generation:
        """The manifest's generation section: tokens, finish reasons, rates, TTFT and TPOT,
        decode steps run against those that produced a needed token, the KV cache, every graph."""
        graphs = [GraphSetup(kind=g["kind"], batch=g["shape"]["rows"],
                             length=g["shape"].get("prompt", g["shape"].get("kv")),
                             status=g["status"], reason=g["reason"], set_up=g["set_up"],
                             set_up_s=g["set_up_s"],
                             capture_s=g["capture_s"],
                             memory_bytes=g["memory_bytes"], compiled=g["compiled"])
                  for g in self.generator.buckets()]
        return generation_summary(self.results, percentiles,
                                  kv_cache_bytes=self.generator.kv_bytes, graphs=graphs,
                                  prompts_truncated=truncated, prompts_rejected=rejected,
                                  mbu=self.mbu(), decode_attention=self.decode_attention())

    def decode_attention(self) -> str | None:
        """generation.decode_attention: which attention the decode steps ran (None without a
        decode step)."""
        g = self.generator
        if g.cache is None or not any(r.decode_steps for r in self.results):
            return None
        return ("kernel" if runs_on(g.device, g.dtype, g.cache.layout.head_dim)
                else "general")

    def mbu(self) -> float | None:
        """generation.mbu on a GPU of known peak bandwidth (generate/mbu.py); None on the CPU."""
        if not self.cuda or self.generator.cache is None:
            return None
        layout, g = self.generator.cache.layout, self.generator
        token = kv_bytes_per_token(layout.layers, layout.kv_heads, layout.head_dim,
                                   torch.empty((), dtype=g.dtype).element_size())
        return mbu(self.results, param_bytes=self.param_bytes, kv_token_bytes=token,
                   peak=peak_bandwidth(torch.cuda.get_device_name(self.device)))

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.generator.close()


def build_generation_model(spec: PipelineSpec, device: torch.device):
    """A generation spec's causal LM on `device`, and whose code it is (the manifest's
    environment.model_code, and why transformers' where graphrun's could not): a builtin
    (model.builtin); a Hugging Face folder graphrun's Llama or GPT-2 loads (model.hf.implementation:
    auto or graphrun), which imports no transformers; else as every model is built
    (models/load.py: transformers, target, ...)."""
    m = spec.model
    if m.builtin is not None:
        model = GENERATE_BUILDERS[m.builtin](**m.args, device=device, dtype=torch_dtype(m.dtype))
        return model, ("builtin", None)
    reason = None
    if m.hf is not None and m.hf.implementation != "transformers":
        from graphrun.models.hf import local_folder, not_graphruns
        from graphrun.spec.paths import resolve_path

        folder, found = local_folder(m.hf, resolve_path(m.hf.path, spec.base_dir))
        if folder is not None:
            found = find_checkpoint(folder, m.hf.class_, m.hf.kwargs)
        if isinstance(found, Checkpoint):
            return load_checkpoint(found, device, torch_dtype(m.dtype)), ("graphrun", None)
        if m.hf.implementation == "graphrun":
            raise not_graphruns(m.hf, found)
        reason = found
    from graphrun.models.load import build_model

    return build_model(spec, device, spec.base_dir), ("transformers" if m.hf else None, reason)


def folder_eos_ids(spec: PipelineSpec) -> tuple[int, ...]:
    """The EOS ids a tokenizer's folder names (generation_config.json, else config.json)."""
    from graphrun.models.checkpoint import eos_ids_in
    from graphrun.models.hf import tokenizer_folder

    return eos_ids_in(tokenizer_folder(spec))


def generate_config(spec: PipelineSpec, model) -> GenerateConfig:
    """The spec's generate: section as the generator's config: the stop ids (the model's EOS
    with stop.eos auto, and stop.token_ids), the pad id (the tokenizer's, else EOS, else 0)."""
    g = spec.generate
    eos = []
    own = isinstance(model, OwnLM) and model.eos_ids is not None  # a checkpoint's, read
    if g.stop.eos == "auto":  # a builtin has no config of its own: its tokenizer's folder's
        eos = list(model.eos_ids if own else eos_ids_of(model) if hasattr(model, "config")
                   else folder_eos_ids(spec))
    stops = tuple(dict.fromkeys([*eos, *g.stop.token_ids]))
    pad = model.pad_id if own else getattr(getattr(model, "config", None), "pad_token_id", None)
    if pad is None:
        pad = stops[0] if stops else 0
    s = g.sampling
    return GenerateConfig(
        max_new_tokens=g.max_new_tokens, min_new_tokens=g.min_new_tokens,
        sampling=Sampling(method=s.method, temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, seed=s.seed),
        eos_ids=stops, pad_id=int(pad if not isinstance(pad, (list, tuple)) else pad[0]))


