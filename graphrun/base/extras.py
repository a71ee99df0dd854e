"""The optional extras (pyproject.toml's [project.optional-dependencies]) and the one way to tell a
user how to install one: graphrun is installed from its clone, not from an index that knows its
name, so the hint gives the clone's command and the packages themselves."""

from __future__ import annotations

import re
from functools import cache
from importlib import metadata


@cache
def extras() -> dict[str, tuple[str, ...]]:
    """Each extra's requirements, as the installed graphrun's metadata lists them (pyproject's
    lists); empty when graphrun runs from a clone it was never installed from."""
    try:
        requires = metadata.requires("graphrun") or []
    except metadata.PackageNotFoundError:
        requires = []
    found: dict[str, tuple[str, ...]] = {}
    for line in requires:
        requirement, _, marker = line.partition(";")
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if extra:
            found[extra[1]] = found.get(extra[1], ()) + (requirement.strip(),)
    return found


def install_hint(extra: str) -> str:
    """`pip install -e ".[hf]"` in the clone, and the extra's packages by name (quoted where the
    shell would read their brackets)."""
    names = [re.split(r"[<>=!~ ;]", req, maxsplit=1)[0] for req in extras().get(extra, ())]
    packages = " ".join(f'"{n}"' if "[" in n else n for n in names)
    return (f'pip install -e ".[{extra}]" in the graphrun clone'
            + (f" (or: pip install {packages})" if packages else ""))
