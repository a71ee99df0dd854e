"""What a generation job counts as it runs, in running sums and fixed-size sketches: memory stays
flat however many records the job has (the manifest's generation section is made from these)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# a log-spaced histogram: bins of 1% width from 1 us to about 3 hours
_LOW, _RATIO, _BINS = 1e-6, 1.01, 2400


class Sketch:
    """Percentiles of seconds within 1%, from a fixed array of counts."""

    def __init__(self):
        self.counts = np.zeros(_BINS, dtype=np.int64)

    def add(self, seconds: float) -> None:
        at = 0 if seconds <= _LOW else int(math.log(seconds / _LOW) / math.log(_RATIO)) + 1
        self.counts[min(at, _BINS - 1)] += 1

    def percentiles(self, ps) -> dict[str, float]:
        """p -> milliseconds (the bin's middle), as {"p50": ...}; {} when empty."""
        total = int(self.counts.sum())
        if not total:
            return {}
        cum = np.cumsum(self.counts)
        out = {}
        for p in ps:
            at = int(np.searchsorted(cum, max(1, math.ceil(p / 100 * total))))
            seconds = 0.0 if at == 0 else _LOW * _RATIO ** (at - 0.5)
            out[f"p{p:g}"] = seconds * 1e3
        return out


@dataclass
class GenerationStats:
    """Running sums of one engine's work."""

    records: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reasons: dict = field(default_factory=dict)
    prefill_s: float = 0.0  # device time (CUDA events on a GPU, the host clock on the CPU)
    decode_s: float = 0.0
    prefills: int = 0
    prefill_tokens: int = 0  # tokens of the packed prefills, padding included
    reading_prefills: int = 0  # prefills that read cached blocks (run eagerly)
    prompt_computed: int = 0  # prompt tokens prefilled
    prompt_reused: int = 0  # prompt tokens whose keys came from the prefix cache
    decode_steps: int = 0
    decode_row_steps: int = 0  # per decode step, the rows of its graph
    useful_steps: int = 0  # per record, its output tokens less the one prefill made
    occupied_row_steps: int = 0  # per decode step, the slots holding a record
    empty_waiting_row_steps: int = 0  # per decode step, its empty rows while prompts waited
    kv_block_steps: int = 0  # per decode step, the blocks held
    kv_blocks_peak: int = 0
    kv_token_steps: int = 0  # per decode step, the keys its rows attended (for the MBU)
    moved_rows: int = 0  # rows moved to lower slots in the job's tail (Engine._compact)
    copied_blocks: int = 0  # partial last prompt blocks copied to a prompt's other samples
    host_bound_steps: int | None = None
    ttft: Sketch = field(default_factory=Sketch)
    tpot: Sketch = field(default_factory=Sketch)

    def finished(self, prompt_tokens: int, output_tokens: int, reason: str) -> None:
        self.records += 1
        self.prompt_tokens += prompt_tokens
        self.output_tokens += output_tokens
        self.useful_steps += output_tokens - 1
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def stepped(self, rows: int, occupied: int, blocks: int, keys: int,
                waiting: bool = False) -> None:
        """waiting: prompts waited to be admitted (they wait for free slots to gather)."""
        self.decode_steps += 1
        self.decode_row_steps += rows
        self.occupied_row_steps += occupied
        if waiting:
            self.empty_waiting_row_steps += rows - occupied
        self.kv_block_steps += blocks
        self.kv_blocks_peak = max(self.kv_blocks_peak, blocks)
        self.kv_token_steps += keys
