"""Where a Hugging Face folder named in a spec is (model.hf.path, data.text.tokenizer): beside
the spec, in an installed package (pkg://PACKAGE/FOLDER), or a hub name. No torch: the spec's
checks use it before torch is imported."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

from graphrun.base.errors import ModelError

PKG = "pkg://"
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")  # config.json


def resolve_path(path: str, base_dir: Path | None, key: str = "model.hf.path") -> str:
    """A local folder for pkg:// and for paths that exist beside the spec; anything else is
    passed on as a hub name, which from_pretrained then looks up in the local cache only."""
    if path.startswith(PKG):
        package, _, sub = path[len(PKG):].partition("/")
        try:
            found = importlib.util.find_spec(package) if package else None
        except (ImportError, ValueError):
            found = None
        if found is None or not found.submodule_search_locations:
            raise ModelError(f"{key} {path!r}: no installed Python package {package!r}; "
                             f"install it (pip install {package.replace('_', '-')}) or give "
                             "the model's folder")
        folder = Path(list(found.submodule_search_locations)[0]) / sub
        if not folder.is_dir():
            raise ModelError(f"{key} {path!r}: package {package!r} has no folder {sub!r} "
                             f"({folder})")
        return str(folder)
    p = Path(path).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p if (base_dir / p).exists() or path.startswith(".") else p
    if p.exists() or p.is_absolute() or path.startswith("."):
        if not p.is_dir():
            holding = ("tokenizer.json (or a tokenizer's other files)"
                       if key.endswith("tokenizer") else "config.json")
            raise ModelError(f"{key} {path!r}: folder not found ({p.resolve()}); give a folder "
                             f"holding {holding} (relative to the spec's folder), a cached "
                             "hub name, or pkg://PACKAGE/FOLDER")
        return str(p.resolve())
    return path  # a hub name: found in the local cache or not at all


def package_form(folder: Path) -> str | None:
    """pkg://PACKAGE/SUB for a folder inside an installed package (under a site-packages or
    dist-packages entry of sys.path, and found there again by resolve_path), else None: a
    spec naming the package stays valid wherever it is installed, a site-packages path not."""
    folder = folder.resolve()
    for entry in map(Path, sys.path):
        if entry.name not in ("site-packages", "dist-packages"):
            continue
        try:
            rest = folder.relative_to(entry.resolve())
        except (ValueError, OSError):
            continue
        if len(rest.parts) < 2:
            continue
        form = PKG + "/".join(rest.parts)
        try:
            if Path(resolve_path(form, None)).resolve() == folder:
                return form
        except ModelError:
            continue
    return None


@functools.lru_cache(maxsize=8)  # read/text asks once per batch of texts
def model_vocab(folder: Path) -> int | None:
    """A Hugging Face folder's vocabulary size (config.json's vocab_size, or its text
    config's), or None."""
    import json

    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    value = config.get("vocab_size")
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get("vocab_size")
    return value if type(value) is int and value > 0 else None


def model_positions(folder: Path) -> tuple[int, str] | None:
    """(positions, the config.json key saying so) of a Hugging Face folder's model, or None."""
    import json

    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in POSITION_KEYS if isinstance(config, dict) else ():
        value = config.get(key)
        if isinstance(value, int) and 0 < value < 1 << 20:
            return value, key
    return None
