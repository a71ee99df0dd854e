"""A model's size checked before it is built: a config.json's layer count against the layers its
weights hold, and the parameters' bytes against the memory the device has free.

A config that asks for more layers than its weights hold would have graphrun build every one of
them (on the meta device, for the weight-name check) before refusing, and a builtin's arguments
can ask for more memory than the machine has: each is refused here first, with what was asked
and what there is.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

from graphrun.base.errors import ModelError

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
# a stack's layer index in a tensor's name: model.layers.3., transformer.h.3., encoder.layer.3.
LAYER = re.compile(r"^(?P<stack>(?:.*?\.)?(?:layers|layer|h|blocks))\.(?P<index>\d+)\.")


def saved_layers(names: Iterable[str]) -> tuple[str, list[int]] | None:
    """(the stack's name, its layer indices) where the weights hold exactly one stack of
    numbered layers; None where they hold none, or several (an encoder and a decoder, a vision
    tower beside a text stack: their counts are not one config key's)."""
    stacks: dict[str, set[int]] = {}
    for name in names:
        m = LAYER.match(name)
        if m:
            stacks.setdefault(m["stack"], set()).add(int(m["index"]))
    if len(stacks) != 1:
        return None
    (stack, indices), = stacks.items()
    return stack, sorted(indices)


def check_layers(where: str, config: Mapping, names: Iterable[str]) -> None:
    """config.json's layer count against the saved weights' one stack of layers, before any
    module is built: one error naming both where they differ."""
    key = next((k for k in LAYER_KEYS if k in config), None)
    found = saved_layers(names)
    if key is None or found is None:
        return
    asked, (stack, indices) = config[key], found
    if type(asked) is not int or asked < 1:
        return  # not a size at all: checkpoint.whole says so where the config is read
    if asked == len(indices) and indices[-1] == len(indices) - 1:
        return
    held = (f"{len(indices)} layers ({stack}.{indices[0]} to {stack}.{indices[-1]})"
            if len(indices) > 1 else f"1 layer ({stack}.{indices[0]})")
    raise ModelError(f"{where}: config.json's {key} is {asked!r}, and the saved weights hold "
                     f"{held}; make config.json describe the saved weights (its {key}: "
                     f"{len(indices)} where they are the model's), nothing was built")


def available_bytes(device) -> int:
    """Memory free for new tensors on `device`: the GPU's free memory, or the host's
    MemAvailable (what can be allocated without swapping)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "meta":
        return math.inf
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def tensor_bytes(shapes: Iterable[tuple[int, ...]], element_size: int) -> int:
    return sum(math.prod(shape) for shape in shapes) * element_size


def check_fits(what: str, nbytes: int, dtype, device, remedy: str) -> None:
    """One error, before any allocation, where the parameters (nbytes in dtype) would not fit
    in the memory the device has free."""
    free = available_bytes(device)
    if nbytes > free:
        raise ModelError(f"{what}: its parameters take {_size(nbytes)} in "
                         f"{str(dtype).removeprefix('torch.')}, more than the {_size(free)} "
                         f"free on {device}; {remedy}")


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << scale:
            return f"{nbytes / (1 << scale):.1f} {unit}"
    return f"{nbytes} bytes"
