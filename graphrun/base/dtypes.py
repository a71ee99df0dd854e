"""The one dtype table: every dtype a spec may name, its bytes per value, and the numpy type a
host array holds it in. torch's type is looked up by name, so this module imports no torch."""

from __future__ import annotations

FLOAT = ("float32", "float16", "bfloat16", "float64")
INT = ("int64", "int32", "int16", "int8", "uint8")
ALL = FLOAT + INT + ("bool",)

ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
            "int16": 2, "int8": 1, "uint8": 1, "bool": 1}

# numpy has no bfloat16: such values are held on the host as float32, cast on the copy
HOST = {name: ("float32" if name == "bfloat16" else name) for name in ALL}


def host_numpy(name: str):
    """The numpy dtype a host array of `name` values is read into."""
    import numpy as np

    return np.dtype(HOST[name])


def torch_dtype(name: str):
    """torch's dtype for a spec's dtype name (torch.float32 for "float32")."""
    import torch

    if name not in ITEMSIZE:
        raise KeyError(f"{name!r} is not one of graphrun's dtypes: {', '.join(ALL)}")
    return getattr(torch, name)
