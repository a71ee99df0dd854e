"""The model step: build or load the spec's model, load its weights, put it on the device.

How the model is called with the static inputs and how its return is named: models/call.py.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from graphrun.base.dtypes import torch_dtype
from graphrun.base.errors import ModelError
from graphrun.models.builtins import BUILTINS, of_job
from graphrun.models.call import describe
from graphrun.models.heads import Heads, needs_heads
from graphrun.models.hf import load_hf
from graphrun.models.vision import load_timm
from graphrun.models.weights import compare, held, weights_error
from graphrun.base.phases import LIBRARY_IMPORTS, phase
from graphrun.spec.keys import BATCH, PipelineSpec


def build_model(spec: PipelineSpec, device: torch.device,
                base_dir: Path | None = None) -> nn.Module:
    """The spec's model with its weights, on `device` in the spec's dtype, eval, no grad.

    A builtin is made on `device` in model.dtype by its seeded init (builtin/seeded.py: the
    same values on every device), or, with model.weights, on the meta device. With weights, a
    target's or timm model's parameters are made on the meta device too, so neither memory nor
    random init is spent on values the weights replace; the weights are read onto `device`
    and become the parameters. Without weights a target is built as its user's code builds
    it, on the CPU, then moved: under a CUDA device its random init would draw from the CUDA
    generator (a seeded builder would give other values than in the user's own process).
    base_dir is the spec's folder: `target` modules and relative .py paths are found there.
    """
    m = spec.model
    # parameters on meta where the weights give every value; a tensor they may lack keeps the
    # builder's
    empty = m.weights is not None and not m.allow_missing
    if m.builtin is not None:
        model = _build_builtin(m.builtin, m.args, spec.max_size(BATCH),
                               torch.device("meta") if empty else device,
                               torch_dtype(m.dtype))
    elif m.target is not None:
        model = _build(f"model.target {m.target!r}", _resolve_target(m.target, base_dir),
                       m.args, spec.max_size(BATCH), wrap=(Exception,), empty=empty)
    elif m.exported is not None:
        model = _load_exported(m.exported, device)
    elif m.hf is not None:
        model = load_hf(m.hf, base_dir, torch_dtype(m.dtype), m.allow_missing, spec.outputs)
    elif m.timm is not None:
        with params_on_meta(empty):
            model = load_timm(m.timm)
    else:
        assert m.torchscript is not None, "the spec checker ensures one model source"
        model = _load_torchscript(m.torchscript, device)
    if m.weights is not None:
        with phase("weights load"):
            _load_weights(model, m.weights, device, m.allow_missing)
    with phase("to device"):
        if m.hf is not None:
            model = _to_keeping_scratch(model, device, torch_dtype(m.dtype))
        else:
            model = model.to(device=device, dtype=torch_dtype(m.dtype))
    # An exported program's train/eval mode is fixed at export; .eval() raises on it.
    if m.exported is None:
        model.eval()
    for param in model.parameters():  # a ScriptModule has no requires_grad_()
        param.requires_grad_(False)
    if needs_heads(spec):  # outputs picked and reduced inside the captured step
        model = Heads(model, spec.outputs, list(spec.inputs), m.call)
    return model


def _to_keeping_scratch(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """model.to(device), parameters and persistent buffers cast to dtype; non-persistent
    buffers keep theirs: transformers keeps scratch in float32 (RoPE's inv_freq), which a cast
    to 16 bits would round, moving every position's angle (from_pretrained leaves it so)."""
    model = model.to(device=device)
    scratch = {id(b) for mod in model.modules() for name, b in mod._buffers.items()
               if b is not None and name in mod._non_persistent_buffers_set}
    made: dict[int, torch.Tensor] = {}  # a tied weight stays one tensor
    for mod in model.modules():
        for name, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            if t is None or not t.is_floating_point() or t.dtype == dtype or id(t) in scratch:
                continue
            if id(t) not in made:
                made[id(t)] = (nn.Parameter(t.to(dtype), t.requires_grad)
                               if name in mod._parameters else t.to(dtype))
            (mod._parameters if name in mod._parameters else mod._buffers)[name] = made[id(t)]
    return model


def import_library(spec: PipelineSpec, code: str | None) -> None:
    """The model library's import (transformers, timm) alone, before the build: CPU work the
    device's start runs beside (device_start.py). code: models/hf.model_code's name for the
    spec (transformers' is imported only where it runs). One that fails is reported by the
    build, with what to install."""
    name = "transformers" if code == "transformers" else "timm" if spec.model.timm else None
    if name is not None:
        with phase(LIBRARY_IMPORTS.format(name)):
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001, S110 - load_hf / load_timm explain it
                pass


def model_input_dtypes(spec: PipelineSpec) -> dict[str, torch.dtype]:
    """The dtype the model is called with, and its static input buffer holds, per input: a
    floating input (float32 in the file, say) in model.dtype, so that float16 or bfloat16
    weights meet inputs of their own dtype; integer and bool inputs as the spec says."""
    from graphrun.spec.keys import FLOAT_DTYPES

    return {n: torch_dtype(spec.model.dtype) if i.dtype in FLOAT_DTYPES else torch_dtype(i.dtype)
            for n, i in spec.inputs.items()}


# Building from a builder (builtin or target).

def _build_builtin(name: str, args: dict[str, Any], max_batch: int, device: torch.device,
                   dtype: torch.dtype) -> nn.Module:
    """The builtin made on `device` in `dtype` (on meta: without values, weights follow)."""
    if name not in BUILTINS or BUILTINS[name].job != "forward":
        raise ModelError(f"model.builtin: unknown builtin {name!r} for one forward pass per "
                         f"record; choose one of: {', '.join(of_job('forward'))}")
    for key, instead in (("device", "the spec's device"), ("dtype", "model.dtype")):
        if key in args:
            raise ModelError(f"model.args.{key}: graphrun sets a builtin's {key}; "
                             f"remove it and set {instead}")
    return _build(f"builtin {name!r}", BUILTINS[name].builder_function(), args, max_batch,
                  wrap=(TypeError, ValueError, RuntimeError),
                  placed={"device": device, "dtype": dtype})


def _build(what: str, builder: Callable[..., Any], args: dict[str, Any], max_batch: int,
           wrap: tuple[type[Exception], ...], empty: bool = False,
           placed: dict[str, Any] | None = None) -> nn.Module:
    """builder(**args), plus max_batch (the largest batch bucket) when the builder takes it.
    empty: parameters on the meta device (weights follow); a builder that cannot build so (it
    reads a parameter's values, say) is built again as usual. placed: arguments graphrun sets
    (a builtin's device and dtype), so left out of the messages about model.args."""
    params = inspect.signature(builder).parameters
    args = dict(args)
    if "max_batch" in params:
        args.setdefault("max_batch", max_batch)
    placed = placed or {}
    _check_args(what, builder, args, hidden=frozenset(placed))
    if empty:
        try:
            with params_on_meta():
                model = builder(**args)
            if isinstance(model, nn.Module):
                return model
        except Exception:  # noqa: BLE001 - built again below, where its error is reported
            pass
    try:
        model = builder(**args, **placed)
    except ModelError:
        raise
    except wrap as e:
        raise ModelError(f"{what} could not be built from model.args {args}: "
                         f"{type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ModelError(f"{what} returned {describe(model)}, not a torch.nn.Module; "
                         "make it return the module")
    return model


def _check_args(what: str, builder: Callable[..., Any], args: dict[str, Any],
                hidden: frozenset[str] = frozenset()) -> None:
    sig = inspect.signature(builder)
    try:
        sig.bind(**args)
    except TypeError as e:
        accepted = [n for n, p in sig.parameters.items() if n not in hidden
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = [a for a in args if a not in sig.parameters]
        problem = f"unknown argument {unknown[0]!r}" if unknown else str(e)
        raise ModelError(f"model.args: {what}: {problem}; it accepts: "
                         f"{', '.join(accepted) or 'no arguments'}") from None


@contextmanager
def params_on_meta(enabled: bool = True) -> Iterator[None]:
    """Parameters registered meanwhile are put on the meta device, where an init does nothing;
    buffers are made as usual (non-persistent ones are in no weights file)."""
    if not enabled:
        yield
        return
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        if type(param) is nn.Parameter and not param.is_meta:  # not lazy or subclassed ones
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


# Finding a target: "package.module:callable" or "path/to/file.py:callable".

def _resolve_target(target: str, base_dir: Path | None) -> Callable[..., Any]:
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise ModelError(f"model.target {target!r}: expected 'package.module:callable' or "
                         "'path/to/file.py:callable'")
    if module_part.endswith(".py"):
        module = _import_file(target, _resolve_path(Path(module_part), base_dir))
    else:
        module = _import_module(target, module_part, base_dir)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(n for n, v in vars(module).items()
                             if callable(v) and not n.startswith("_"))
            # a file target is imported under an internal name: show the user's file instead
            owner = module.__file__ if module_part.endswith(".py") else module.__name__
            near = difflib.get_close_matches(attr, defined, n=1)
            raise ModelError(f"model.target {target!r}: {owner} has no attribute {attr!r}"
                             + (f"; did you mean {near[0]!r}?" if near else "")
                             + f" Callables it defines: {', '.join(defined) or 'none'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelError(f"model.target {target!r}: {attr} is {describe(obj)}, not a callable")
    return obj


def _import_module(target: str, name: str, base_dir: Path | None) -> Any:
    try:
        with _on_sys_path(base_dir):
            return importlib.import_module(name)
    except ModuleNotFoundError as e:
        where = f"beside the spec ({base_dir})" if base_dir else "on the Python path"
        raise ModelError(f"model.target {target!r}: cannot import {name!r} ({e}); put the "
                         f"module {where}, install its package, or give a file path such as "
                         "'models/net.py:build'") from e
    except Exception as e:
        raise ModelError(f"model.target {target!r}: importing {name!r} failed: "
                         f"{type(e).__name__}: {e}") from e


def _import_file(target: str, path: Path) -> Any:
    """Import a .py file under a name unique to its path; its folder is importable meanwhile."""
    if not path.is_file():
        raise ModelError(f"model.target {target!r}: file not found: {path}")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"graphrun_target_{path.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # so dataclasses, pickling and the like can find it
    try:
        with _on_sys_path(path.parent):
            module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ModelError(f"model.target {target!r}: importing {path} failed: "
                         f"{type(e).__name__}: {e}") from e
    return module


@contextmanager
def _on_sys_path(folder: Path | None) -> Iterator[None]:
    """folder first on sys.path during the import only."""
    if folder is None:
        yield
        return
    entry = str(folder)
    sys.path.insert(0, entry)
    # the folder's files may be newer than its finder's cache. Only that finder: the global
    # importlib.invalidate_caches() walks sys.path_importer_cache, which another thread's import
    # can change meanwhile ("dictionary changed size during iteration")
    finder = sys.path_importer_cache.get(entry)
    if finder is not None and hasattr(finder, "invalidate_caches"):
        finder.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(entry)


def _resolve_path(path: Path, base_dir: Path | None) -> Path:
    if path.is_absolute() or base_dir is None:
        return path.resolve()
    return (base_dir / path).resolve()


# Loading archives and weights.

def _load_exported(path: Path, device: torch.device) -> nn.Module:
    _require_file("model.exported", path)
    try:
        program = torch.export.load(str(path))
    except Exception as e:
        raise ModelError(f"model.exported {path}: not a loadable torch.export archive "
                         f"({type(e).__name__}: {e}); write it with torch.export.save") from e
    try:
        from torch.export.passes import move_to_device_pass
    except ImportError:  # torch < 2.6: build_model's .to(device) moves parameters and buffers
        return program.module()
    # Also moves constants baked into the graph, which module.to(device) alone would miss.
    return move_to_device_pass(program, device).module()


def _load_torchscript(path: Path, device: torch.device) -> nn.Module:
    _require_file("model.torchscript", path)
    try:
        return torch.jit.load(str(path), map_location=device)
    except Exception as e:
        raise ModelError(f"model.torchscript {path}: not a loadable TorchScript file "
                         f"({type(e).__name__}: {e}); write it with torch.jit.save") from e


def _load_weights(model: nn.Module, path: Path, device: torch.device,
                  allow_missing: list[str]) -> None:
    """Load a full state dict: every tensor the model has (but those allow_missing names, which
    keep the builder's values), no other, each of the model's shape and kind of dtype
    (models/weights.py). The file's tensors are read onto `device` and become the model's
    (assign: no copy into parameters that may be on the meta device); build_model then casts
    them to model.dtype."""
    state = _read_state_dict(path, device)
    differ = compare(held(model.state_dict()), held(state), allow_missing)
    if differ:
        raise weights_error(f"model.weights {path}", differ, "save model.state_dict() of the "
                            "same model and model.args")
    try:
        model.load_state_dict(state, strict=not allow_missing, assign=True)
    except RuntimeError as e:
        raise ModelError(f"model.weights {path}: {e}") from e
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a parameter kept out of the state dict: the weights cannot give its values
        raise ModelError(f"model.weights {path}: the model's {', '.join(left[:5])} are not "
                         "in its state dict, so no weights file can set them; register them "
                         "as buffers or parameters that state_dict() returns")


def _read_state_dict(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    _require_file("model.weights", path)
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ModelError(f"model.weights {path}: reading .safetensors needs the safetensors "
                             "package: `pip install safetensors`, or convert the weights to a "
                             ".pt state dict") from None
        try:
            return load_file(str(path), device=str(device))
        except Exception as e:  # noqa: BLE001 - SafetensorError, by safetensors' version
            raise ModelError(f"model.weights {path}: cannot read it as a .safetensors file "
                             f"({type(e).__name__}: {e}); save model.state_dict() with "
                             "safetensors.torch.save_file, or give a .pt file") from e
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise ModelError(f"model.weights {path}: cannot read it as a .pt state dict with "
                         f"weights_only=True ({type(e).__name__}: {e}); save "
                         "model.state_dict() with torch.save") from e
    if not isinstance(state, Mapping):
        raise ModelError(f"model.weights {path}: holds {describe(state)}, not a state dict; "
                         "save model.state_dict() with torch.save")
    not_tensors = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise ModelError(f"model.weights {path}: entries {not_tensors[:5]} are not tensors "
                         "(a training checkpoint?); save model.state_dict() itself")
    return dict(state)


def _require_file(key: str, path: Path) -> None:
    if not path.is_file():
        raise ModelError(f"{key}: file not found: {path}")


def compile_model(model: torch.nn.Module, n_shapes: int) -> torch.nn.Module:
    """torch.compile with its own CUDA graphs off (graphrun captures them), one static graph per
    shape."""
    allow_recompiles(n_shapes + 8)
    return torch.compile(model, dynamic=False, options={"triton.cudagraphs": False})


def allow_recompiles(count: int) -> None:
    """Let dynamo compile a function `count` times before it gives up on new shapes."""
    import torch._dynamo.config as dynamo_config

    for knob in ("recompile_limit", "cache_size_limit"):  # renamed across torch versions
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, max(getattr(dynamo_config, knob), count))
