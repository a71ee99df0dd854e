"""graphrun's causal LMs, their KV cache and kernels."""
