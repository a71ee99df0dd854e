"""Sections of the manifest beside one run's counts (manifest.py): where the process's time
went (phases), the parts of a job spread out (the workers of `--gpus N` / torchrun, the
actors of a `--ray` run), and a generation job's tokens and graphs."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Phase(_M):
    name: str
    s: float = Field(..., description="Seconds of the main thread in this phase, phases "
                     "nested in it not counted (they are phases of their own).")


class BucketPhases(_M):
    bucket: str
    lane: int = Field(..., description="0: the first lane; 1: the overlapped stream's second.")
    within: Optional[str] = Field(
        None, description="null: set up before the stream, its seconds are part of the "
        "top-level warm-up, capture and verify; `bucket setup on first use` (capture.lazy): "
        "set up mid-stream, its seconds are part of that top-level phase.")
    warmup_s: float = 0.0
    capture_s: float = 0.0
    verify_s: float = 0.0


class Phases(_M):
    """Where the process's time went, from its start to the manifest (totals.process_wall_s)."""

    process_start: Literal["proc", "psutil", "graphrun import"] = Field(
        ..., description="How the process's start was known: proc (/proc/self/stat, 10 ms "
        "ticks), psutil, or graphrun import (no OS start time: the interpreter's start and "
        "the imports before graphrun are missing from the phases and from process_wall_s).")
    top: list[Phase] = Field(
        ..., description="A flat list, each phase once, in the order first entered (a phase "
        "entered again, such as warm-up per bucket, adds up), then `other`: the time no "
        "phase covered. They never overlap and add up to totals.process_wall_s. The main "
        "thread's phases: interpreter and imports (the CLI's: the interpreter, graphrun, "
        "torch; with the Python API, `before run()`: what the process did before), "
        "spec, bucket plan (buckets: auto), input hash start (the input's and model files' "
        "hashing started beside the run), output folder (preparing it, run.json), reader "
        "start (its thread reads the first batch beside setup), input hash wait, cuda "
        "context, imports (transformers) or imports (timm) (the model library's import, "
        "its lazily imported model code included), model build, weights load, to device, "
        "compile (wrapping only: "
        "torch.compile compiles in the first warm-up), first call and buffers, warm-up, "
        "capture, verify (every bucket and lane set up before the stream), bucket setup (the "
        "rest of it), verify on the input's batches (each bucket set up at start checked "
        "against eager on the first batch of the input that selects it, where the reader "
        "held that batch by then), eager baseline, output open (starting the threads that open the writer, "
        "latencies.jsonl and count the records for the progress bar beside setup, and "
        "waiting for them after it), host slots (pinned), stream, bucket setup on first use "
        "(capture.lazy: the buckets set up mid-stream, when a batch first selected them: "
        "their warm-up, capture, verification and eager baseline, all of it; not the stream's), "
        "drain and fsync (the last commits, closing the writer), manifest write (gathering "
        "its content: the run's end).")
    buckets: list[BucketPhases] = Field(
        default_factory=list, description="warm-up, capture and verify per bucket and lane: "
        "a breakdown of top-level phases, not more time. Per name, the seconds of the "
        "entries with within null add up to the top-level phase of that name; those of the "
        "entries within `bucket setup on first use` are part of that phase.")


class RayActor(_M):
    """One actor of a --ray run's pool: its Runner and what it ran."""

    host: str
    pid: int
    device: str
    backend: str
    setup_s: float = Field(..., description="Its Runner's model build, buffers, capture and "
                           "verify.")
    capture_s: float
    batches: int
    records: int = Field(..., description="Records it wrote out.")
    rejected: int
    busy_s: float = Field(..., description="Time in its batches (check, run, report).")
    warnings: list[str] = Field(default_factory=list)


class RayReport(_M):
    """What Ray ran (`graphrun run --ray`)."""

    ray_version: str
    address: Optional[str] = Field(None, description="The --address asked for; null: "
                                   "RAY_ADDRESS, or a local cluster.")
    workers: int = Field(..., description="Actors in the pool (one GPU each on a GPU spec).")
    nodes: int = Field(..., description="Nodes of the cluster alive at the end.")
    actors: list[RayActor]
    dataset_stats: str = Field(..., description="Ray Data's own statistics of the run "
                               "(Dataset.stats()), as text; empty when it failed.")


class WorkerReport(_M):
    """One worker of a job spread over several processes (--gpus, torchrun)."""

    rank: int
    device: Optional[str] = Field(None, description="The device it was given: "
                                  "cuda:LOCAL_RANK, or cpu.")
    status: Literal["completed", "interrupted", "failed"]
    error: Optional[str] = None
    slice: list[int] = Field(..., description="[start, stop): the input records of its share.")
    shards: list[int] = Field(..., description="[first, end): the shard numbers its share may "
                              "use; a share with rejects writes fewer.")
    records_in: int
    records_out: int
    records_rejected: int
    batches: int = 0
    setup_s: float = Field(0.0, description="Its model build, capture and verify.")
    capture_s: float = 0.0
    stream_s: float = 0.0
    records_per_s: float = Field(0.0, description="Its records out this attempt / its stream_s.")


class DecodeWaste(_M):
    """Where the decode row-steps that made no needed token went (they add up to
    decode_row_steps - useful_steps)."""

    admission: int = Field(..., description="Empty slots stepped while prompts waited: while "
                           "rows decode, a prefill waits for a sixteenth of the slots to be "
                           "free (or 8 decode steps), so as to prefill few and full.")
    no_prompt: int = Field(..., description="Empty slots stepped while no prompt waited: the "
                           "job's tail (or an input read slower than the engine), each step "
                           "the smallest captured row count covering the rows left.")
    stopped: int = Field(..., description="Rows stepped after their last token, before it was "
                         "read back: the step launched while the one that finished them runs "
                         "(about one per record).")


class GraphSetup(_M):
    """One graph of a generation job: a decode step per row count, a packed prefill per token
    count."""

    kind: Literal["prefill", "decode"]
    size: int = Field(..., description="decode: the rows it steps (the slots in use, rounded "
                      "up to a captured size); prefill: the tokens of the prompts packed into "
                      "it.")
    status: Literal["captured", "eager", "skipped", "unused"] = Field(
        ..., description="As buckets[].status: captured, eager (the eager backend or "
        "capture.on_failure: eager), skipped (capture.memory_budget_mib), unused (no batch "
        "needed it).")
    reason: Optional[str] = Field(None, description="Why eager, skipped or unused.")
    set_up: Literal["setup", "first_use"] = Field(
        "setup", description="When it was set up: at setup, or on the first batch that needed it "
        "(its set_up_s is then inside totals.stream_s).")
    set_up_s: Optional[float] = Field(None, description="Warm-up, capture and verification "
                                      "of this graph; null when never set up.")
    capture_s: Optional[float] = Field(None, description="The capture alone; null when not "
                                       "captured.")
    memory_bytes: Optional[int] = Field(None, description="Pool growth while capturing it.")
    compiled: Optional[bool] = Field(
        None, description="model.compile: true: whether its step ran torch.compile's kernels "
        "(false: set up from the plain model, reason says why); null when compile is off.")
    rank: Optional[int] = Field(None, description="The worker that set it up (--gpus, "
                                "torchrun: each sets up its own); null in a single process.")


class KernelWarmUp(_M):
    """The kernels' warm-up of a generation job (models/causal/warm.py): Triton's paged decode
    kernels compiled, the first attention and matrix multiply run, on a thread beside the
    weights' load, before the graphs are set up."""

    status: Literal["done", "failed", "skipped", "running"] = Field(
        ..., description="done; failed (reason says why: the graphs' set-up compiled the "
        "kernels itself, as without a warm-up); skipped (no CUDA device).")
    reason: Optional[str] = Field(None, description="Why it failed or was skipped.")
    run_s: Optional[float] = Field(None, description="Its own time, on its thread, beside "
                                   "the model's build; null when skipped.")
    wait_s: float = Field(0.0, description="The time the engine waited for it before its first "
                          "graph (the phase 'kernel warm-up'; not in graphs[].set_up_s).")
    kernels: list[str] = Field(default_factory=list, description="What it ran: triton's "
                               "import and key (while the device started), matmul, prefill "
                               "attention, fused elementwise, paged decode, the pick.")


class Generation(_M):
    """A generation job's counts and times (a spec with generate:); the records are prompts,
    totals.records_* count them."""

    records: int = Field(..., description="Completions made by this attempt (a prompt of n "
                         "samples makes n).")
    prompt_tokens: int = Field(..., description="Tokens of those prompts, as prefilled (after "
                               "any cut of data.text.truncate).")
    output_tokens: int = Field(..., description="New tokens written (EOS included where a "
                               "record stopped there).")
    finish_reasons: dict[str, int] = Field(
        ..., description="Completions per finish_reason (a sample each): eos (a stop id: the "
        "model's EOS or generate.stop.token_ids), stop (a stop string) or length "
        "(generate.max_new_tokens).")
    output_tokens_per_s: float = Field(
        ..., description="output_tokens / (prefill_s + decode_s): the device's generation "
        "rate, setup not counted (totals.process_wall_s has the whole process).")
    prefill_s: float = Field(..., description="Time in prefill (the packed prompts' forward "
                             "passes writing the KV cache).")
    decode_s: float = Field(..., description="Time in decode steps.")
    ttft_ms: dict[str, float] = Field(
        ..., description="Time to first token per record: from the engine taking its prompt to "
        "its first new token read back, percentile (report.percentiles, as p50) -> ms (within "
        "1%: a fixed-size sketch, not every record's time).")
    tpot_ms: dict[str, float] = Field(
        ..., description="Time per output token per record after its first (from its first token "
        "to its last / its output tokens - 1), percentile -> ms; records of one token left "
        "out.")
    decode_steps: int = Field(
        ..., description="Decode steps run; each steps the rows of the smallest decode graph "
        "covering the highest occupied slot.")
    decode_row_steps: int = Field(
        ..., description="Row-steps run: per decode step, the rows of its graph (empty slots and "
        "rows that stopped but were not yet read back included).")
    useful_steps: int = Field(
        ..., description="Row-steps that made a token a record needed: per record, its output "
        "tokens less the one prefill made. decode_row_steps - useful_steps is the waste: slots "
        "empty while no prompt waited (the job's tail), rows stopped but not yet read back.")
    wasted_fraction: float = Field(..., description="1 - useful_steps / decode_row_steps (0 "
                                   "when no step ran).")
    waste: Optional[DecodeWaste] = Field(None, description="decode_row_steps - useful_steps "
                                         "by cause.")
    kv_cache_bytes: int = Field(..., description="Bytes of the KV cache's block pool (all "
                                "layers, keys and values), allocated once.")
    slots: int = Field(0, description="Decode slots: the records decoding at once, at most.")
    slot_occupancy: float = Field(
        0.0, description="Slots holding a record, per decode step, as a share of the slots "
        "(mean over the decode steps).")
    prefills: int = Field(0, description="Packed prefills run (each admits the prompts that "
                          "fit the free slots).")
    kv_block_size: int = Field(0, description="Tokens per KV block (generate.kv_block_size).")
    kv_blocks: int = Field(0, description="Blocks in the pool, the trash block included.")
    kv_blocks_mean: float = Field(0.0, description="Blocks held by records, mean over the "
                                  "decode steps.")
    kv_blocks_peak: int = Field(0, description="Blocks held by records at once, at most.")
    graphs: list[GraphSetup] = Field(
        default_factory=list, description="Each prefill and decode graph: its capture time and "
        "memory.")
    mbu: Optional[float] = Field(
        None, description="GPU runs: model bandwidth utilisation of decode, the bytes a step "
        "must read (weights and the KV columns attended) / step time / the device's peak "
        "memory bandwidth; null on the CPU or where the peak is unknown.")
    prompt_tokens_computed: int = Field(
        0, description="Prompt tokens prefilled: prompt_tokens less those reused.")
    prefill_positions: int = Field(
        0, description="Positions the packed prefills computed: each prefill's packed prompts "
        "padded to its graph's size (the smallest buckets.seq value that holds them).")
    prefill_padding: float = Field(
        0.0, description="1 - prompt_tokens_computed / prefill_positions: the prefills' share "
        "of padding, as run; 0 when no prompt was prefilled.")
    prompt_tokens_reused: int = Field(
        0, description="Prompt tokens whose keys came from the prefix cache (generate."
        "prefix_cache): leading full KV blocks an earlier prompt with the same tokens computed.")
    prefix_hit_rate: float = Field(0.0, description="prompt_tokens_reused / (computed + "
                                   "reused); 0 when no prompt was prefilled.")
    prompts_truncated: int = Field(0, description="Prompts longer than the largest seq bucket "
                                   "(or data.text.max_length), cut from the left and run.")
    prompts_rejected: int = Field(0, description="Records rejected over the whole run, "
                                  "whatever the reason (as totals.records_rejected: a bad line "
                                  "or value, a prompt too long and not cut with "
                                  "data.text.truncate: false, ...), each in rejects.jsonl.")
    decode_attention: Optional[str] = Field(
        None, description="The attention of the decode steps: 'kernel' (graphrun's Triton "
        "kernel: the cache write and the attention in one pass, on a GPU) or 'general' "
        "(torch's indexing, then scaled_dot_product_attention: on the CPU, without Triton, or "
        "once the kernel failed, whose reason is in graphs[]); workers that differ are listed "
        "comma-separated.")
    host_bound_steps: Optional[int] = Field(
        None, description="GPU runs: decode steps the device waited for, launched after every "
        "step before them had finished. Near 0: the host stays ahead and decode is bound by "
        "the device; a large share of decode_steps: the host's launches are the limit (a "
        "small model, a slow or busy CPU). Null on the CPU, where the host runs each step.")
    warm_up: Optional[KernelWarmUp] = Field(
        None, description="The kernels' warm-up before the graphs' set-up; null where none ran "
        "(a transformers model). Workers: the one that waited longest.")
    records_taken_back: int = Field(
        0, description="--resume: records whose completions an interrupted attempt had "
        "finished but not committed, read back from finished.jsonl instead of generated again "
        "(not in records, which counts completions: a prompt of n samples counts once here, n "
        "times there).")


def generation_summary(stats, percentiles, *, slots: int, kv_block_size: int, kv_blocks: int,
                       kv_cache_bytes: int, graphs: list[GraphSetup] = (),
                       prompts_truncated: int = 0, prompts_rejected: int = 0,
                       mbu: float | None = None,
                       decode_attention: str | None = None,
                       warm_up: KernelWarmUp | None = None,
                       records_taken_back: int = 0) -> Generation:
    """The generation section from an engine's running sums (generate/stats.GenerationStats)."""
    row_steps, steps = stats.decode_row_steps, stats.decode_steps
    busy = stats.prefill_s + stats.decode_s
    return Generation(
        records=stats.records, prompt_tokens=stats.prompt_tokens,
        output_tokens=stats.output_tokens, finish_reasons=dict(stats.finish_reasons),
        output_tokens_per_s=stats.output_tokens / busy if busy else 0.0,
        prefill_s=stats.prefill_s, decode_s=stats.decode_s,
        ttft_ms=stats.ttft.percentiles(percentiles), tpot_ms=stats.tpot.percentiles(percentiles),
        decode_steps=steps, decode_row_steps=row_steps, useful_steps=stats.useful_steps,
        wasted_fraction=1 - stats.useful_steps / row_steps if row_steps else 0.0,
        waste=DecodeWaste(admission=stats.empty_waiting_row_steps,
                          no_prompt=row_steps - stats.occupied_row_steps
                          - stats.empty_waiting_row_steps,
                          stopped=stats.occupied_row_steps - stats.useful_steps),
        kv_cache_bytes=kv_cache_bytes, slots=slots,
        slot_occupancy=stats.occupied_row_steps / (steps * slots) if steps else 0.0,
        prefills=stats.prefills, kv_block_size=kv_block_size, kv_blocks=kv_blocks,
        kv_blocks_mean=stats.kv_block_steps / steps if steps else 0.0,
        kv_blocks_peak=stats.kv_blocks_peak, graphs=list(graphs), mbu=mbu,
        **_prefix_counts(stats.prompt_computed, stats.prompt_reused),
        **_padding(stats.prompt_computed, stats.prefill_tokens),
        prompts_truncated=prompts_truncated, prompts_rejected=prompts_rejected,
        decode_attention=decode_attention, host_bound_steps=stats.host_bound_steps,
        warm_up=warm_up, records_taken_back=records_taken_back)


def _prefix_counts(computed: int, reused: int) -> dict:
    seen = computed + reused
    return dict(prompt_tokens_computed=computed, prompt_tokens_reused=reused,
                prefix_hit_rate=reused / seen if seen else 0.0)


def _padding(computed: int, positions: int) -> dict:
    return dict(prefill_positions=positions,
                prefill_padding=1 - computed / positions if positions else 0.0)


def _total(counts) -> int | None:
    """The sum of the counts given, None where none is (the CPU's)."""
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


def merged_generation(sections: list[Generation | None]) -> Generation | None:
    """A job's generation section from its workers' (--gpus, torchrun; by rank, None where a
    worker has none): counts and seconds added up, tokens/s over the slowest worker's
    generation time (they ran side by side), the TTFT and TPOT percentiles the largest of the
    workers' (a bound: each worker's records are not kept), every worker's graphs with its
    rank."""
    ranked = [(rank, g) for rank, g in enumerate(sections) if g is not None]
    sections = [g for _, g in ranked]
    if not sections:
        return None
    reasons: dict[str, int] = {}
    for g in sections:
        for k, v in g.finish_reasons.items():
            reasons[k] = reasons.get(k, 0) + v
    slowest = max(g.prefill_s + g.decode_s for g in sections)
    output = sum(g.output_tokens for g in sections)
    row_steps = sum(g.decode_row_steps for g in sections)
    useful = sum(g.useful_steps for g in sections)

    def bound(attr: str) -> dict[str, float]:
        keys = {k for g in sections for k in getattr(g, attr)}
        return {k: max(getattr(g, attr).get(k, 0.0) for g in sections) for k in sorted(keys)}

    mbus = [g.mbu for g in sections if g.mbu is not None]
    return Generation(
        records=sum(g.records for g in sections),
        prompt_tokens=sum(g.prompt_tokens for g in sections), output_tokens=output,
        finish_reasons=reasons, output_tokens_per_s=output / slowest if slowest else 0.0,
        prefill_s=sum(g.prefill_s for g in sections), decode_s=sum(g.decode_s for g in sections),
        ttft_ms=bound("ttft_ms"), tpot_ms=bound("tpot_ms"),
        decode_steps=sum(g.decode_steps for g in sections), decode_row_steps=row_steps,
        useful_steps=useful, wasted_fraction=1 - useful / row_steps if row_steps else 0.0,
        waste=(DecodeWaste(**{k: sum(getattr(g.waste, k) for g in sections)
                              for k in DecodeWaste.model_fields})
               if all(g.waste is not None for g in sections) else None),
        kv_cache_bytes=sum(g.kv_cache_bytes for g in sections),
        slots=sum(g.slots for g in sections),
        slot_occupancy=(sum(g.slot_occupancy * g.slots * g.decode_steps for g in sections)
                        / max(1, sum(g.slots * g.decode_steps for g in sections))),
        prefills=sum(g.prefills for g in sections),
        kv_block_size=max(g.kv_block_size for g in sections),
        kv_blocks=sum(g.kv_blocks for g in sections),
        kv_blocks_mean=sum(g.kv_blocks_mean for g in sections),
        kv_blocks_peak=sum(g.kv_blocks_peak for g in sections),
        graphs=[x.model_copy(update={"rank": rank}) for rank, g in ranked for x in g.graphs],
        mbu=sum(mbus) / len(mbus) if mbus else None,
        **_prefix_counts(sum(g.prompt_tokens_computed for g in sections),
                         sum(g.prompt_tokens_reused for g in sections)),
        **_padding(sum(g.prompt_tokens_computed for g in sections),
                   sum(g.prefill_positions for g in sections)),
        prompts_truncated=sum(g.prompts_truncated for g in sections),
        prompts_rejected=sum(g.prompts_rejected for g in sections),
        decode_attention=", ".join(sorted({g.decode_attention for g in sections
                                           if g.decode_attention})) or None,
        host_bound_steps=_total(g.host_bound_steps for g in sections),
        warm_up=max((g.warm_up for g in sections if g.warm_up is not None),
                    key=lambda w: w.wait_s, default=None),
        records_taken_back=sum(g.records_taken_back for g in sections))
