"""GenerationRunner: a generation spec's job engine: the causal LM on its device, the
generation engine over it (generate/engine.py: slots, paged KV cache, graphs) and its place in
the feed (generate/scheduler.py's Scheduler, the runner's `launcher`), the tokenizer's decoders
and the manifest's generation section. The job's spine drives it as it drives a forward pass's
Runner (job/state.py's JobRunner).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable

import torch

from graphrun.base import envs
from graphrun.base.dtypes import torch_dtype
from graphrun.base.errors import GraphrunError
from graphrun.base.phases import phase
from graphrun.base.triton_switch import prefetch
from graphrun.engine.device import resolve_backend, resolve_device
from graphrun.engine.driver import gpu_possible
from graphrun.models.builtins import BUILTINS
from graphrun.models.causal.llama import (Checkpoint, OwnLM, find_checkpoint,
                                          load_checkpoint)
from graphrun.generate.config import GenerateConfig, Sampling
from graphrun.generate.compiled import CompiledStep
from graphrun.generate.engine import Engine
from graphrun.models.causal.hf_attention import check_before_loading, eos_ids_of
from graphrun.generate.records import logprobs_asked
from graphrun.generate.steps import check_kernels
from graphrun.generate.scheduler import Scheduler
from graphrun.generate.mbu import kv_bytes_per_token, peak_bandwidth, weight_bytes_per_step
from graphrun.manifest.keys import BucketReport
from graphrun.manifest.sections import (Generation, GraphSetup, KernelWarmUp,
                                        generation_summary)
from graphrun.models.causal.paged_attention import runs_on
from graphrun.models.causal.warm import (NO_CUDA, Skip, WarmUp, claim, layout_of, register,
                                         warm_kernels)
from graphrun.spec.generate import MAX_LOGPROBS, PROMPT_AXIS
from graphrun.spec.keys import BATCH, PipelineSpec
from graphrun.spec.request import RequestParams

TRY_NEW_TOKENS = 3  # validate --load: a prefill and two decode steps per synthetic record


class GenerationRunner:
    """The model on its device, and the engine (slots, paged KV cache, graphs) over it."""

    def __init__(self, spec: PipelineSpec, *, log=None, needs=None, started=None,
                 choices: dict | None = None, compiler: Callable = CompiledStep):
        """choices: what the engine's steps must be able to do per row (Engine's sample and
        filtered); None: what the spec's records may ask (per_row_choices). compiler: the
        engine's step model under model.compile (Engine's)."""
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
        self.warm: WarmUp | None = None  # the kernels' warm-up, begun once the layout is known
        with phase("model build"):
            model, self.model_code = self._model()
        self.param_bytes = weight_bytes_per_step(model)  # what a decode step reads
        self.config = generate_config(spec, model)
        from graphrun.models.hf import tokenizer_folder

        self.tokenizer_folder = tokenizer_folder(spec)
        with phase("bucket setup"):
            self.engine = Engine(
                model, config=self.config, slots=slots, max_prompt=self.max_prompt,
                rows=rows, prompts=spec.buckets[PROMPT_AXIS],
                device=self.device, dtype=spec.model.dtype, backend=self.backend,
                block_size=g.kv_block_size, num_blocks=g.kv_blocks,
                prefill_tokens=g.prefill_tokens, prefix_cache=g.prefix_cache,
                verify=spec.capture.verify.enabled, warm=self.warm,
                memory_budget_mib=spec.capture.memory_budget_mib, compile=spec.model.compile,
                detokenize=self._stop_decoder(), log=self.log, compiler=compiler,
                **(per_row_choices(spec) if choices is None else choices))
        self._texts = None
        self._decode = None
        self.slots = self.engine.slots
        self.launcher = Scheduler(
            self.engine, self.device, text_decoder=self.text_decoder,
            token_text=self._token_text if logprobs_asked(spec) else None,
            with_samples=spec.output.format == "openai_batch")
        self.setup_s = time.perf_counter() - t0

    def _model(self):
        return build_generation_model(self.spec, self.device, layout_known=self._warm_up)

    def _warm_up(self, shape) -> None:
        """The kernels' warm-up for the model's shape: the one the process began at its start
        for this spec (begin_warm_up), else one begun now, while the weights load (none with
        GRAPHRUN_KERNEL_WARM_UP=off)."""
        if envs.switch("GRAPHRUN_KERNEL_WARM_UP", True):
            self.warm = claim(warm_up_key(self.spec)) or WarmUp.begin(
                layout_of(shape), self.device, torch_dtype(self.spec.model.dtype),
                self.spec.generate.kv_block_size,
                also=lambda device: check_kernels(device, shape.vocab))

    @property
    def output_tokens(self) -> int:
        """Output tokens of the records finished so far: the progress's tokens/s."""
        return self.engine.stats.output_tokens

    @property
    def default_path(self) -> tuple[bool, str]:
        """(overlapped, why) where neither the caller nor GRAPHRUN_OVERLAP chose: overlapped on
        every device. Serially one part is in flight, so no prompt waits to refill a slot
        that frees up."""
        return True, "the default for generation: prompts wait to refill the slots that free up"

    def device_context(self):
        """The runner's device made current (in-process generation: LLM)."""
        return torch.cuda.device(self.device) if self.cuda else nullcontext()

    def text_decoder(self):
        """token ids -> text, special tokens skipped (as HF's decode(skip_special_tokens))."""
        if self._decode is None:
            from graphrun.models.hf import fast_tokenizer, remote_code

            tok = fast_tokenizer(self.tokenizer_folder, remote_code(self.spec))
            self._decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
        return self._decode

    def _token_text(self):
        """token id -> its text in the logprob outputs (generate/token_bytes.py: its own
        bytes, special tokens' included, as whole characters or `bytes:\\xNN`)."""
        if self._texts is None:
            from graphrun.generate.token_bytes import token_texts
            from graphrun.models.hf import fast_tokenizer, remote_code

            self._texts = token_texts(fast_tokenizer(self.tokenizer_folder,
                                                     remote_code(self.spec)))
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
        prompts = [[1] * t for t in lengths for _ in range(self.slots)]
        cap = self.engine.config.max_new_tokens
        short = RequestParams(max_new_tokens=min(TRY_NEW_TOKENS, cap))
        self.engine.generate(prompts, params=[short] * len(prompts))
        return len(self.engine.graphs())

    # -- the manifest --------------------------------------------------------------------------

    def bucket_reports(self) -> list[BucketReport]:
        status = "captured" if self.backend == "cuda-graph" else "eager"
        return [BucketReport(name=b.name, sizes=dict(zip(b.axes, b.sizes)), status=status,
                             batches=seen.batches, records=seen.records, padded_rows=0)
                for b, seen in sorted(self.launcher.parts.items(), key=lambda kv: kv[0].sizes)]

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
            decode_attention=self.decode_attention(),
            warm_up=KernelWarmUp(**self.warm.report()) if self.warm is not None else None,
            records_taken_back=self.launcher.taken_back)

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
        self.launcher.close()
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


def begin_warm_up(spec: PipelineSpec, started) -> None:
    """The kernels' warm-up of a generation spec begun at the process's start (the CLI's, beside
    its imports; run()'s, beside its setup), for its runner to claim: on its thread, Triton's
    import and cache key while the device starts (where a GPU may be used), then, once the
    device has started (started: its DeviceStart), the layout is read (own_shape) and the
    kernels warmed. Not where the spec is no generation job, the device the CPU, or with
    GRAPHRUN_KERNEL_WARM_UP=off; skipped on its thread where graphrun's code does not run the
    model (no layout to read)."""
    if (spec.generate is None or started is None
            or not envs.switch("GRAPHRUN_KERNEL_WARM_UP", True)):
        return
    import graphrun.models.hf  # noqa: F401 - imported here, not on the thread beside imports
    import graphrun.spec.paths  # noqa: F401

    def work() -> list[str]:
        # Triton's import and cache key need no device: made while it starts, or waited for
        # where the CLI began them before torch's import (triton_switch.prefetch_beside)
        early = gpu_possible(spec.device) and prefetch()
        device = started.wait()
        if device.type != "cuda":
            raise Skip(NO_CUDA)
        shape = own_shape(spec)
        if shape is None:
            raise Skip("graphrun's own code does not run this model: no layout to read")
        return ((["triton's import and key"] if early else [])
                + warm_kernels(layout_of(shape), device, torch_dtype(spec.model.dtype),
                               spec.generate.kv_block_size)
                + check_kernels(device, shape.vocab))  # the pick's and bookkeeping's, checked

    register(warm_up_key(spec), lambda: WarmUp(work))


def warm_up_key(spec: PipelineSpec) -> tuple:
    """What a warm-up begun for a spec is kept by: its model, dtype, device and block size."""
    return (str(spec.base_dir), spec.device, spec.model.model_dump_json(),
            spec.generate.kv_block_size)


def own_shape(spec: PipelineSpec):
    """The shape (LlamaShape, GPT2Shape) of the model graphrun's own code builds for the spec,
    read from a builtin's arguments or the folder's config.json; None where transformers' code
    would (or the spec is wrong: the build says how)."""
    m = spec.model
    try:
        if m.builtin is not None:
            return BUILTINS[m.builtin].shape_of(m.args)
        if m.hf is None or m.hf.implementation == "transformers":
            return None
        found = _checkpoint(spec)
    except (TypeError, ValueError, GraphrunError):
        return None
    return found.shape if isinstance(found, Checkpoint) else None


def _checkpoint(spec: PipelineSpec) -> "Checkpoint | str | None":
    """model.hf's folder as a Checkpoint graphrun's code loads, or why not."""
    from graphrun.models.hf import local_folder
    from graphrun.spec.paths import resolve_path

    hf = spec.model.hf
    folder, found = local_folder(hf, resolve_path(hf.path, spec.base_dir))
    return find_checkpoint(folder, hf.class_, hf.kwargs) if folder is not None else found


def build_generation_model(spec: PipelineSpec, device: torch.device,
                           layout_known: Callable[[object], None] | None = None):
    """A generation spec's causal LM on `device`, and whose code it is and why (the manifest's
    environment.model_code and model_code_reason): a builtin (model.builtin); a Hugging Face
    folder graphrun's Llama or GPT-2 loads (model.hf.implementation: auto or graphrun), which
    imports no transformers; else as every model is built (models/load.py: transformers,
    target, ...). layout_known: called with graphrun's model's
    shape (LlamaShape, GPT2Shape) before its weights are made or read."""
    m = spec.model
    if m.builtin is not None:
        shape = own_shape(spec) if layout_known is not None else None
        if shape is not None:  # None: the builder says what is wrong, below
            layout_known(shape)
        build = BUILTINS[m.builtin].builder_function()
        model = build(**m.args, device=device, dtype=torch_dtype(m.dtype))
        return model, ("builtin", None)
    reason = None
    if m.hf is not None and m.hf.implementation != "transformers":
        from graphrun.models.hf import code_reason, not_graphruns

        found = _checkpoint(spec)
        if isinstance(found, Checkpoint):
            if layout_known is not None:
                layout_known(found.shape)
            return load_checkpoint(found, device, torch_dtype(m.dtype)), (
                "graphrun", code_reason(m.hf, found.shape.family))
        if m.hf.implementation == "graphrun":
            raise not_graphruns(m.hf, found)
        reason = found
    code = (None, None)
    if m.hf is not None:  # refused before its weights are read
        from graphrun.models.hf import code_reason
        from graphrun.spec.paths import resolve_path

        check_before_loading(m.hf, resolve_path(m.hf.path, spec.base_dir),
                             max(spec.buckets[PROMPT_AXIS]) + spec.generate.max_new_tokens)
        code = ("transformers", code_reason(m.hf, why_not=reason))
    from graphrun.models.load import build_model

    return build_model(spec, device, spec.base_dir), code


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


