"""The Generator: prompts (token ids) in, completions out, one batch per generate call.

It owns the static state of generation on one device: the KV cache, the per-row buffers and
the graph table (graphs.py). A batch of n prompts runs on the smallest batch bucket b >= n and
the smallest prompt bucket P >= its longest prompt: the prompts are left-padded into the static
prompt buffer, prefill (b, P) writes cache columns [0, P) and picks the first token, then decode
steps (b, L) pick one token per row each, L the smallest KV length covering the step's column.
Static batching: the rows decode together until all are done or max_new_tokens is reached.

The host never waits on a token: after each launch the device's "all rows done" flag is copied
to pinned host memory behind an event, and before launching step t the host reads the flag of
launch t-2, so the device always has the previous step queued while the host waits. A batch
that is done runs at most two steps more, whose tokens (pad, past every row's EOS) are cut.
Where launch t-1 has finished too by the time step t is launched, the device idled waiting on
the host: those steps are counted (BatchResult.host_bound_steps).
"""

from __future__ import annotations

import bisect
import time
from typing import Callable

import numpy as np
import torch

from graphrun.base.dtypes import torch_dtype

from graphrun.generate.llama import Llama, OwnLM
from graphrun.generate.config import BatchResult, Completion, GenerateConfig, GenerationError, check_config
from graphrun.generate.compiled import CompiledStep
from graphrun.generate.graphs import GraphTable, StepKey
from graphrun.generate.hf_attention import HFCausalLM, is_hf_model, unsupported
from graphrun.generate.kv_cache import KVCache
from graphrun.generate.sampling import record_key
from graphrun.generate.steps import (RowState, decode_lengths, decode_step, kv_lengths,
                                     prefill_step)

MiB = 1 << 20


def adapt(model, max_len: int):
    """(step model, KV layout, close) for a model the generator can drive, else one error."""
    if isinstance(model, OwnLM):
        checkpoint = model.eos_ids is not None  # loaded from a folder, not the builtin
        if max_len > model.max_len:
            limit = ("max_position_embeddings" if checkpoint else "max_len")
            raise GenerationError(
                f"{model.shape.family}: the longest prompt bucket + max_new_tokens is {max_len} "
                f"tokens, past the model's {limit} ({model.max_len}): lower the prompt buckets "
                f"or max_new_tokens" + ("" if checkpoint else ", or give the model a larger "
                                         "max_len"))
        window = model.shape.window
        if window is not None and window < max_len:
            raise GenerationError(
                f"{model.shape.family}: sliding-window attention (sliding_window={window}) is "
                f"not supported; keep the longest prompt bucket + max_new_tokens ({max_len}) "
                "within the window")
        return model, model.layout, lambda: None
    if is_hf_model(model):
        hf = HFCausalLM(model, max_len)
        return hf, hf.layout, hf.close
    raise unsupported(model)


def _place(model, device: torch.device, dtype: torch.dtype) -> None:
    """The model on the generator's device in its dtype, moved only when it is not there;
    graphrun's own models remake their float32 RoPE frequencies, which a dtype cast rounds,
    and its Llama stacks its projections (Llama.fuse_projections)."""
    params = [t for t in model.parameters() if t.is_floating_point()]
    if not all(t.device == device and t.dtype == dtype for t in params):
        model.to(device=device, dtype=dtype)
    if isinstance(model, OwnLM):  # also after a cast by the caller (models/load.py does one)
        model.make_scratch()
    if isinstance(model, Llama):  # on the device, in the dtype: the stacked weights made there
        model.fuse_projections()


class Generator:
    def __init__(self, model, *, config: GenerateConfig, batch_buckets: list[int],
                 prompt_buckets: list[int], device, dtype, backend: str, pool=None,
                 verify: bool = True, lazy: bool = True, memory_budget_mib=None,
                 compile: bool = False, log: Callable[[str], None] | None = None):
        self.config, self.log = config, log or (lambda line: None)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the one it would use
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        if backend not in ("cuda-graph", "eager"):
            raise GenerationError(f"backend {backend!r}: give 'cuda-graph' or 'eager'")
        if backend == "cuda-graph" and self.device.type != "cuda":
            backend = "eager"  # no graphs off a GPU: the same steps, run directly
        self.batch_buckets = sorted(set(batch_buckets))
        self.prompt_buckets = sorted(set(prompt_buckets))
        if not self.batch_buckets or not self.prompt_buckets or min(
                self.batch_buckets + self.prompt_buckets) < 1:
            raise GenerationError(f"buckets: batch {batch_buckets} and prompt {prompt_buckets} "
                                  "need at least one value each, all >= 1")
        rows, max_prompt = self.batch_buckets[-1], self.prompt_buckets[-1]
        self.max_len = max_prompt + config.max_new_tokens
        self.model, layout, self._close_model = adapt(model, self.max_len)  # before any work
        vocab = self.model.vocab
        check_config(config, vocab)
        _place(model, self.device, self.dtype)
        self.kv_bytes = KVCache.bytes_for(layout, rows, self.max_len, self.dtype)
        budget = memory_budget_mib * MiB if memory_budget_mib else None
        if budget is not None and self.kv_bytes > budget:
            raise GenerationError(
                f"the KV cache for {rows} rows x {self.max_len} columns takes "
                f"{self.kv_bytes / MiB:.1f} MiB, past memory_budget_mib={memory_budget_mib}: "
                "lower the largest batch bucket, the largest prompt bucket or max_new_tokens, "
                "or raise the budget")
        self.cache = KVCache(layout, rows, self.max_len, self.dtype, self.device)
        self.state = RowState(rows, max_prompt, config, vocab, self.max_len, self.device)
        self.kv = kv_lengths(self.prompt_buckets, config.max_new_tokens, self.max_len)
        self.compiled = CompiledStep(self.model, self.cache) if compile else None
        self.table = GraphTable(self._make_step, self.state, backend=backend,
                                device=self.device, dtype=self.dtype, pool=pool, verify=verify,
                                budget_bytes=None if budget is None else budget - self.kv_bytes,
                                log=self.log, compiled=compile)
        self._host = _HostSide(rows, max_prompt, self.device)
        if not lazy:
            self.table.prepare(self._all_keys(), "setup")

    def _make_step(self, key: StepKey, compiled: bool = False):
        build = prefill_step if key.kind == "prefill" else decode_step
        model = self.compiled if compiled else self.model
        return build(model, self.state, self.cache, self.config, key.rows, key.length)

    def _all_keys(self) -> list[StepKey]:
        keys = [StepKey("prefill", b, p) for b in self.batch_buckets for p in self.prompt_buckets]
        if self.config.max_new_tokens > 1:
            keys += [StepKey("decode", b, n) for b in self.batch_buckets for n in self.kv]
        return keys

    def _kv_for(self, column_count: int) -> int:
        """The smallest KV length holding `column_count` columns."""
        return self.kv[bisect.bisect_left(self.kv, column_count)]

    def _batch_keys(self, b: int, p: int) -> list[StepKey]:
        """Every graph a batch on (b, p) can need: its prefill and its decode KV lengths."""
        lengths = decode_lengths(self.kv, p, self.config.max_new_tokens)
        return [StepKey("prefill", b, p)] + [StepKey("decode", b, n) for n in lengths]

    def _check_batch(self, prompts: list[list[int]], record_ids: list) -> tuple[int, int]:
        n = len(prompts)
        if n == 0 or n != len(record_ids):
            raise GenerationError(f"generate: {n} prompts and {len(record_ids)} record ids: "
                                  "give one id per prompt, at least one prompt")
        if n > self.batch_buckets[-1]:
            raise GenerationError(f"generate: {n} prompts, past the largest batch bucket "
                                  f"({self.batch_buckets[-1]}): split the batch")
        for prompt, rid in zip(prompts, record_ids):
            if not 1 <= len(prompt) <= self.prompt_buckets[-1]:
                raise GenerationError(
                    f"record {rid!r}: its prompt has {len(prompt)} tokens; give 1 to the "
                    f"largest prompt bucket ({self.prompt_buckets[-1]}), truncated or rejected "
                    "by the caller")
        longest = max(map(len, prompts))
        b = self.batch_buckets[bisect.bisect_left(self.batch_buckets, n)]
        return b, self.prompt_buckets[bisect.bisect_left(self.prompt_buckets, longest)]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], record_ids: list) -> BatchResult:
        b, p = self._check_batch(prompts, record_ids)
        keys = self._batch_keys(b, p)
        self.table.prepare(keys, "first_use")  # capture is setup: its time is capture_s
        called = time.perf_counter()
        clock = _Clock(self.device)
        clock.mark()
        self._host.load(self.state, prompts, record_ids, b, p, self.config)
        self.table[keys[0]].run()  # prefill
        self._host.post_flag(self.state, 0)
        clock.mark()
        steps, used = self._decode(b, p)
        clock.mark()
        out = self.state.out[:len(prompts)].cpu()  # waits for the batch
        prefill_s, decode_s = clock.intervals()
        completions = self._completions(out.numpy(), prompts, steps + 1)
        reasons: dict[str, int] = {}
        for c in completions:
            reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
        return BatchResult(
            completions=completions, prefill_s=prefill_s, decode_s=decode_s,
            ttft_s=clock.host_before_first - called + prefill_s, decode_steps=steps,
            useful_steps=sum(c.output_tokens - 1 for c in completions), bucket=(b, p),
            kv_buckets=tuple(used), rows=b, finish_counts=reasons,
            host_bound_steps=self._host.host_bound)

    def _decode(self, b: int, p: int) -> tuple[int, list[int]]:
        """Decode steps until the flag of the launch before the last says all rows are done,
        or max_new_tokens is reached: (steps run, the KV lengths used in order)."""
        steps, used = 0, []
        for t in range(1, self.config.max_new_tokens):  # t: the place of the token it picks
            if t >= 2 and self._host.done_after(t - 2):
                break
            length = self._kv_for(p + t)  # this step writes column p + t - 1
            if not used or used[-1] != length:
                used.append(length)
            self._host.count_idle(t - 1)
            self.table[StepKey("decode", b, length)].run()
            self._host.post_flag(self.state, t)
            steps += 1
        return steps, used

    def _completions(self, out: np.ndarray, prompts: list[list[int]],
                     produced: int) -> list[Completion]:
        """Each real row's tokens, cut after its first stop id."""
        eos = set(self.config.eos_ids)
        completions = []
        for row, prompt in zip(out, prompts):
            tokens = row[:produced].tolist()
            stop = next((i for i, tok in enumerate(tokens) if tok in eos), None)
            if stop is not None:
                tokens, reason = tokens[:stop + 1], "eos"
            else:
                tokens, reason = tokens[:self.config.max_new_tokens], "length"
            completions.append(Completion(tokens, reason, len(prompt), len(tokens)))
        return completions

    def buckets(self) -> list[dict]:
        """Per graph set up so far: kind, shape, status, capture time, memory, verification."""
        return [entry.describe() for entry in self.table.entries.values()]

    def close(self) -> None:
        """Drop the graphs and buffers; a transformers model gets its attention back."""
        self._close_model()
        self.table.entries.clear()
        self.cache = self.state = None


class _HostSide:
    """The host's staging for a batch (pinned on a GPU, so copies do not wait) and the lagged
    "all done" flags: two slots, each written by a launch and read two launches later."""

    def __init__(self, rows: int, max_prompt: int, device: torch.device):
        pin = device.type == "cuda"
        self.prompt = torch.zeros(rows * max_prompt, dtype=torch.int64, pin_memory=pin)
        # start, real, keys of each row: int64 for one copy each
        self.rows = torch.zeros(3, rows, dtype=torch.int64, pin_memory=pin)
        self.flags = torch.ones(2, dtype=torch.bool, pin_memory=pin)
        self.events = [torch.cuda.Event() for _ in range(2)] if pin else None
        self.host_bound = 0 if pin else None  # this batch's steps the device waited for

    def load(self, state: RowState, prompts, record_ids, b: int, p: int,
             config: GenerateConfig) -> None:
        """Left-pad the prompts into [b, P], with each row's start, real flag and key."""
        prompt = self.prompt[: b * p].view(b, p).numpy()
        prompt.fill(config.pad_id)
        if self.events is not None:
            self.host_bound = 0
        rows = self.rows[:, :b].numpy()
        rows[:] = 0  # padded rows: start 0, not real, key 0
        for i, (ids, rid) in enumerate(zip(prompts, record_ids)):
            prompt[i, p - len(ids):] = ids
            rows[:, i] = (p - len(ids), 1, record_key(config.sampling.seed, rid))
        state.prompt(b, p).copy_(self.prompt[: b * p].view(b, p), non_blocking=True)
        state.start[:b].copy_(self.rows[0, :b], non_blocking=True)
        state.real[:b].copy_(self.rows[1, :b], non_blocking=True)
        state.keys[:b].copy_(self.rows[2, :b], non_blocking=True)

    def post_flag(self, state: RowState, launch: int) -> None:
        slot = launch % 2
        self.flags[slot:slot + 1].copy_(state.all_done, non_blocking=True)
        if self.events is not None:
            self.events[slot].record()

    def count_idle(self, launch: int) -> None:
        """Before the next launch: has `launch`, the last one, finished already? Then the
        device has nothing queued and waits on this launch."""
        if self.events is not None and self.events[launch % 2].query():
            self.host_bound += 1

    def done_after(self, launch: int) -> bool:
        slot = launch % 2
        if self.events is not None:
            self.events[slot].synchronize()
        return bool(self.flags[slot])


class _Clock:
    """Marks on the device's timeline: CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.host_before_first = 0.0

    def mark(self) -> None:
        if not self.marks:
            self.host_before_first = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def build_generator(model, config: GenerateConfig, *, batch_buckets: list[int],
                    prompt_buckets: list[int], device="cpu", dtype=torch.float32,
                    backend: str | None = None, **kwargs) -> Generator:
    """A Generator with the backend its device allows: captured graphs on a GPU, else eager."""
    device = torch.device(device)
    backend = backend or ("cuda-graph" if device.type == "cuda" else "eager")
    return Generator(model, config=config, batch_buckets=batch_buckets,
                     prompt_buckets=prompt_buckets, device=device, dtype=dtype,
                     backend=backend, **kwargs)
