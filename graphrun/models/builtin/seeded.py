"""Seeded initialisation computed on the target device: the same seed gives the same values,
bit for bit, on the CPU and on any GPU, without drawing from a device's generator.

A builtin is built on the meta device (shapes only) and `materialise` makes each parameter and
persistent buffer on the target device in the target dtype. Element i of a tensor is splitmix64's
i-th output for that tensor's own stream (derived from the seed and the tensor's qualified name),
in int64 torch ops; its top 24 bits, read as a signed integer, are exact in float32, then scaled
in float32 and cast to the dtype. Every step is exact or correctly rounded: no device can differ.

The distribution of each tensor comes from a rule: the module's own `seeded_init(name)` when it
has one, else the rules table by the module's type. A tensor with no rule raises NoInitRule.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from graphrun.models.sizes import check_fits, tensor_bytes


@dataclass(frozen=True)
class Uniform:
    """Values uniform in [-bound, bound)."""
    bound: float


@dataclass(frozen=True)
class Constant:
    value: float


Init = Uniform | Constant
# (module, local name of the parameter or buffer) -> its distribution
Rule = Callable[[nn.Module, str], Init]


class NoInitRule(LookupError):
    """A builtin registered a tensor that no rule describes: a defect of the builtin."""


def std(s: float) -> Uniform:
    """The uniform distribution of standard deviation s."""
    return Uniform(s * math.sqrt(3.0))


def _fan_in_uniform(module: nn.Module, name: str) -> Init:
    # PyTorch's Linear/Conv defaults: weight and bias uniform(+-1/sqrt(fan_in))
    fan_in = module.weight[0].numel()  # in_features, or in_channels/groups * kernel size
    return Uniform(1.0 / math.sqrt(fan_in))


def _norm_affine(module: nn.Module, name: str) -> Init:
    return Constant(1.0 if name == "weight" else 0.0)


def _unit_normal_scale(module: nn.Module, name: str) -> Init:
    return std(1.0)  # PyTorch's Embedding default: unit variance


NORMS = tuple(t for t in (nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", None)) if t)
# PyTorch defaults' scale, by module type (a subclass takes its base's rule)
DEFAULT_RULES: dict[type[nn.Module], Rule] = {
    nn.Linear: _fan_in_uniform, nn.Conv1d: _fan_in_uniform, nn.Conv2d: _fan_in_uniform,
    nn.Conv3d: _fan_in_uniform, nn.Embedding: _unit_normal_scale,
    **{norm: _norm_affine for norm in NORMS},
}

# splitmix64's constants as int64: the ones above 2**63 by their negative equivalents
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
# Elements computed at once. On the CPU under torch's parallel grain size (32768): each op runs
# on the calling thread, as a thread-pool hand-off per op costs more than the op when the cores
# are busy. A GPU wants large ones.
CPU_CHUNK = 2**15 - 2**10
DEVICE_CHUNK = 2**24


# In-place initialisers a module's constructor may call (nn.init's and the tensor methods they
# reach): on the meta device they would draw nothing, and a meta normal_ imports torch._dynamo.
_INITIALISERS = frozenset(
    [getattr(nn.init, n) for n in ("uniform_", "normal_", "constant_", "ones_", "zeros_",
                                   "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                                   "xavier_normal_", "trunc_normal_", "orthogonal_", "eye_")]
    + [getattr(torch.Tensor, n) for n in ("uniform_", "normal_", "fill_", "zero_", "random_")])


class _SkipInitialisers(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.is_meta:
                return tensor  # left as it is: no values to draw
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """Modules made meanwhile have their parameters and buffers on the meta device (shapes
    and dtypes only), and their own initialisers are skipped: materialise gives the values."""
    with torch.device("meta"), _SkipInitialisers():
        yield


def stream(seed: int, name: str) -> int:
    """The start state (an int64) of the stream of the tensor `name` under `seed`."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _mix(z: torch.Tensor, scratch: torch.Tensor, state: int, start: int) -> torch.Tensor:
    """z (int64, n elements) becomes splitmix64's outputs start..start+n-1 (0-based) for the
    stream `state`, but for the last xor-shift; in place, scratch the same size. int64 adds and
    multiplies wrap as uint64's do, and torch's >> on int64 is arithmetic: masked to be logical."""
    torch.arange(start + 1, start + 1 + z.numel(), out=z)
    z.mul_(_GOLDEN).add_(state)  # the state after i+1 steps
    for shift, factor in ((30, _MIX1), (27, _MIX2)):
        torch.bitwise_right_shift(z, shift, out=scratch)
        z.bitwise_xor_(scratch.bitwise_and_((1 << (64 - shift)) - 1)).mul_(factor)
    return z


def splitmix64(state: int, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """Outputs start..stop-1 (0-based) of splitmix64 seeded with `state`, as int64 bit patterns."""
    z = torch.empty(stop - start, dtype=torch.int64, device=device)
    scratch = torch.empty_like(z)
    _mix(z, scratch, state, start)
    torch.bitwise_right_shift(z, 31, out=scratch)
    return z.bitwise_xor_(scratch.bitwise_and_((1 << 33) - 1))


def uniform_values(state: int, numel: int, bound: float, device: torch.device,
                   dtype: torch.dtype, chunk: int | None = None) -> torch.Tensor:
    """numel values uniform in [-bound, bound), flat, on `device` in `dtype` (rounded to it,
    so a lower dtype may reach the bound); computed `chunk` elements at a time (None: CPU_CHUNK
    on the CPU, DEVICE_CHUNK on a GPU), which changes no value."""
    # the scale as a float32, so a kernel computing in float32 or float64 rounds alike
    scale = float(torch.tensor(bound * 2.0**-23, dtype=torch.float32))
    out = torch.empty(numel, dtype=dtype, device=device)
    chunk = min(numel, chunk or (CPU_CHUNK if device.type == "cpu" else DEVICE_CHUNK))
    z, scratch = (torch.empty(chunk, dtype=torch.int64, device=device) for _ in range(2))
    as_float = torch.empty(chunk, dtype=torch.float32, device=device)
    for start in range(0, numel, chunk):
        n = min(chunk, numel - start)
        mixed = _mix(z[:n], scratch[:n], state, start)
        # The top 24 bits (which splitmix64's last xor-shift, by 31, leaves as they are) as a
        # signed integer in [-2**23, 2**23): exact in float32, then scaled, then rounded to dtype.
        value = as_float[:n].copy_(mixed.bitwise_right_shift_(40)).mul_(scale)
        out[start:start + n] = value
    return out


def draw(init: Init, state: int, shape: torch.Size, device: torch.device,
         dtype: torch.dtype) -> torch.Tensor:
    if isinstance(init, Constant):
        return torch.full(shape, init.value, dtype=dtype, device=device)
    return uniform_values(state, math.prod(shape), init.bound, device, dtype).view(shape)


def rule_for(module: nn.Module, name: str, qualified: str,
             rules: Mapping[type[nn.Module], Rule]) -> Init:
    own = getattr(module, "seeded_init", None)
    init = own(name) if own is not None else None
    if init is not None:
        return init
    for kind in type(module).__mro__:
        if kind in rules:
            return rules[kind](module, name)
    raise NoInitRule(f"no seeded init rule for {qualified!r} ({type(module).__name__}.{name}):"
                     f" give {type(module).__name__} a seeded_init(name) method, or a rule for "
                     "its type in the rules passed to materialise")


def materialise(model: nn.Module, seed: int, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None,
                rules: Mapping[type[nn.Module], Rule] = DEFAULT_RULES) -> nn.Module:
    """Make every parameter and persistent buffer of `model` (built on the meta device) on
    `device` (default cpu) with seeded values: floating ones in `dtype` (default float32).
    Non-persistent buffers are scratch, left to the model. On the meta device nothing is made:
    the caller fills the tensors (from weights, say)."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "meta":
        return model
    dtype = dtype or torch.float32
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}  # tied: once
    check_fits(type(model).__name__, tensor_bytes(
        (tuple(t.shape) for t in tensors.values()), dtype.itemsize),
        dtype, device, "give it smaller sizes (model.args)")
    made: dict[int, torch.Tensor] = {}  # a tensor registered under two names is drawn once
    for qualified, tensor in model.state_dict(keep_vars=True).items():  # persistent only
        prefix, _, name = qualified.rpartition(".")
        module = model.get_submodule(prefix)
        if id(tensor) not in made:
            if not tensor.is_floating_point():
                raise NoInitRule(f"{qualified!r} is {tensor.dtype}: seeded init draws floats "
                                 "only; make it a non-persistent buffer the model fills")
            init = rule_for(module, name, qualified, rules)
            values = draw(init, stream(seed, qualified), tensor.shape, device, dtype)
            if isinstance(tensor, nn.Parameter):
                values = nn.Parameter(values, tensor.requires_grad)
            made[id(tensor)] = values
        setattr(module, name, made[id(tensor)])
    return model
