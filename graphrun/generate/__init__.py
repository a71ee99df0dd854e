"""Generation: prompts (token ids) in, completions out, on graphrun's paged KV cache, through a
continuous-batching engine whose decode step is captured once per row count.

The models themselves live in models/causal (graphrun's Llama and GPT-2, transformers' causal LMs
on the paged cache, the cache and its kernels). config.py: what is asked and returned;
sampling.py: the pick inside the step; steps.py: prefill and decode over static slot buffers;
graphs.py: the graph table per step size (over engine/graphs.py) and its verification;
engine.py: the slots and the scheduler; stats.py: running sums for the manifest; scheduler.py:
the scheduler's thread, generation's place in the feed; runner.py: the job's runner.
"""

from graphrun.models.causal.llama import Llama, build_llama
from graphrun.generate.config import Completion, GenerateConfig, GenerationError, Sampling
from graphrun.generate.engine import Engine, Request, build_engine
from graphrun.models.causal.hf_attention import eos_ids_of

__all__ = ["Completion", "Engine", "GenerateConfig", "GenerationError", "Llama", "Request",
           "Sampling", "build_engine", "build_llama", "eos_ids_of"]
