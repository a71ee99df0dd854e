"""Model bandwidth utilisation of decode (the manifest's generation.mbu, generate/runner.py): the
bytes the decode steps had to read from device memory (the weights once a step, and the keys each
row attends over) / the decode time / the device's peak memory bandwidth. Decode of a
small batch is bound by that bandwidth, so this says how near the bound the steps ran.
"""

from __future__ import annotations

# peak memory bandwidth, bytes/s, by a part of the name torch gives the device; first match
# wins, so the more specific names come first
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 80GB HBM3", 3.35e12),  # the SXM part (the PCIe one is "H100 PCIe")
    ("H100 SXM", 3.35e12),
    ("A100-SXM4-80GB", 2.0e12),
    ("A100 80GB", 2.0e12),
)


def peak_bandwidth(device_name: str) -> float | None:
    """Bytes/s for a known GPU name (torch.cuda.get_device_name), else None."""
    for part, peak in PEAK_BANDWIDTH:
        if part in device_name:
            return peak
    return None


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, element_bytes: int) -> int:
    """One token's keys and values, all layers."""
    return 2 * layers * kv_heads * head_dim * element_bytes


def weight_bytes_per_step(model) -> int:
    """The parameter bytes one decode step reads: every parameter once (a tied head and its
    embedding are one tensor), less the embedding tables no matrix multiply uses, of which a
    step reads only its rows' entries."""
    from torch import nn

    multiplied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(t.numel() * t.element_size() for t in model.parameters()
               if id(t) not in looked_up - multiplied)
