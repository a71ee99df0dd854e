"""The package's shape (docs/architecture.md): packages named after the flow's steps, each
importing only the packages below it; few modules outside them; no import circle between modules;
no private name imported or read across modules."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "graphrun"
# bottom to top: a package may import its own modules and those of the packages before it
LAYERS = ["base", "spec", "manifest", "models", "engine", "generate", "read", "plan", "llm",
          "write", "feed", "job", "init", "experiments", "scale", "cli"]
# the public API (graphrun/__init__.py), `python -m graphrun`, graphrun.ray.dataset_map: the
# top layer, above cli, so no package reaches the API through the root
TOP_LEVEL = {"__init__.py", "__main__.py", "ray.py"}
ROOT = len(LAYERS)


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, path: Path, known: dict) -> set[str]:
    """The graphrun modules `module` imports, at its top or inside its functions (an import
    deferred to a call still ties the two modules together)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = resolve(module, path.name == "__init__.py", node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known and m != module}


def layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "graphrun":
        return None
    if len(parts) == 1 or f"{parts[1]}.py" in TOP_LEVEL:
        return ROOT
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def test_every_package_imports_only_the_layers_below_it():
    known = modules()
    up = []
    for module, path in known.items():
        own = layer(module)
        for dep in imports(module, path, known):
            if own is not None and layer(dep) is not None and layer(dep) > own:
                up.append(f"{module} -> {dep}")
    assert not up, "imports from a lower layer up:\n" + "\n".join(sorted(up))


def test_the_package_is_its_step_packages():
    top = {p.name for p in PACKAGE.iterdir() if p.suffix == ".py"}
    assert top == TOP_LEVEL, f"modules outside a step package: {sorted(top - TOP_LEVEL)}"
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert packages <= set(LAYERS), f"packages not in LAYERS: {sorted(packages - set(LAYERS))}"


def test_the_layering_test_sees_an_import_up(tmp_path):
    # the checker itself: a base module importing the CLI is found
    path = tmp_path / "m.py"
    path.write_text("from graphrun.cli.main import entry\n")
    known = {"graphrun.base.m": path, "graphrun.cli.main": path}
    deps = imports("graphrun.base.m", path, known)
    assert [d for d in deps if layer(d) > layer("graphrun.base.m")] == ["graphrun.cli.main"]


def test_the_layering_test_sees_an_import_of_the_package_root(tmp_path):
    # `import graphrun` inside a package reaches the public API from below it
    path = tmp_path / "m.py"
    path.write_text("def f():\n    import graphrun\n    return graphrun.Runner\n")
    known = {"graphrun.plan.m": path, "graphrun": path}
    deps = imports("graphrun.plan.m", path, known)
    assert [d for d in deps if layer(d) > layer("graphrun.plan.m")] == ["graphrun"]
    assert layer("graphrun") > layer("graphrun.cli.main") == layer("graphrun.cli")
    assert layer("graphrun.ray") == layer("graphrun.__main__") == layer("graphrun")


def test_no_import_circle():
    known = modules()
    graph = {m: imports(m, p, known) for m, p in known.items()}
    # a package's __init__ importing its own modules is how a package exports; not a circle
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    seen, on_path, circles = set(), [], []

    def visit(m):
        if m in on_path:
            circles.append(" -> ".join(on_path[on_path.index(m):] + [m]))
            return
        if m in seen:
            return
        seen.add(m)
        on_path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        on_path.pop()

    for m in sorted(graph):
        visit(m)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_private_name_crosses_a_module():
    known = modules()
    crossings = []
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or
                                                     (node.module or "").startswith("graphrun")):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        crossings.append(f"{module} imports {alias.name} from {node.module}")
    assert not crossings, "private names across modules:\n" + "\n".join(crossings)


def private_reads(tree: ast.AST) -> tuple[set[str], set[str]]:
    """A module's private attribute names: those it defines (self._x = ..., a class body's _x)
    and those it reads off another object than self or cls (obj._x)."""
    defined, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = (item.targets if isinstance(item, ast.Assign) else
                           [item.target] if isinstance(item, ast.AnnAssign) else [])
                defined.update(t.id for t in targets if isinstance(t, ast.Name))
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.add(item.name)
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__"):
            continue
        own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        (defined if own and isinstance(node.ctx, ast.Store) else
         read if not own else set()).add(name)
    return defined, read


def test_no_private_attribute_is_used_across_packages():
    """obj._x used in one package where only another graphrun package defines _x: give it a
    public name (a property) instead. Other libraries' private names are not checked."""
    known = modules()
    defined, read = {}, {}
    for module, path in known.items():
        package = ".".join(module.split(".")[:2])
        own, used = private_reads(ast.parse(path.read_text()))
        defined.setdefault(package, set()).update(own)
        read.setdefault(package, set()).update(used)
    everywhere = set().union(*defined.values())
    crossings = [f"{package} uses .{name}" for package in sorted(read)
                 for name in sorted(read[package] & everywhere - defined[package])]
    assert not crossings, "private attributes read across modules:\n" + "\n".join(crossings)


def test_the_private_read_check_sees_one():
    defined, read = private_reads(ast.parse(
        "class A:\n    _b = 1\n    def f(self):\n        self._c = other._d\n"))
    assert defined == {"_b", "_c", "f"} and read == {"_d"}


def defined_names(tree: ast.Module) -> list[str]:
    """A module's own names that something must call: its top-level functions, classes and
    constants, and its classes' plain methods (decorated ones are called by what decorates
    them: validators, properties, registered operators)."""
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.decorator_list:
            names.append(node.name)
        if isinstance(node, ast.ClassDef):
            names += [m.name for m in node.body if isinstance(m, ast.FunctionDef)
                      and not m.decorator_list and not m.name.startswith("__")]
        if isinstance(node, ast.Assign):
            names += [t.id for t in node.targets
                      if isinstance(t, ast.Name) and not t.id.startswith("__")]
    return names


def test_no_name_is_defined_and_never_used():
    """A function, class, method or constant named nowhere but its definition (in the package,
    the tests, scripts/, benchmarks/, examples/) is dead code: delete it."""
    import collections
    import re

    root = PACKAGE.parent
    used = collections.Counter()
    for folder in ("graphrun", "tests", "scripts", "benchmarks", "examples", "pipelines"):
        for path in (root / folder).rglob("*"):
            if path.suffix in (".py", ".sh", ".yaml", ".toml"):
                used.update(re.findall(r"[A-Za-z_]\w*", path.read_text(errors="replace")))
    dead = [f"{module}.{name}" for module, path in modules().items()
            for name in defined_names(ast.parse(path.read_text())) if used[name] <= 1]
    assert not dead, "defined and never used:\n" + "\n".join(sorted(dead))


def test_the_dead_code_check_sees_a_method_and_a_constant():
    tree = ast.parse("X = 1\nclass A:\n    @property\n    def p(self): ...\n"
                     "    def m(self): ...\n    def __init__(self): ...\ndef f(): ...\n")
    assert defined_names(tree) == ["X", "A", "m", "f"]


# the modules' former names: an import under one sends a reader looking for a file not there
RETIRED = {"pipeline", "run_state", "record_checks", "record_ids", "spec_checks", "auto_buckets",
           "layout", "ray_data", "cli_errors", "init_data"}


def aliased_imports(tree: ast.AST, known: dict) -> list[str]:
    """`import graphrun.a.b as c` / `from graphrun.a import b as c` where c is not b or b_<more>,
    or is a retired module's name."""
    found = []
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, ast.Import):
            pairs = [(a.name, a.asname) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            pairs = [(f"{node.module}.{a.name}", a.asname) for a in node.names]
        for module, alias in pairs:
            if alias is None or module not in known:
                continue
            own = module.rsplit(".", 1)[-1]
            if alias in RETIRED or not (alias == own or alias.startswith(own + "_")):
                found.append(f"{module} as {alias}")
    return found


def test_tests_import_modules_by_their_own_names():
    known = modules()
    found = [f"{path.name}: {x}" for path in sorted((PACKAGE.parent / "tests").glob("*.py"))
             for x in aliased_imports(ast.parse(path.read_text()), known)]
    assert not found, "modules imported under another name:\n" + "\n".join(found)


def test_the_alias_check_sees_a_former_name():
    known = {"graphrun.job.spine": None, "graphrun.job.state": None, "graphrun.write.sinks.npy": None}
    tree = ast.parse("import graphrun.job.spine as pipeline\nfrom graphrun.job import state as "
                     "run_state\nfrom graphrun.write.sinks import npy as npy_sink\n")
    assert aliased_imports(tree, known) == ["graphrun.job.spine as pipeline",
                                            "graphrun.job.state as run_state"]


def named_files(text: str) -> list[str]:
    """The module files a docstring or comment names: `x.py`, `pkg/x.py`."""
    import re

    return re.findall(r"(?<![\w./-])((?:[a-z_]+/)*[a-z_0-9]+\.py)\b", text)


# example file names in messages and docs, not graphrun's modules
EXAMPLES = {"file.py", "path/to/file.py", "models/net.py"}


def test_every_module_a_comment_names_exists():
    root = PACKAGE.parent
    files = [p.relative_to(root).as_posix() for p in root.rglob("*.py")]
    names = {f.rsplit("/", 1)[-1] for f in files}
    stale = []
    for module, path in modules().items():
        for name in named_files(path.read_text()):
            there = (name in names if "/" not in name else
                     any(f.endswith("/" + name) or f == name for f in files))
            if not there and name not in EXAMPLES:
                stale.append(f"{module}: {name}")
    assert not stale, "names of modules that do not exist:\n" + "\n".join(stale)


def test_no_comment_points_at_the_results_log():
    # the why belongs in the comment; the measurements and their history in the log alone
    citing = [module for module, path in modules().items() if "RESULTS.md" in path.read_text()]
    assert not citing, "modules citing benchmarks/RESULTS.md:\n" + "\n".join(citing)


def test_the_named_files_check_reads_paths():
    assert named_files("see record_checks.py and (scale/layout.py), not x.pyc") == [
        "record_checks.py", "scale/layout.py"]


# helpers every layer needs, defined once in base/: what writing one again looks like
HELPERS = {
    "base.units.MiB": r"^MiB = ",
    "base.phases.utc_now": r"timezone\.utc\)",
    "base.errors.error_chain": r"__context__ or \w+\.__cause__|__cause__ or \w+\.__context__",
    "base.digest.file_sha256": r"hashlib\.sha256\(\)\n(?:.*\n){0,3}.*\.read\(",
}


def test_base_helpers_are_not_written_again():
    import re

    again = [f"{module}: {helper}" for module, path in modules().items()
             if not module.startswith("graphrun.base")
             for helper, pattern in HELPERS.items()
             if re.search(pattern, path.read_text(), re.M)]
    assert not again, "written again instead of imported from base/:\n" + "\n".join(again)
