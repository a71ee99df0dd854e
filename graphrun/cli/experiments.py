"""The experiment verbs of the command line: plan, compare, report, sweep and bench, registered
on cli.main's group."""

from __future__ import annotations

from pathlib import Path

import click

from graphrun.base.nofollow import open_file
from graphrun.cli.errors import debug_option, fail
from graphrun.base.errors import GraphrunError, OutputError


@click.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--max-graphs", type=click.IntRange(min=1), default=None,
              help="At most this many graphs in total (the product of the lists' lengths; "
              "for a generation spec, prefill and decode graphs). Default: the spec's "
              "buckets_max_graphs, which `buckets: auto` plans to (unset: 8, or 40 for a "
              "generation spec).")
@click.option("--sample", type=click.IntRange(min=1), default=None,
              help="Plan from a uniform sample of about N records (whole batches).")
@click.option("--multiple-of", "multiples", multiple=True, metavar="AXIS=M",
              help="Values of AXIS must be multiples of M, e.g. seq=8 (repeatable).")
@click.option("--write", is_flag=True, help="Write the planned lists into SPEC (comments kept).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key before reading (repeatable).")
@debug_option
def plan(spec, max_graphs, sample, multiples, write, overrides) -> None:
    """Choose bucket lists from SPEC's data that minimise padded work."""
    from graphrun.experiments.plan_table import run_plan

    try:
        run_plan(spec, overrides, max_graphs, sample, multiples, write, click.echo)
    except GraphrunError as err:
        fail(err)


@click.command()
@click.argument("a", type=click.Path(file_okay=False, path_type=Path))
@click.argument("b", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@debug_option
def compare(a, b, as_json) -> None:
    """Two run folders side by side: spec difference, latency per bucket, totals, outputs."""
    import json

    from rich.console import Console

    from graphrun.experiments.compare import compare as compare_runs, print_compare

    try:
        result = compare_runs(a, b)
    except GraphrunError as err:
        fail(err)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        print_compare(result, Console(width=120))


@click.command()
@click.argument("dirs", nargs=-1, required=True,
                type=click.Path(file_okay=False, path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("report.html"), show_default=True, help="The HTML file to write.")
@debug_option
def report(dirs, out) -> None:
    """One self-contained HTML page of charts from run folders (compared), a sweep folder or a
    bench folder."""
    from graphrun.experiments.report import write_report

    try:
        click.echo(f"wrote {write_report(list(dirs), out)}")
    except GraphrunError as err:
        fail(err)


@click.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--grid", "grids", multiple=True, metavar="KEY=[V1,V2,...]",
              help="A spec key and the values to try (repeatable; every combination runs).")
@click.option("--stop", type=click.IntRange(min=1), default=None,
              help="Each variant runs on the first N records.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The sweep's folder: one subfolder per variant, sweep.json.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key in every variant (repeatable).")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help="Runs per variant, alternating the variants (default: 3 on a CUDA device, "
              "2 on a CPU; a winner needs 3).")
@click.option("--objective", type=click.Choice(["records_per_s", "tokens_per_s", "p99_ms"]),
              default=None, help="What the recommendation maximises (p99_ms: minimises); "
              "default tokens_per_s for a generation spec, else records_per_s.")
@click.option("--max-memory-mib", type=click.FloatRange(min=0), default=None,
              help="Recommend no variant whose graph memory is above this.")
@click.option("--max-p99-ms", type=click.FloatRange(min=0), default=None,
              help="Recommend no variant whose batch p99 latency is above this.")
@debug_option
def sweep(spec, grids, stop, out, overrides, repeats, objective, max_memory_mib,
          max_p99_ms) -> None:
    """Run every combination of the grid as a spec variant, side by side, and recommend one."""
    from rich.console import Console

    from graphrun.experiments.sweep import Constraints, parse_grid, sweep as run_sweep
    from graphrun.experiments.sweep_report import recommendation_lines, sweep_table

    try:
        result = run_sweep(spec, parse_grid(grids), out, stop=stop, base=list(overrides),
                           repeats=repeats, objective=objective,
                           constraints=Constraints(max_memory_mib=max_memory_mib,
                                                   max_p99_ms=max_p99_ms),
                           echo=lambda msg: click.echo(msg, err=True))
    except GraphrunError as err:
        fail(err)
    Console(width=200).print(sweep_table(result))
    for line in recommendation_lines(result):
        click.echo(line)
    click.echo(f"-> {out}/sweep.json; charts: graphrun report {out}")
    if not any(v.status == "completed" for v in result.variants):  # a bad grid, most likely
        fail(GraphrunError("no variant completed; each row says why (a grid key or value the "
                           "spec refuses fails every variant)"))


@click.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--iters", type=click.IntRange(min=1), default=50, show_default=True,
              help="Timed steps per repeat, bucket and mode.")
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True,
              help="Untimed steps before each repeat's.")
@click.option("--compile", "with_compile", is_flag=True,
              help="Also model.compile: true (and, for a forward spec on a GPU, torch.compile "
                   "reduce-overhead).")
@click.option("--records", type=click.IntRange(min=1), default=None,
              help="Inputs from the first N real records (default: synthetic).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for bench.json (default: the spec's output.dir/bench).")
@click.option("--new-tokens", type=click.IntRange(min=1), default=None,
              help="A generation spec: new tokens per row and call (default: "
              "generate.max_new_tokens).")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help="Timings per bucket and mode, the modes alternating (default: 3 on a CUDA "
              "device, 2 on a CPU; a winner needs 3).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key (repeatable).")
@debug_option
def bench(spec, iters, warmup, with_compile, records, out, new_tokens, repeats,
          overrides) -> None:
    """Time every bucket: eager, graph replay (and compiled), with speedups; no outputs. A
    generation spec: prefill and decode per (batch, prompt) bucket, tokens/s, TTFT, TPOT."""
    from rich.console import Console

    from graphrun.experiments.bench import bench as run_bench, bench_table, verdict_lines
    from graphrun.spec.load import load_spec

    try:
        pipeline = load_spec(spec, overrides)
        dest = Path(out or pipeline.output.dir / "bench")
        bench_dest_problem(dest)  # before the timing: it was a traceback after all of it
        generation = pipeline.generate is not None
        if generation:
            from graphrun.generate.records import with_implied_io

            pipeline = with_implied_io(pipeline)
        if pipeline.auto_axes:
            from graphrun.plan.auto import resolve_auto

            pipeline = resolve_auto(pipeline)[0]
        log = lambda msg: click.echo(msg, err=True)  # noqa: E731
        if generation:
            from graphrun.experiments.bench_generate import (bench_generation,
                                                             generation_table, refuse)

            if records is not None:
                raise refuse("--records", "a generation spec is timed on synthetic prompts of "
                             "each prompt bucket's length: leave --records out")
            result = bench_generation(pipeline, iters=iters, warmup=warmup,
                                      new_tokens=new_tokens, repeats=repeats,
                                      compile=with_compile, log=log)
        else:
            if new_tokens is not None:
                raise refuse_new_tokens()
            result = run_bench(pipeline, iters=iters, warmup=warmup, compile=with_compile,
                               records=records, repeats=repeats, log=log)
    except GraphrunError as err:
        fail(err)
    try:
        dest.mkdir(parents=True, exist_ok=True)
        with open_file(dest / "bench.json", "w") as f:  # never through a link
            f.write(result.model_dump_json(indent=2) + "\n")
    except GraphrunError as err:  # a link planted meanwhile
        fail(err)
    except OSError as err:
        fail(OutputError(f"cannot write {dest / 'bench.json'}: {err.strerror or err}"))
    Console(width=200).print(
        generation_table(result) if generation else bench_table(result))
    for line in verdict_lines(result):
        click.echo(line)
    for note in result.notes:
        click.echo(f"note: {note}")
    click.echo(f"-> {dest}/bench.json")


def bench_dest_problem(dest: Path) -> None:
    """Raise OutputError where bench.json cannot be written into dest: a file in the folder's
    place, a folder or a link in the file's."""
    from graphrun.base.nofollow import linked

    for folder in (dest, *dest.parents):  # the nearest that exists must be a folder
        if folder.exists():
            if not folder.is_dir():
                raise OutputError(f"{folder} is a file, not a folder: give --out a folder "
                                  "for bench.json")
            break
    target = dest / "bench.json"
    if target.is_symlink():
        raise linked(target)
    if target.exists() and not target.is_file():
        raise OutputError(f"{target} is a folder, not a file: remove it, or give --out "
                          "another folder")


def refuse_new_tokens() -> GraphrunError:
    from graphrun.base.errors import Problem, SpecError

    return SpecError([Problem("graphrun bench --new-tokens", "", "only a generation spec (one "
                              "with generate:) makes new tokens: leave --new-tokens out")])


EXPERIMENT_COMMANDS = (plan, compare, report, sweep, bench)
