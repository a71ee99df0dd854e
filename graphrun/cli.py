"""The command line: a thin layer over the Python API.

A user error (GraphrunError) prints one message and exits non-zero, without a traceback unless
--debug is given; anything else is a bug in graphrun and keeps its traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from . import __version__
from .errors import GraphrunError, Interrupted

_debug = False


def _fail(err: GraphrunError) -> None:
    if _debug:
        raise err
    click.echo(f"error: {err}", err=True)
    sys.exit(err.exit_code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="graphrun")
@click.option("--debug", is_flag=True, help="Show Python tracebacks for user errors too.")
def main(debug: bool) -> None:
    """graphrun: run PyTorch inference through CUDA Graphs, driven by one YAML file."""
    global _debug
    _debug = debug


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key, e.g. --set capture.warmup_iters=5 (repeatable).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Output folder (default: the spec's output.dir).")
@click.option("--resume", is_flag=True, help="Continue an interrupted run in the output folder.")
@click.option("--overwrite", is_flag=True, help="Replace graphrun's files in the output folder.")
@click.option("--start", type=click.IntRange(min=0), default=0,
              help="First input record to read (for one slice per process).")
@click.option("--stop", type=click.IntRange(min=0), default=None,
              help="Input record to stop before.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or summary table.")
@click.option("--report", "with_report", is_flag=True,
              help="Also write report.html (charts) beside manifest.json.")
def run(spec, overrides, out, resume, overwrite, start, stop, quiet, with_report) -> None:
    """Run SPEC: read its input, replay every batch, write outputs and manifest.json."""
    from .pipeline import run as run_pipeline
    from .spec_load import load_spec

    if resume and overwrite:
        _fail(GraphrunError("--resume and --overwrite contradict each other: pick one"))
    show = not quiet and sys.stdout.isatty()
    try:
        pipeline = load_spec(spec, overrides)
        manifest = run_pipeline(pipeline, out=out, resume=resume, overwrite=overwrite,
                                show=show, start=start, stop=stop)
    except Interrupted as err:
        click.echo(f"graphrun: {err}", err=True)
        sys.exit(err.exit_code)
    except GraphrunError as err:
        _fail(err)
    else:
        t = manifest.totals
        dest = out or pipeline.output.dir
        if not quiet:
            click.echo(f"{manifest.status}: {t.records_out} records out, {t.records_rejected} "
                       f"rejected, {t.batches} batches, {t.records_per_s:,.0f} records/s "
                       f"-> {dest}/manifest.json")
        if with_report:
            from .report import write_report

            try:
                written = write_report([Path(dest)], Path(dest) / "report.html")
            except GraphrunError as err:
                _fail(err)
            if not quiet:
                click.echo(f"report -> {written}")


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--max-graphs", type=click.IntRange(min=1), default=8, show_default=True,
              help="At most this many graphs in total (product of the lists' lengths).")
@click.option("--sample", type=click.IntRange(min=1), default=None,
              help="Plan from a uniform sample of about N records (whole batches).")
@click.option("--multiple-of", "multiples", multiple=True, metavar="AXIS=M",
              help="Values of AXIS must be multiples of M, e.g. seq=8 (repeatable).")
@click.option("--write", is_flag=True, help="Write the planned lists into SPEC (comments kept).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key before reading (repeatable).")
def plan(spec, max_graphs, sample, multiples, write, overrides) -> None:
    """Choose bucket lists from SPEC's data that minimise padded work."""
    from .plan_show import run_plan

    try:
        run_plan(spec, overrides, max_graphs, sample, multiples, write, click.echo)
    except GraphrunError as err:
        _fail(err)


@main.command()
@click.argument("a", type=click.Path(file_okay=False, path_type=Path))
@click.argument("b", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
def compare(a, b, as_json) -> None:
    """Two run folders side by side: spec difference, latency per bucket, totals, outputs."""
    import json

    from rich.console import Console

    from .compare import compare as compare_runs, print_compare

    try:
        result = compare_runs(a, b)
    except GraphrunError as err:
        _fail(err)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        print_compare(result, Console(width=120))


@main.command()
@click.argument("dirs", nargs=-1, required=True,
                type=click.Path(file_okay=False, path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("report.html"), show_default=True, help="The HTML file to write.")
def report(dirs, out) -> None:
    """One self-contained HTML page of charts from run folders (compared) or a sweep folder."""
    from .report import write_report

    try:
        click.echo(f"wrote {write_report(list(dirs), out)}")
    except GraphrunError as err:
        _fail(err)


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--grid", "grids", multiple=True, metavar="KEY=[V1,V2,...]",
              help="A spec key and the values to try (repeatable; every combination runs).")
@click.option("--stop", type=click.IntRange(min=1), default=None,
              help="Each variant runs on the first N records.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The sweep's folder: one subfolder per variant, sweep.json.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key in every variant (repeatable).")
def sweep(spec, grids, stop, out, overrides) -> None:
    """Run every combination of the grid as a spec variant, side by side."""
    from rich.console import Console

    from .sweep import parse_grid, sweep as run_sweep
    from .sweep_report import sweep_table

    try:
        result = run_sweep(spec, parse_grid(grids), out, stop=stop, base=list(overrides),
                           echo=lambda msg: click.echo(msg, err=True))
    except GraphrunError as err:
        _fail(err)
    Console(width=160).print(sweep_table(result))
    click.echo(f"-> {out}/sweep.json; charts: graphrun report {out}")


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--iters", type=click.IntRange(min=1), default=50, show_default=True,
              help="Timed steps per bucket and mode.")
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True,
              help="Untimed steps per bucket and mode before timing.")
@click.option("--compile", "with_compile", is_flag=True,
              help="Also model.compile: true and torch.compile reduce-overhead (GPU).")
@click.option("--records", type=click.IntRange(min=1), default=None,
              help="Inputs from the first N real records (default: synthetic).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for bench.json (default: the spec's output.dir/bench).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key (repeatable).")
def bench(spec, iters, warmup, with_compile, records, out, overrides) -> None:
    """Time every bucket: eager, graph replay (and compiled), with speedups; no outputs."""
    from rich.console import Console

    from .bench import bench as run_bench, bench_table
    from .spec_load import load_spec

    try:
        pipeline = load_spec(spec, overrides)
        if pipeline.auto_axes:
            from .auto_buckets import resolve_auto

            pipeline = resolve_auto(pipeline)[0]
        result = run_bench(pipeline, iters=iters, warmup=warmup, compile=with_compile,
                           records=records, log=lambda msg: click.echo(msg, err=True))
    except GraphrunError as err:
        _fail(err)
    dest = Path(out or pipeline.output.dir / "bench")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "bench.json").write_text(result.model_dump_json(indent=2) + "\n")
    Console(width=140).print(bench_table(result))
    for note in result.notes:
        click.echo(f"note: {note}")
    click.echo(f"-> {dest}/bench.json")


@main.command()
@click.argument("specs", nargs=-1, required=True,
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key before validating (repeatable).")
def validate(specs, overrides) -> None:
    """Check SPEC files: one line per file, every error with file:line:col."""
    from .spec_load import load_spec

    failed = 0
    for path in specs:
        try:
            load_spec(path, overrides)
            click.echo(f"{path}: ok")
        except GraphrunError as err:
            if _debug:
                raise
            failed += 1
            click.echo(f"{path}: invalid\n{err}", err=True)
    sys.exit(1 if failed else 0)


@main.command()
@click.argument("kind", type=click.Choice(["pipeline", "manifest", "all"]), default="all")
@click.option("--check", is_flag=True, help="Exit 1 if the checked-in schema is stale.")
@click.option("--stdout", "to_stdout", is_flag=True, help="Print instead of writing the file.")
def schema(kind, check, to_stdout) -> None:
    """Write (or --check) schemas/{pipeline,manifest}.schema.json and the README's spec
    reference from the models."""
    from .schemas import README, path_of, readme_with_reference, render

    stale = []
    targets = [(k, path_of(k), render(k))
               for k in (("pipeline", "manifest") if kind == "all" else (kind,))]
    if kind in ("all", "pipeline") and README.is_file() and not to_stdout:
        targets.append(("readme", README, readme_with_reference(README.read_text())))
    for k, path, text in targets:
        if to_stdout:
            click.echo(text, nl=False)
        elif check:
            current = path.read_text() if path.is_file() else None
            if current != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            click.echo(f"wrote {path}")
    if stale:
        click.echo("stale schema(s): " + ", ".join(stale) + "; run `graphrun schema` and commit",
                   err=True)
        sys.exit(1)
    if check:
        click.echo("schemas are current")
