"""YAML -> validated PipelineSpec, with every error located at its file:line:col.

PyYAML keeps no positions in the objects it builds, so the file is composed into nodes and turned
into plain Python values here, remembering where every key and value stood. Pydantic's error
locations (and rules.py's key paths) are then mapped back to those positions. A `--set`
override replaces the node at its path, and errors under that path name the override instead.
"""

from __future__ import annotations

import difflib
from os import PathLike
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from graphrun.base.errors import Problem, SpecError
from graphrun.spec.keys import PipelineSpec

Loc = tuple  # key path: ("buckets", "batch", 2)


def fmt_path(loc: Loc) -> str:
    """("buckets", "batch", 2) -> "buckets.batch[2]"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class Positions:
    """Where each key path came from: a file position, or the --set override that replaced it."""

    def __init__(self, source: str):
        self.source = source
        self.value_at: dict[Loc, tuple[int, int]] = {}  # 1-based (line, col) of the value
        self.key_at: dict[Loc, tuple[int, int]] = {}  # of the key naming it
        self.overrides: dict[Loc, str] = {}  # path -> "--set a.b=c"

    def where(self, loc: Loc, *, key: bool = False) -> str:
        for n in range(len(loc), 0, -1):  # the override that replaced this path or a parent
            if loc[:n] in self.overrides:
                return self.overrides[loc[:n]]
        for n in range(len(loc), -1, -1):  # the nearest located node at or above the path
            table = self.key_at if key and n == len(loc) else self.value_at
            if loc[:n] in table:
                line, col = table[loc[:n]]
                return f"{self.source}:{line}:{col}"
        return self.source


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader whose scalar construction we reuse; duplicates are found while walking nodes."""


# An alias repeats its anchor's whole subtree: nine anchors of nine aliases each expand to
# 9**9 nodes from a few lines of text. A spec is a few hundred nodes; these caps leave room.
MAX_NODES = 100_000
MAX_DEPTH = 64


class _Walk:
    """The expansion so far: nodes made and the nodes on the path (an alias to one of them
    is a cycle, `&r [*r]`)."""

    def __init__(self, source: str):
        self.source, self.nodes, self.path = source, 0, []

    def enter(self, node: yaml.Node, loc: Loc) -> None:
        self.nodes += 1
        why = None
        if any(n is node for n in self.path):
            why = "an alias refers to a node that contains it (a cycle, like `&r [*r]`)"
        elif len(self.path) >= MAX_DEPTH:
            why = f"nested deeper than {MAX_DEPTH} levels"
        elif self.nodes > MAX_NODES:
            why = (f"expands to more than {MAX_NODES:,} values (anchors and aliases repeat "
                   "whole subtrees)")
        if why:
            raise SpecError([Problem(_mark(self.source, node), fmt_path(loc),
                                     f"{why}; a spec is a few hundred values: write it out "
                                     "without the aliases")])
        self.path.append(node)


def _to_python(node: yaml.Node, loc: Loc, pos: Positions, problems: list[Problem],
               loader: yaml.SafeLoader, walk: _Walk) -> Any:
    walk.enter(node, loc)
    try:
        return _node_value(node, loc, pos, problems, loader, walk)
    finally:
        walk.path.pop()


def _node_value(node: yaml.Node, loc: Loc, pos: Positions, problems: list[Problem],
                loader: yaml.SafeLoader, walk: _Walk) -> Any:
    pos.value_at[loc] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)  # resolves YAML merge keys (<<)
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                problems.append(Problem(_mark(pos.source, key_node), fmt_path(loc),
                                        "keys must be plain scalars"))
                continue
            key = _scalar(key_node, loc, pos, problems, loader)
            if key is _BAD:
                continue
            if not isinstance(key, (str, int, float, bool)) or key is None:
                problems.append(Problem(_mark(pos.source, key_node), fmt_path(loc),
                                        "keys must be plain scalars"))
                continue
            key = str(key) if not isinstance(key, str) else key
            if key in out:
                first = pos.key_at[loc + (key,)]
                problems.append(Problem(
                    _mark(pos.source, key_node), fmt_path(loc + (key,)),
                    f"duplicate key (first defined at line {first[0]}); YAML would silently keep "
                    "the last one, so remove one of them"))
                continue
            pos.key_at[loc + (key,)] = (key_node.start_mark.line + 1,
                                        key_node.start_mark.column + 1)
            out[key] = _to_python(value_node, loc + (key,), pos, problems, loader, walk)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(item, loc + (i,), pos, problems, loader, walk)
                for i, item in enumerate(node.value)]
    value = _scalar(node, loc, pos, problems, loader)
    return None if value is _BAD else value


_BAD = object()  # a scalar that could not be built; its problem is recorded


def _scalar(node: yaml.Node, loc: Loc, pos: Positions, problems: list[Problem],
            loader: yaml.SafeLoader) -> Any:
    try:
        return loader.construct_object(node, deep=True)
    except ValueError as exc:  # an integer past sys.get_int_max_str_digits, a bad date
        import sys

        what = (f"an integer of {len(str(node.value))} digits, more than the "
                f"{sys.get_int_max_str_digits()} Python reads; no spec value is that large: "
                "give a smaller number") if "digits" in str(exc) else (
                f"cannot read the value {str(node.value)[:40]!r}: {exc}")
        problems.append(Problem(_mark(pos.source, node), fmt_path(loc), what))
        return _BAD


def _mark(source: str, node: yaml.Node) -> str:
    return f"{source}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"


def parse_yaml(text: str, source: str) -> tuple[Any, Positions]:
    """Parse YAML text into Python values plus the position of every node."""
    pos = Positions(source)
    problems: list[Problem] = []
    try:
        loader = _UniqueKeyLoader(text)  # the reader checks characters as it is built
    except yaml.YAMLError as exc:
        raise SpecError([Problem(source, "", f"not a YAML text: {exc}")]) from None
    try:
        node = loader.get_single_node()
        data = {} if node is None else _to_python(node, (), pos, problems, loader,
                                                   _Walk(source))
    except RecursionError:  # merge keys (<<) of a mapping into itself, flattened by PyYAML
        raise SpecError([Problem(source, "", "the YAML nests or refers to itself too deeply "
                                 "(anchors, aliases or << merges in a cycle); write it out "
                                 "without them")]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        what = f"{exc.context + '; ' if exc.context else ''}{exc.problem}"
        hint = ""
        if "\t" in what or "'\\t'" in what:
            hint = "; YAML indents with spaces, never tabs: replace the tab with spaces"
        raise SpecError([Problem(where, "", f"YAML syntax error: {what}{hint}")]) from None
    except yaml.YAMLError as exc:
        raise SpecError([Problem(source, "", f"YAML error: {exc}")]) from None
    finally:
        loader.dispose()
    if problems:
        raise SpecError(problems)
    return data, pos


def apply_overrides(data: Any, overrides: list[str], pos: Positions) -> list[Problem]:
    """Apply `key.path=value` overrides (values parsed as YAML) onto the raw mapping, in place."""
    problems = []
    for item in overrides:
        label = f"--set {item}"
        if not isinstance(item, str):  # from the Python API: item.partition was an AttributeError
            problems.append(Problem(f"--set {item!r}", "", "expected a 'key.path=value' "
                                    "string, e.g. 'capture.warmup_iters=5'"))
            continue
        key, sep, raw = item.partition("=")
        path = tuple(key.strip().split("."))
        if not sep or not all(path):
            problems.append(Problem(label, "", "expected --set key.path=value, e.g. "
                                    "--set capture.warmup_iters=5"))
            continue
        try:  # parsed as the spec is: anchors and aliases under the same caps
            value = parse_yaml(raw, label)[0] if raw.strip() else ""
        except SpecError as exc:
            problems.append(Problem(label, key, "the value is not valid YAML: " + "; ".join(
                p.message for p in exc.problems)))
            continue
        if not isinstance(data, dict):
            problems.append(Problem(label, key, "the spec is not a mapping"))
            continue
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(Problem(label, key, f"{fmt_path(path[:i + 1])} is not a mapping, "
                                        "so it has no keys to set"))
                break
            node = child
        else:
            node[path[-1]] = value
            pos.overrides[path] = label
    return problems


def _pydantic_problems(err: ValidationError, pos: Positions, data: Any) -> list[Problem]:
    problems = []
    alternatives: dict[Loc, list[dict]] = {}  # a value no member of a union took: one problem
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not _is_union_tag(p))
        kind = e["type"]
        if kind == "extra_forbidden":
            msg = f"unknown key '{loc[-1]}'"
            hint = _suggest(loc, data)
            msg += f"; did you mean '{hint}'?" if hint else "; remove it"
            where = pos.where(loc, key=True)
        elif kind == "missing":
            msg = f"required key '{loc[-1]}' is missing"
            only = _only_value(loc)
            msg += f": add {loc[-1]}: {only!r}" if only is not None else ""
            where = pos.where(loc[:-1])
        elif len(loc) < len(e["loc"]):
            alternatives.setdefault(loc, []).append(e)
            continue
        else:
            loc, msg = _at_key(loc, _value_message(e), data)
            where = pos.where(loc)
        problems.append(Problem(where, fmt_path(loc), msg))
    for loc, errors in alternatives.items():
        problems.append(Problem(pos.where(loc), fmt_path(loc), _either_message(errors)))
    return problems


def _is_union_tag(part: Any) -> bool:
    # pydantic adds the union member tried ("int", "constrained-int", "literal['auto']",
    # "function-after[...]") to locations
    return isinstance(part, str) and (part in ("int", "str", "float", "bool")
                                      or part.startswith("constrained-") or "[" in part)


def _at_key(loc: Loc, msg: str, data: Any) -> tuple[Loc, str]:
    """A mapping's validator names the key it refuses ("seq: duplicate bucket values"): the
    problem is located at that key's value (its line, or the --set that gave it)."""
    node = data
    for part in loc:
        node = node.get(part) if isinstance(node, dict) else None
    key, sep, rest = msg.partition(": ")
    if sep and isinstance(node, dict) and key in node:
        return (*loc, key), rest
    return loc, msg


def _either_message(errors: list[dict]) -> str:
    """One message for a value that no member of a union took: each member's, joined by
    or, the value once: "must be > 0, or must be 'auto' (got 0)"."""
    if len(errors) == 1:
        e = errors[0]
        if e["loc"][-1] == "str" and e["type"] == "literal_error" and isinstance(e["input"], str):
            # a bucket axis (keys.BucketValues) given text: `--set buckets.batch=1,8` lacks []
            return "must be a list of sizes such as [1, 8, 32], or 'auto'" + _got(e)
        return _value_message(e)
    wants = [_value_message(e, value=False) for e in errors]
    return ", or ".join(dict.fromkeys(wants)) + _got(errors[0])


def _value_message(e: dict, value: bool = True) -> str:
    """pydantic's message in the spec's words; value: the value given after it."""
    msg = e["msg"]
    msg = msg.replace("Input should be", "must be").replace("Value error, ", "")
    for words, sign in (("greater than or equal to", ">="), ("less than or equal to", "<="),
                        ("greater than", ">"), ("less than", "<")):
        msg = msg.replace(words, sign)
    return msg + (_got(e) if value and e["type"] != "value_error" else "")


def _got(e: dict) -> str:
    """The value an error was about, as ' (got 0)'; nothing for a mapping (its keys are
    reported)."""
    return f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""


def _owner(loc: Loc) -> type[BaseModel] | None:
    """The model whose field loc's last part names."""
    model: type[BaseModel] | None = PipelineSpec
    parts = list(loc[:-1])
    while parts and model is not None:
        field = model.model_fields.get(parts.pop(0))
        ann = field.annotation if field else None
        if getattr(ann, "__origin__", None) is dict and parts:
            parts.pop(0)  # a user-chosen key (an input's name), not a field
        model = _model_in(ann)
    return model


def _only_value(loc: Loc) -> Any:
    """The one value a required key can have (version: 1), or None."""
    model = _owner(loc)
    field = model.model_fields.get(str(loc[-1])) if model is not None else None
    if field is None or get_origin(field.annotation) is not Literal:
        return None
    values = get_args(field.annotation)
    return values[0] if len(values) == 1 else None


def _suggest(loc: Loc, data: Any) -> str | None:
    """The field name closest to an unknown key, from the model that owns it."""
    model = _owner(loc)
    if model is None:
        return None
    key, fields = str(loc[-1]), list(model.model_fields)
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    if close:
        return close[0]
    # a part of one field's name ("ids" for token_ids), where the spelling is far
    within = [f for f in fields if len(key) >= 3 and key in f]
    return within[0] if len(within) == 1 else None


def _model_in(ann: Any) -> type[BaseModel] | None:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in getattr(ann, "__args__", ()) or ():
        found = _model_in(arg)
        if found:
            return found
    return None


def spec_from_data(data: Any, pos: Positions, base_dir: Path) -> PipelineSpec:
    """Validate parsed values: pydantic per field, then the cross-field checks; all at once."""
    from graphrun.spec.rules import check_spec, resolve_paths

    if not isinstance(data, dict):
        raise SpecError([Problem(pos.where(()), "", "the spec must be a mapping of keys "
                                 "(version, name, model, inputs, ...)")])
    try:
        spec = PipelineSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(sorted(_pydantic_problems(err, pos, data), key=_order)) from None
    spec = resolve_paths(spec, base_dir)
    problems = [Problem(pos.where(loc), fmt_path(loc), msg)
                for loc, msg in check_spec(spec, base_dir)]
    if problems:
        raise SpecError(sorted(problems, key=_order))
    return spec


def _order(p: Problem) -> tuple:
    parts = p.where.rsplit(":", 2)
    try:
        return (0, int(parts[1]), int(parts[2]))
    except (IndexError, ValueError):
        return (1, 0, 0)


def override_list(overrides) -> list[str]:
    """The Python API's overrides as a list; one string is refused, not taken a character at a
    time as the --set of each (a SpecError per character, none of them saying why)."""
    if isinstance(overrides, (str, bytes)):
        raise SpecError([Problem("overrides", "", f"expected a list of 'key.path=value' "
                                 f"strings, got one string: pass overrides=[{overrides!r}]")])
    return list(overrides)


def load_spec(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineSpec:
    """Read, override and validate a pipeline spec; raise SpecError listing every problem."""
    if not isinstance(path, (str, PathLike)):  # Path(None) was a TypeError from pathlib
        raise SpecError([Problem("load_spec", "", f"expected the spec file's path (a str or "
                                 f"Path), got {type(path).__name__}")])
    overrides = override_list(overrides)
    path = Path(path)
    source = str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError([Problem(source, "", f"cannot read the spec: {exc.strerror}")]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError([Problem(source, "", f"not UTF-8 text (byte {exc.start})")]) from None
    data, pos = parse_yaml(text, source)
    problems = apply_overrides(data, overrides, pos)
    if problems:
        raise SpecError(problems)
    spec = spec_from_data(data, pos, path.resolve().parent)
    spec._source = path.resolve()
    return spec
