"""`graphrun plan`'s output: the table of bucket lists side by side, the YAML to paste, and
--write, which puts the chosen lists into the spec file keeping its comments and layout."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

from graphrun.base.units import MiB
from graphrun.base.errors import SpecError, Problem
from graphrun.base.extras import install_hint
from graphrun.plan.planner import Evaluation, Histogram
from graphrun.plan.budget import largest_bucket_cost


def flow_list(values: list[int]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def estimates(spec, rows: list[tuple[str, Evaluation]], measure=largest_bucket_cost
              ) -> list[tuple[float, float]]:
    """Per row: capture s (at most graphs x the largest's time: smaller graphs capture
    faster) and memory MiB (a shared pool holds about the largest graph's, smaller graphs
    reuse its blocks; a pool per graph, graphs x it)."""
    cache: dict[tuple, tuple[float, int]] = {}
    out = []
    for _, ev in rows:
        key = tuple(max(ev.lists[a]) for a in sorted(ev.lists))
        if key not in cache:
            cache[key] = measure(spec, ev.lists)
        capture_s, memory = cache[key]
        per_graph = spec.capture.pool == "per-graph"
        out.append((capture_s * ev.graphs, memory * (ev.graphs if per_graph else 1) / MiB))
    return out


def plan_table(hist: Histogram, rows: list[tuple[str, Evaluation]],
               costs: list[tuple[float, float]] | None = None,
               memory: list[int] | None = None, budget_mib: float | None = None):
    """A rich Table: one row per candidate (spec, power of two, planned). memory: per row,
    the graphs' estimated bytes (plan_budget.MemoryModel), shown against budget_mib."""
    from rich.table import Table

    what = f"{hist.records} records in {hist.batches} batches"
    if hist.sampled:
        what += " (a uniform sample of whole batches)"
    table = Table(title=f"bucket plans over {what}")
    table.add_column("lists")
    for axis in hist.axes:
        table.add_column(axis)
    table.add_column("graphs", justify="right")
    table.add_column("padded work", justify="right")
    table.add_column("padding waste", justify="right")
    if costs:
        table.add_column("capture s (est.)", justify="right")
        table.add_column("graph MiB (est.)", justify="right")
    if memory:
        table.add_column("memory MiB (est.)", justify="right")
        table.add_column(f"budget {budget_mib:g} MiB", justify="right")
    for i, (label, ev) in enumerate(rows):
        waste = f"{100 * ev.waste:.1f}%"
        if ev.uncovered:
            waste += f" ({ev.uncovered} batches too long)"
        extra = [f"<= {costs[i][0]:.2f}", f"~{costs[i][1]:,.0f}"] if costs else []
        if memory:
            fits = memory[i] <= budget_mib * MiB
            extra += [f"~{memory[i] / MiB:,.1f}", "fits" if fits else "OVER: buckets dropped"]
        table.add_row(label, *(flow_list(ev.lists[a]) for a in hist.axes), str(ev.graphs),
                      f"{ev.padded:,}", waste, *extra)
    return table


def yaml_snippet(lists: dict[str, list[int]]) -> str:
    return "buckets:\n" + "".join(f"  {a}: {flow_list(v)}\n" for a, v in lists.items())


def write_buckets(path: Path, lists: dict[str, list[int]], notes: dict[str, str] | None = None,
                  counted: str | None = None) -> str:
    """Replace the bucket lists in the spec file in place (ruamel.yaml's round trip keeps
    comments, key order, flow or block style); returns the new text. The comments that
    describe the lists (init's graph count, an axis' "the last: the model's limit") are
    rewritten to describe the new ones: notes, axis -> what its list is; counted: a generation
    spec's graph count ("8 prefill + 32 decode")."""
    try:
        from ruamel.yaml import YAML
        from ruamel.yaml.comments import CommentedMap, CommentedSeq
    except ImportError:
        raise SpecError([Problem(str(path), "", f"--write needs ruamel.yaml: {install_hint('plan')};"
                                 " or paste the YAML printed without --write")]) from None
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap the user's long lines
    text = path.read_text()
    data = yaml.load(text)
    buckets = data.get("buckets") if isinstance(data, dict) else None
    if not isinstance(buckets, CommentedMap):
        raise SpecError([Problem(str(path), "buckets", "no `buckets:` mapping to write into")])
    for axis, values in lists.items():
        current = buckets.get(axis)
        if isinstance(current, list):
            current[:] = values  # in place: the list keeps its style and trailing comment
        else:  # `auto` or absent: a flow list like the spec's usual `[1, 8, 32]`
            seq = CommentedSeq(values)
            seq.fa.set_flow_style()
            buckets[axis] = seq
    out = io.StringIO()
    yaml.dump(data, out)
    new = _fresh_comments(out.getvalue(), lists, notes or {}, counted)
    path.write_text(new)
    return new


# the comments init (or an earlier plan) wrote of a list; a user's own comment is kept
_DESCRIBES = re.compile(r"\s*(up to data\.batch_size|(lengths|tokens|prompt tokens) \d+-\d+ in "
                        r"the sample|planned by graphrun plan|planned for the grouped batches|"
                        r"rows of the graphs, planned for the grouped batches)")


def _fresh_comments(text: str, lists: dict[str, list[int]], notes: dict[str, str],
                    counted: str | None = None) -> str:
    """The buckets block's own comments made true of `lists`: the graph count on `buckets:`,
    and a flow list's trailing comment replaced by what the plan says of it."""
    graphs = math.prod(len(v) for v in lists.values())
    lines, inside = text.split("\n"), False
    for i, line in enumerate(lines):
        if re.match(r"buckets:", line):
            inside = True
            lines[i] = re.sub(r"one graph per combination: \d+",
                              f"one graph per combination: {graphs}", line)
            if counted:
                lines[i] = re.sub(r"graphs: \d+ prefill \+ \d+ decode", f"graphs: {counted}",
                                  lines[i])
            continue
        if inside and line and not line[0].isspace():
            break
        axis = re.match(r"(\s+)([A-Za-z_][\w-]*):\s*\[[^\]]*\](\s*)#", line)
        if inside and axis and axis.group(2) in lists and _DESCRIBES.match(line[axis.end():]):
            lines[i] = line[:axis.end() - 1] + "# " + notes.get(
                axis.group(2), "planned by graphrun plan")
    return "\n".join(lines)


def parse_multiples(items: tuple[str, ...], axes: tuple[str, ...]) -> dict[str, int]:
    """--multiple-of seq=8 -> {"seq": 8}; a bad item is a SpecError naming it."""
    out = {}
    for item in items:
        axis, _, value = item.partition("=")
        if axis not in axes or not value.isdigit() or int(value) < 1:
            raise SpecError([Problem("--multiple-of", item, f"expected AXIS=M with AXIS one of "
                                     f"{', '.join(axes)} and M a positive integer")])
        out[axis] = int(value)
    return out


def run_plan(spec_path: Path, overrides, max_graphs: int | None, sample: int | None,
             multiples: tuple[str, ...], write: bool, echo) -> dict[str, list[int]]:
    """The verb: histogram, plan, table; the YAML printed, or written into the spec. The
    planned lists are plan/auto.py's plan_spec, as `buckets: auto` runs with (a generation
    spec's graphs counted as prefill and decode graphs); max_graphs None: the spec's
    buckets_max_graphs (its default is of the spec's kind)."""
    from rich.console import Console

    from graphrun.base.errors import InputError
    from graphrun.plan.auto import covering, pin_text_length, plan_spec
    from graphrun.plan.limits import axis_limits
    from graphrun.plan.planner import evaluate, histogram, power_of_two
    from graphrun.spec.load import load_spec

    spec = load_spec(spec_path, overrides)
    generating = spec.generate is not None
    bound = "--max-graphs" if max_graphs is not None else "buckets_max_graphs"
    if max_graphs is None:
        max_graphs = spec.max_graphs
    multiple_of = {**spec.buckets_multiple_of, **parse_multiples(multiples, tuple(spec.axes))}
    hist = histogram(spec, sample=sample)
    if hist.batches == 0:
        raise InputError(f"no valid record to plan from: {hist.no_records()}",
                         where=str(spec.data.path))
    limits = axis_limits(spec)
    caps = {a: lim.value for a, lim in limits.items()}
    # texts are cut at a limit: the plan's last value stays there, so --write does not move
    # where the run cuts them
    cut = {a: lim.value for a, lim in limits.items() if lim.cut}
    # an auto text axis ends at its limit in the run (a longer prompt the sample missed may
    # come), cut or not: planned so here too, the lists printed are the ones the run takes
    from graphrun.generate.records import with_implied_io

    cut.update(pin_text_length(with_implied_io(spec), spec.auto_axes)[1])
    # nothing is measured on the device for a generation spec (a capture of one of its
    # buckets says little of its decode graphs)
    cuda = not generating and _cuda(spec)
    if not generating and spec.capture.memory_budget_mib is not None:
        echo("measuring one bucket to keep the plan within capture.memory_budget_mib ...")
    planned = plan_spec(spec, covering(hist, cut, caps), max_graphs, multiple_of, {}, cuda,
                        str(spec_path))
    graphs, model, budget = planned.generation, planned.memory, planned.budget_text(spec)
    if generating:
        rows = _generation_rows(spec, hist, planned, max_graphs, multiple_of, caps)
    else:
        rows = [] if spec.auto_axes else [("spec", evaluate(hist, spec.buckets))]
        rows += [("power of two", power_of_two(hist, max_graphs, multiple_of, caps)),
                 ("planned", planned.chosen)]
    chosen = rows[-1][1]
    costs = None
    if cuda:
        echo("capturing the largest bucket to estimate capture time and memory ...")
        costs = estimates(spec, rows)
    per_graph = spec.capture.pool == "per-graph"
    memory = [model.lists_bytes(ev.lists, per_graph) for _, ev in rows] if model else None
    Console(width=160).print(plan_table(hist, rows, costs, memory,
                                        spec.capture.memory_budget_mib))
    if budget is not None:
        echo(budget)
    if generating:
        over = graphs.total > max_graphs
        echo(f"graphs, planned: {graphs.text()}; " + (
            f"more than {bound} {max_graphs}: one prompt bucket makes this many"
            if over else f"at most {max_graphs} ({bound})"))
    echo(padding_line(spec, rows))
    if hist.rejected:
        top = sorted(hist.reasons.items(), key=lambda kv: -kv[1])[0][0]
        echo(f"{hist.rejected} bad records were not counted (e.g. {top})")
    notes = {}
    for axis, lim in limits.items():
        echo(f"{axis} stops at {lim.value}: {lim.why}; longer texts are "
             + ("cut there (data.text.truncate: true)" if lim.cut else "rejected"))
        if chosen.lists[axis][-1] == lim.value:
            notes[axis] = f"planned by graphrun plan; the last, {lim.value}, is {lim.why}"
    if write:
        write_buckets(spec_path, chosen.lists, notes,
                      f"{graphs.prefill} prefill + {graphs.decode} decode" if generating else None)
        echo(f"wrote the planned buckets into {spec_path}")
    else:
        echo("\n" + yaml_snippet(chosen.lists).rstrip())
    return chosen.lists


def _generation_rows(spec, hist, planned, max_graphs: int, multiple_of: dict[str, int],
                     caps: dict[str, int]) -> list[tuple[str, Evaluation]]:
    """A generation spec's table rows (spec, power of two, planned), their graphs counted as
    prefill and decode graphs."""
    from graphrun.plan.generation import power_of_two_generation, prefill_evaluation

    g = spec.generate
    rows = []
    if not spec.auto_axes:
        rows.append(("spec", prefill_evaluation(hist, spec.buckets, g)[0]))
    rows += [("power of two", power_of_two_generation(hist, max_graphs, g, multiple_of,
                                                      caps)[0]),
             ("planned", planned.chosen)]
    return rows


def padding_line(spec, rows: list[tuple[str, Evaluation]]) -> str:
    """The padded share of the computed positions, with the spec's lists (or the first row)
    before and planned after: a forward job's rows x positions of the batches as the run
    forms them; a generation job's prefill positions, as its engine packs the prompts."""
    before_label, before = rows[0]
    after = rows[-1][1]
    if spec.generate is not None:
        from graphrun.plan.prefills import ASSUMED

        return (f"padding expected in the prefills, which pack the prompts (simulated, "
                f"{ASSUMED}): {before.waste:.1%} of their positions with the {before_label} "
                f"lists, {after.waste:.1%} planned; a run's summary gives the padding it "
                "computed")
    how = (f"batches grouped by length (data.group_by_length: {spec.data.group_by_length})"
           if spec.data.group_by_length else "batches in input order")
    hint = ("" if spec.data.group_by_length or len(spec.axes) < 2 else
            "; data.group_by_length: N batches similar lengths together and pads less, "
            "outputs still in input order (plan again with --set data.group_by_length=N)")
    return (f"padding expected, {how}: {before.waste:.1%} of the computed positions with the "
            f"{before_label} lists, {after.waste:.1%} planned{hint}")


def _cuda(spec) -> bool:
    from graphrun.engine.device import resolve_device

    return resolve_device(spec.device).type == "cuda"
