"""GenerationRunner: a generation spec's engine, as the feed drives every engine (feed/protocols.py
Engine): staged parts of record batches in, one completion per record out, in input order.

The feed's three steps keep their threads: the stager hands each part's prompts (token ids from
data.text, read and tokenized by read/) to a host slot; the launcher hands them to the engine's
scheduler (generate/engine.py), which runs on a thread of its own (graphrun-scheduler): it
admits prompts whenever decode slots free up, from every part handed over so far, so a part's
records finish out of order and among other parts' records; the completer waits for each part
in input order (a Part: the completions of its records, filled as they finish), decodes the new
tokens to text and writes the records. Parts in flight are bounded by the feed's host slots, so
memory stays flat whatever the job's size.
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from graphrun.base.dtypes import torch_dtype
from graphrun.base.phases import phase
from graphrun.engine.buckets import Bucket
from graphrun.engine.device import resolve_backend, resolve_device
from graphrun.generate.llama import (Checkpoint, OwnLM, build_llama, find_checkpoint,
                                     load_checkpoint)
from graphrun.generate.config import Completion, GenerateConfig, Sampling
from graphrun.generate.engine import Engine, Finished, Request
from graphrun.generate.hf_attention import check_before_loading, eos_ids_of
from graphrun.generate.records import LOGPROB_OUTPUTS, SAMPLES_OUTPUT, logprobs_asked
from graphrun.generate.mbu import kv_bytes_per_token, peak_bandwidth, weight_bytes_per_step
from graphrun.manifest.keys import BucketReport
from graphrun.manifest.sections import Generation, GraphSetup, generation_summary
from graphrun.models.causal.paged_attention import runs_on
from graphrun.spec.generate import MAX_LOGPROBS, PROMPT_AXIS
from graphrun.spec.keys import BATCH, PipelineSpec
from graphrun.spec.request import REQUEST_FIELD

# the builtin causal LMs a generation spec may name (model.builtin)
GENERATE_BUILDERS = {"llama": build_llama}
# the record batch's field of each record's own RequestParams, where read/ gives one
_END = object()  # the scheduler's input is over


@dataclass
class PartRows:
    """What ran on one part size: the manifest's bucket row."""

    batches: int = 0
    records: int = 0


class Part:
    """A launched part: its records' completions (n samples each), filled by the scheduler as
    they finish; result() waits for the last, decodes their text (the completer's thread) and
    hands back the rows to write."""

    def __init__(self, samples: list[int], decode_text, token_text=None,
                 with_samples: bool = False):
        self.token_text = token_text  # one token id -> its text, where logprobs are written
        self.completions: list[list[Completion | None]] = [[None] * k for k in samples]
        self.left = sum(samples)
        self.with_samples = with_samples  # the rows carry every sample (SAMPLES_OUTPUT)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.decode_text = decode_text
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}

    def finished(self, i: int, completion: Completion) -> None:
        self.completions[i][completion.sample] = completion
        self.left -= 1
        if not self.left:
            self.times["e2e"] = (time.perf_counter() - self.t0) * 1e6
            self.done.set()

    def failed(self, err: BaseException) -> None:
        self.error = err
        self.done.set()

    def wait(self) -> dict[str, float]:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.times

    def result(self) -> tuple[dict, dict[str, float]]:
        """The records' rows: each field of sample 0, output_tokens summed over the samples,
        and with_samples every sample's own (token_ids, text, finish_reason, output_tokens)."""
        self.wait()
        texts = [[self.decode_text(c.token_ids) if c.text is None else c.text for c in samples]
                 for samples in self.completions]
        done = [samples[0] for samples in self.completions]
        outs = {"token_ids": [np.asarray(c.token_ids, dtype=np.int64) for c in done],
                "text": np.array([t[0] for t in texts], dtype=str),
                "finish_reason": np.array([c.finish_reason for c in done], dtype=str),
                "prompt_tokens": np.array([c.prompt_tokens for c in done], dtype=np.int64),
                "output_tokens": np.array([sum(c.output_tokens for c in samples)
                                           for samples in self.completions], dtype=np.int64)}
        if self.token_text is not None:
            outs.update(logprob_outputs(done, self.token_text))
        if done and done[0].prompt_logprobs is not None:  # the job's prompts all scored
            outs["prompt_logprobs"] = [np.asarray(c.prompt_logprobs, dtype=np.float32)
                                       for c in done]
        if self.with_samples:
            rows = np.empty(len(done), dtype=object)  # filled one by one: lists stay whole
            for i, (samples, text) in enumerate(zip(self.completions, texts)):
                rows[i] = [{"token_ids": c.token_ids, "text": t, "finish_reason": c.finish_reason,
                            "output_tokens": c.output_tokens,
                            "logprobs": (logprob_outputs([c], self.token_text)
                                         if self.token_text is not None
                                         and c.logprobs is not None else None)}
                           for c, t in zip(samples, text)]
            outs[SAMPLES_OUTPUT] = rows
        return outs, self.times


def logprob_outputs(done: list[Completion], token_text) -> dict[str, list[np.ndarray]]:
    """records.LOGPROB_OUTPUTS of each completion (empty where it asked none)."""
    outs: dict[str, list[np.ndarray]] = {k: [] for k in LOGPROB_OUTPUTS}
    for c in done:
        asked = c.logprobs is not None
        ids = np.asarray(c.token_ids if asked else [], dtype=np.int64)
        k = len(c.top_ids[0]) if asked and c.top_ids else 0
        top = np.asarray(c.top_ids if asked else [], dtype=np.int64).reshape(len(ids), k)
        outs["logprobs"].append(np.asarray(c.logprobs or [], dtype=np.float32))
        outs["tokens"].append(np.array([token_text(int(t)) for t in ids], dtype=str))
        outs["top_token_ids"].append(top)
        outs["top_logprobs"].append(np.asarray(c.top_logprobs if asked else [],
                                               dtype=np.float32).reshape(top.shape))
        outs["top_tokens"].append(np.array([[token_text(int(t)) for t in row] for row in top],
                                           dtype=str).reshape(top.shape))
    return outs


class GenerationRunner:
    """The model on its device, and the engine (slots, paged KV cache, graphs) over it."""

    def __init__(self, spec: PipelineSpec, *, log=None, needs=None, started=None,
                 choices: dict | None = None):
        """choices: what the engine's steps must be able to do per row (Engine's sample and
        filtered); None: what the spec's records may ask (per_row_choices)."""
        self.spec, self.log = spec, log or (lambda msg: None)
        t0 = time.perf_counter()
        with phase("cuda context") if started else nullcontext():
            self.device = started.wait() if started else resolve_device(spec.device)
        self.backend = resolve_backend(spec.capture.backend, self.device)
        self.cuda = self.device.type == "cuda"
        g = spec.generate
        rows = sorted(spec.buckets[BATCH])
        slots = g.slots or rows[-1]
        self.max_prompt = max(spec.buckets[PROMPT_AXIS])
        with phase("model build"):
            model, self.model_code = self._model()
        self.param_bytes = weight_bytes_per_step(model)  # what a decode step reads
        self.config = generate_config(spec, model)
        from graphrun.models.hf import tokenizer_folder

        self.tokenizer_folder = tokenizer_folder(spec)
        with phase("bucket setup"):
            self.engine = Engine(
                model, config=self.config, slots=slots, max_prompt=self.max_prompt,
                rows=None if g.slots == "auto" else rows, prompts=spec.buckets[PROMPT_AXIS],
                device=self.device, dtype=spec.model.dtype, backend=self.backend,
                block_size=g.kv_block_size, num_blocks=g.kv_blocks,
                prefill_tokens=g.prefill_tokens, prefix_cache=g.prefix_cache,
                verify=spec.capture.verify.enabled,
                memory_budget_mib=spec.capture.memory_budget_mib, compile=spec.model.compile,
                detokenize=self._stop_decoder(), log=self.log,
                **(per_row_choices(spec) if choices is None else choices))
        self.logprobs_out = logprobs_asked(spec)
        self._texts = None
        self.slots = self.max_batch = self.engine.slots  # a part is at most the slots
        self.slot_bytes = self.slots * self.max_prompt * 8
        self._staged: dict[int, tuple[list[list[int]], list, list]] = {}  # host slot -> part
        self.buckets: dict[Bucket, PartRows] = {}
        self._decode = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # parts' Requests, then _END
        self._spare: list[Request] = []  # taken from the queue, not yet handed over
        self._ended = False  # _END taken
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._parts: set[Part] = set()  # launched, not yet finished (failed on an error)
        self._lock = threading.Lock()
        self.launcher = self  # the feed's engine (feed/protocols.Engine)
        self.setup_s = time.perf_counter() - t0

    def _model(self):
        return build_generation_model(self.spec, self.device)

    @property
    def output_tokens(self) -> int:
        """Output tokens of the records finished so far: the progress's tokens/s."""
        return self.engine.stats.output_tokens

    # -- the feed's engine ---------------------------------------------------------------------

    def explain(self, exc: BaseException) -> str | None:
        return None  # the engine's own errors say where and what to do

    def host_slots(self, count: int) -> int:
        return count

    def current_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def device_context(self):
        return torch.cuda.device(self.device) if self.cuda else nullcontext()

    def stage(self, fields: dict, n: int, lengths: dict, slot: int, ids=None) -> Bucket:
        """The part's prompts (unpadded token ids), record ids (each record's sampling stream)
        and own parameters (where the records carry them) kept for its launch; its bucket is
        its row count."""
        tokens, real = fields["input_ids"], lengths[PROMPT_AXIS]
        prompts = [np.asarray(tokens[i])[:int(real[i])].tolist() for i in range(n)]
        record_ids = list(range(n)) if ids is None else (
            ids.tolist() if isinstance(ids, np.ndarray) else list(ids))
        own = fields.get(REQUEST_FIELD)
        params = [None] * n if own is None else [
            None if own[i] is None or own[i].is_default else own[i] for i in range(n)]
        self._staged[slot] = (prompts, record_ids, params)
        return Bucket((n,), (BATCH,))

    def launch(self, bucket: Bucket, slot: int, n: int, lengths: dict, *,
               stream=None) -> Part:
        """The part's prompts handed to the scheduler; nothing waits here."""
        prompts, record_ids, params = self._staged.pop(slot)
        part = Part([self.engine.samples_of(p) for p in params], self.text_decoder(),
                    self._token_text() if self.logprobs_out else None,
                    with_samples=self.spec.output.format == "openai_batch")
        seen = self.buckets.setdefault(bucket, PartRows())
        seen.batches += 1
        seen.records += len(prompts)
        with self._lock:
            if self._error is not None:
                raise self._error
            self._parts.add(part)
        self._start()
        self._queue.put([Request(prompt, rid, own, tag=(part, i))
                         for i, (prompt, rid, own) in enumerate(zip(prompts, record_ids,
                                                                    params))])
        return part

    def run_rows(self, fields: dict, n: int, lengths: dict, ids=None) -> tuple[dict, list]:
        """A part larger than the slots (data.oversize eager): handed over whole, the engine
        admits it as slots free up."""
        bucket = self.stage(fields, n, lengths, -1, ids=ids)
        rows, times = self.launch(bucket, -1, n, lengths).result()
        return rows, [(bucket, times)]

    # -- the scheduler's thread ------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="graphrun-scheduler",
                                            daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        try:
            with self.device_context():
                self.engine.serve(self._take, self._emit)
        except BaseException as err:  # noqa: BLE001 - raised on the threads waiting for parts
            with self._lock:
                self._error = err
                parts, self._parts = list(self._parts), set()
            for part in parts:
                part.failed(err)

    def _take(self, n: int, block: bool) -> list[Request] | None:
        """Up to n requests: a part's arrive together (the queue holds whole parts), so its
        prompts are admitted together where slots allow."""
        got, spare = [], self._spare
        while len(got) < n:
            if not spare and self._ended:
                break
            if not spare:
                try:
                    item = self._queue.get(block=block and not got)
                except queue.Empty:
                    break
                if item is _END:
                    self._ended = True
                    break
                spare.extend(item)
            take = min(n - len(got), len(spare))
            got += spare[:take]
            del spare[:take]
        self._spare = spare
        return None if not got and self._ended else got

    def _emit(self, done: Finished) -> None:
        part, i = done.request.tag
        part.finished(i, done.completion)
        if not part.left:
            with self._lock:
                self._parts.discard(part)

    def text_decoder(self):
        """token ids -> text, special tokens skipped (as HF's decode(skip_special_tokens))."""
        if self._decode is None:
            from graphrun.models.hf import fast_tokenizer, remote_code

            tok = fast_tokenizer(self.tokenizer_folder, remote_code(self.spec))
            self._decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
        return self._decode

    def _token_text(self):
        """token id -> its text as decoded alone (special tokens kept: a logprob belongs to
        every token), each id decoded once."""
        if self._texts is None:
            from functools import lru_cache

            from graphrun.models.hf import fast_tokenizer, remote_code

            tok = fast_tokenizer(self.tokenizer_folder, remote_code(self.spec))
            self._texts = lru_cache(maxsize=1 << 16)(
                lambda t: tok.decode([t], skip_special_tokens=False))
        return self._texts

    def _stop_decoder(self):
        """token ids -> text for the scheduler's stop strings: a tokenizer of its own (its
        thread's), loaded on the first row with stop strings."""
        tok = []

        def decode(ids: list[int]) -> str:
            if not tok:
                from graphrun.models.hf import fast_tokenizer, remote_code

                tok.append(fast_tokenizer(self.tokenizer_folder, remote_code(self.spec)))
            return tok[0].decode(ids, skip_special_tokens=True)

        return decode

    def try_every_bucket(self) -> int:
        """Synthetic prompts of every prefill size's length (up to the longest prompt), as many
        as the slots, generated: `validate --load`'s check that the model prefills and decodes
        at every shape before a long run. Returns how many graphs the engine has."""
        lengths = [t for t in self.engine.prefill_sizes if t <= self.max_prompt]
        self.engine.generate([[1] * t for t in lengths for _ in range(self.slots)])
        return len(self.engine.graphs())

    # -- the manifest --------------------------------------------------------------------------

    def bucket_reports(self) -> list[BucketReport]:
        status = "captured" if self.backend == "cuda-graph" else "eager"
        return [BucketReport(name=b.name, sizes=dict(zip(b.axes, b.sizes)), status=status,
                             batches=seen.batches, records=seen.records, padded_rows=0)
                for b, seen in sorted(self.buckets.items(), key=lambda kv: kv[0].sizes)]

    def manifest_sections(self, percentiles, rejected: int = 0, truncated: int = 0) -> dict:
        """The manifest's sections of this engine's own: generation."""
        return {"generation": self.generation_section(percentiles, rejected, truncated)}

    def generation_section(self, percentiles, rejected: int = 0,
                           truncated: int = 0) -> Generation:
        """The manifest's generation section: tokens, finish reasons, rates, TTFT and TPOT,
        decode row-steps run against those that made a needed token, slots and KV blocks in
        use, every graph."""
        e = self.engine
        graphs = [GraphSetup(kind=g["kind"], size=g["shape"][g["axis"]], status=g["status"],
                             reason=g["reason"], set_up=g["set_up"], set_up_s=g["set_up_s"],
                             capture_s=g["capture_s"], memory_bytes=g["memory_bytes"],
                             compiled=g["compiled"])
                  for g in e.graphs()]
        return generation_summary(
            e.stats, percentiles, slots=e.slots, kv_block_size=e.block_size,
            kv_blocks=e.num_blocks, kv_cache_bytes=e.kv_bytes, graphs=graphs,
            prompts_truncated=truncated, prompts_rejected=rejected, mbu=self.mbu(),
            decode_attention=self.decode_attention())

    def decode_attention(self) -> str | None:
        """generation.decode_attention: which attention the decode steps ran (None without a
        decode step)."""
        e = self.engine
        if e.cache is None or not e.stats.decode_steps:
            return None
        # soft-capped scores, or a window shorter than a row's blocks, run the torch reference
        # (kv_cache.attend)
        window, softcap = getattr(e.model, "window", None), getattr(e.model, "softcap", None)
        general = softcap is not None or (window is not None
                                          and window < e.max_blocks * e.block_size)
        kernel = runs_on(e.device, e.dtype, e.cache.layout.head_dim) and not general
        return "kernel" if kernel else "general"

    def mbu(self) -> float | None:
        """generation.mbu on a GPU of known peak bandwidth (generate/mbu.py); None on the CPU."""
        e = self.engine
        peak = peak_bandwidth(torch.cuda.get_device_name(self.device)) if self.cuda else None
        if peak is None or e.cache is None or e.stats.decode_s <= 0:
            return None
        layout = e.cache.layout
        token = kv_bytes_per_token(layout.layers, layout.kv_heads, layout.head_dim,
                                   torch.empty((), dtype=e.dtype).element_size())
        read = e.stats.decode_steps * self.param_bytes + e.stats.kv_token_steps * token
        return read / e.stats.decode_s / peak

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(_END)
            self._thread.join()
            self._thread = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.engine.close()


def per_row_choices(spec: PipelineSpec) -> dict:
    """What the engine's steps must be able to do for records that carry their own parameters
    (read/ gives them where the spec lets records ask: an OpenAI Batch file, or
    generate.per_record): sample beside greedy rows, cut by top_k, top_p or min_p, penalize,
    give up to MAX_LOGPROBS alternatives. Absent: from the spec's generate: section alone (a
    greedy job's steps draw no noise, sort nothing, count nothing)."""
    fields = spec.generate.per_record.fields
    batch = spec.data.format == "openai_batch"
    if not (fields or batch):
        return {}
    choices = {"sample": True, "filtered": True}
    if batch or fields.keys() & {"repetition_penalty", "presence_penalty", "frequency_penalty"}:
        choices["penalized"] = True
    if batch or "logprobs" in fields:
        choices["logprobs"] = MAX_LOGPROBS
    return choices


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
    if m.hf is not None:  # refused before its weights are read
        from graphrun.spec.paths import resolve_path

        check_before_loading(m.hf, resolve_path(m.hf.path, spec.base_dir),
                             max(spec.buckets[PROMPT_AXIS]) + spec.generate.max_new_tokens)
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
                          top_p=s.top_p, seed=s.seed, min_p=s.min_p,
                          repetition_penalty=s.repetition_penalty,
                          presence_penalty=s.presence_penalty,
                          frequency_penalty=s.frequency_penalty),
        eos_ids=stops, pad_id=int(pad if not isinstance(pad, (list, tuple)) else pad[0]),
        logprobs=g.logprobs, prompt_logprobs=g.prompt_logprobs,
        stop_strings=tuple(g.stop.strings), n=g.n)


