"""Generation: prompts (token ids) in, completions out, on graphrun's own KV cache, with the
prefill and decode steps captured per bucket and replayed for every token of every batch.

config.py: what is asked and returned; kv_cache.py: the cache and the attention on it;
hf_attention.py: transformers models on that cache; builtin.py: the `llama` builtin;
sampling.py: the pick inside the step; steps.py: prefill and decode over static buffers;
graphs.py: capture and verification per bucket; generator.py: the batch loop.
"""

from graphrun.generate.llama import Llama, build_llama
from graphrun.generate.config import (BatchResult, Completion, GenerateConfig, GenerationError, Sampling)
from graphrun.generate.generator import Generator, build_generator
from graphrun.generate.hf_attention import eos_ids_of

__all__ = ["BatchResult", "Completion", "GenerateConfig", "GenerationError", "Generator",
           "Llama", "Sampling", "build_generator", "build_llama", "eos_ids_of"]
