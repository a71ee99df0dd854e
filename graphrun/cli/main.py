"""The command line: a thin layer over the Python API.

A user error (GraphrunError) prints one message and exits non-zero, without a traceback unless
--debug is given (errors.py); anything else is a bug in graphrun and keeps its traceback.
This module holds the group and the verbs of a run (run, validate, schema, init); the experiment
verbs are experiments.py's.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from graphrun.base import phases  # first: its import is graphrun's first clock (phases.FIRST_CLOCK)
from graphrun.base import envs
from graphrun.base.version import __version__
from graphrun.base.errors import debugging
from graphrun.cli.errors import debug_option, exit_quietly, fail
from graphrun.cli.experiments import EXPERIMENT_COMMANDS
from graphrun.base.errors import GraphrunError, Interrupted
from graphrun.scale.local.world import World


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="graphrun")
@debug_option
def main() -> None:
    """graphrun: run PyTorch inference through CUDA Graphs, driven by one YAML file."""


for experiment in EXPERIMENT_COMMANDS:  # plan, compare, report, sweep, bench
    main.add_command(experiment)


def entry() -> None:
    """The console script and `python -m graphrun`: main, then an exit without the
    interpreter's teardown where that is safe (fast_exit.py); tests call main itself."""
    from graphrun.cli.fast_exit import finish

    try:
        main(standalone_mode=True)
    except SystemExit as done:
        finish(done.code)
        raise


def check_ray_options(use_ray: bool, address, workers, start: int, stop, gpus) -> None:
    if not use_ray and (address or workers):
        fail(GraphrunError("--address and --workers go with --ray; add --ray"))
    if use_ray and (start or stop is not None):
        fail(GraphrunError("--start and --stop do not go with --ray: Ray reads the whole input"))
    if use_ray and gpus is not None:
        fail(GraphrunError("--gpus and --ray are two ways to scale out: --gpus N for the GPUs "
                           "of this host, --ray for a Ray cluster (its actors take a GPU each)"))


@main.command()
@debug_option
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key, e.g. --set capture.warmup_iters=5 (repeatable).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Output folder (default: the spec's output.dir).")
@click.option("--resume", is_flag=True, help="Continue an interrupted run in the output folder.")
@click.option("--overwrite", is_flag=True, help="Replace graphrun's files in the output folder.")
@click.option("--accept-model-change", is_flag=True,
              help="With --resume: go on although a model file (weights, archive, target "
                   "source) changed, for a change that does not alter outputs (a fix).")
@click.option("--start", type=click.IntRange(min=0), default=0,
              help="First input record to read (for one slice per process).")
@click.option("--stop", type=click.IntRange(min=0), default=None,
              help="Input record to stop before.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or summary table.")
@click.option("--report", "with_report", is_flag=True,
              help="Also write report.html (charts) beside manifest.json.")
@click.option("--gpus", metavar="N|all", default=None,
              help="One worker process per GPU, each on its share of the records, into one "
                   "output folder (with device: cpu, N CPU worker processes). --start/--stop "
                   "select the records the workers share.")
@click.option("--ray", "use_ray", is_flag=True,
              help="Run on a Ray cluster through Ray Data (needs the ray extra).")
@click.option("--address", default=None, metavar="ADDR",
              help="With --ray: the cluster to join (default: RAY_ADDRESS, else a local one).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="With --ray: actors in the pool (default: one per GPU; on CPUs, all but one).")
def run(spec, overrides, out, resume, overwrite, accept_model_change, start, stop, quiet,
        with_report, gpus, use_ray, address, workers) -> None:
    """Run SPEC: read its input, replay every batch, write outputs and manifest.json."""
    clock = phases.PhaseClock()  # the manifest's phases, from the process's start
    with clock.active(), clock.phase(phases.IMPORTS):
        from graphrun.spec.load import load_spec  # no torch: a spec's errors are found before it

    if resume and overwrite:
        fail(GraphrunError("--resume and --overwrite contradict each other: pick one"))
    check_ray_options(use_ray, address, workers, start, stop, gpus)
    if stop is not None and stop < start:  # else a traceback, or under --gpus 0 records "completed"
        fail(GraphrunError(f"--stop {stop} is before --start {start}: give --stop at least "
                           "--start (it is the record to stop before), or leave it out"))
    show = not quiet  # a progress bar on a terminal, else a line every few seconds (logs, CI)
    try:
        with HeldInterrupt():  # a SIGINT inside an import would leave a module half-made
            with clock.active(), clock.phase("spec"):
                pipeline = load_spec(spec, overrides)
            if gpus is None:  # a --gpus parent only starts and watches its workers: no torch
                import_engine(pipeline, clock, alone=not use_ray)
        manifest = _run(pipeline, spec, overrides, gpus, (use_ray, address, workers), clock,
                        out=out, resume=resume, overwrite=overwrite, show=show, start=start,
                        stop=stop, accept_model_change=accept_model_change)
        if manifest is None:  # a worker of a job that another process watches: quiet
            return
    except KeyboardInterrupt:  # SIGINT before the run took over its signals (loading the spec)
        exit_quietly()
        click.echo("graphrun: interrupted by SIGINT before the run started; nothing was "
                   "written", err=True)
        sys.exit(128 + signal.SIGINT)
    except Interrupted as err:
        exit_quietly()
        click.echo(f"graphrun: {err}", err=True)
        sys.exit(err.exit_code)
    except GraphrunError as err:
        exit_quietly()
        fail(err)
    else:
        exit_quietly()
        t = manifest.totals
        dest = out or pipeline.output.dir
        if manifest.already_complete:
            click.echo(f"already complete: {t.records_out} records out, {t.records_rejected} "
                       f"rejected -> {dest}/manifest.json; nothing to resume")
            if t.records_rejected and not t.records_out:  # as the run itself exited: 1, not 0
                click.echo(f"graphrun: every record ({t.records_rejected}) was rejected; see "
                           f"{dest}/rejects.jsonl", err=True)
                sys.exit(1)
            return
        if not quiet:
            # a resumed run's totals hold the earlier attempts'; its batches are this one's
            before = t.earlier_records_out + t.earlier_records_rejected
            resumed = (f" ({t.earlier_records_out} out and {t.earlier_records_rejected} "
                       f"rejected before this --resume)" if before else "")
            click.echo(f"{manifest.status}: {t.records_out} records out, {t.records_rejected} "
                       f"rejected{resumed}, {t.batches} batches, {t.records_per_s:,.0f} "
                       f"records/s -> {dest}/manifest.json")
        if with_report:
            from graphrun.experiments.report import write_report

            try:
                written = write_report([Path(dest)], Path(dest) / "report.html")
            except GraphrunError as err:
                fail(err)
            if not quiet:
                click.echo(f"report -> {written}")
        if manifest.status == "completed" and not t.records_out and not t.records_rejected:
            # an empty shard of a larger job is no error, but a wrong path or filter often is
            if start or stop is not None:  # the slice was empty, not the file
                span = f"--start {start}" + (f" --stop {stop}" if stop is not None else "")
                fewer = f" (it holds {start} or fewer)" if start and (
                    stop is None or stop > start) else ""
                click.echo(f"graphrun: warning: {span} selected no record of "
                           f"{pipeline.data.path}{fewer}; the outputs are empty", err=True)
            else:
                click.echo(f"graphrun: warning: the input held no records "
                           f"({pipeline.data.path}); the outputs are empty", err=True)
        if manifest.status == "completed" and t.records_rejected and not t.records_out:
            # nothing came out: a script's next step must not take that for success
            click.echo(f"graphrun: every record ({t.records_rejected}) was rejected; see "
                       f"{dest}/rejects.jsonl", err=True)
            sys.exit(1)


class HeldInterrupt:
    """SIGINT held while the spec loads and torch and the engine import, then raised as
    KeyboardInterrupt once they are done: raised inside an import, it can leave numpy or torch
    half-imported (a later AttributeError, or an import lock's callback swallowing it and the
    run going on). A second SIGINT meanwhile ends the process at once. Off the main thread
    (where no signal handler can be set) it does nothing."""

    def __enter__(self) -> "HeldInterrupt":
        import threading

        self.got, self.previous = False, None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._held)
        return self

    def _held(self, signum, frame) -> None:
        if self.got:  # asked twice: no waiting for the imports
            import os

            os.write(2, b"graphrun: interrupted by SIGINT before the run started; nothing was "
                        b"written\n")
            os._exit(128 + signal.SIGINT)
        self.got = True

    def __exit__(self, kind, value, tb) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        if self.got and kind is None:
            raise KeyboardInterrupt


def import_engine(pipeline, clock, alone: bool) -> None:
    """torch and the engine the spec runs on (a generation job's or a forward pass's, not
    both), timed as imports. For a run in this process alone (no --gpus, --ray or torchrun),
    its device starts on a thread first, beside them (device_start.py), and a generation
    job's kernels are warmed on another (models/causal/warm.py)."""
    alone = alone and World.from_env() is None
    with clock.active(), clock.phase(phases.IMPORTS):
        if alone and pipeline.device != "cpu":
            from graphrun.engine.driver import gpu_possible, start_driver_beside

            start_driver_beside()  # the driver starts while torch imports
            if (pipeline.generate is not None and envs.switch("GRAPHRUN_KERNEL_WARM_UP", True)
                    and gpu_possible(pipeline.device)):
                from graphrun.base.triton_switch import prefetch_beside

                prefetch_beside()  # Triton's import and key, for the kernels' warm-up
        from graphrun.engine.device_start import DeviceStart  # torch

        if alone:
            started = DeviceStart.begin(pipeline)
            if pipeline.generate is not None:  # its kernels too, beside the imports
                from graphrun.generate.runner import begin_warm_up

                begin_warm_up(pipeline, started)
        from graphrun.job.parts import import_parts
        import graphrun.job.spine  # noqa: F401

        import_parts(pipeline)


def _run(pipeline, spec: Path, overrides, gpus: str | None, ray, clock, **ask):
    """One process's run, a job of several workers (--gpus, or WORLD_SIZE set: torchrun), or
    a Ray Data job (--ray). clock: the process's phases so far (one process's manifest)."""
    use_ray, address, workers = ray
    if use_ray:
        from graphrun.scale.ray.run import run_ray

        return run_ray(pipeline, address=address, workers=workers,
                       **{k: ask[k] for k in ("out", "overwrite", "resume", "show")})

    world = World.from_env()
    if gpus is None and world is None:
        from graphrun.job.spine import run as run_pipeline

        return run_pipeline(pipeline, clock=clock, **ask)
    from graphrun.scale.local.command import run_job

    return run_job(pipeline, spec, overrides, gpus=gpus, world=world, **ask)


@main.command()
@debug_option
@click.argument("specs", nargs=-1, required=True,
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key before validating (repeatable).")
@click.option("--load", is_flag=True,
              help="Also build the model and call it once per bucket, eagerly, on sample "
              "inputs (with the padding check): finds argument names, dtypes and shapes that "
              "do not fit the model before a long run. Reads no data, writes nothing.")
def validate(specs, overrides, load) -> None:
    """Check SPEC files: one line per file, every error with file:line:col."""
    from graphrun.spec.load import load_spec

    failed = 0
    for path in specs:
        try:
            spec = load_spec(path, overrides)
            if load:
                click.echo(f"{path}: ok (model built, called on each of {_load(spec)} buckets)")
            else:
                click.echo(f"{path}: ok")
        except GraphrunError as err:
            if debugging():
                raise
            failed += 1
            click.echo(f"{path}: invalid\n{err}", err=True)
    sys.exit(1 if failed else 0)


def _load(spec) -> int:
    """Build the spec's model and run each bucket once eagerly (the Runner's setup with the
    eager backend: one call per bucket, then verify's replay and padding checks)."""
    from graphrun.engine import Runner
    from graphrun.generate.records import with_implied_io
    from graphrun.plan.auto import resolve_auto

    # `auto` axes planned from the data first, as the run plans them
    spec, _ = resolve_auto(with_implied_io(spec.model_copy(deep=True)))
    spec.capture.backend = "eager"
    spec.capture.lazy = False  # every bucket checked now, not on a first use that never comes
    spec.capture.verify.eager = True  # each bucket called, its pads checked, though none is captured
    spec.report.baseline = "none"
    log = lambda msg: click.echo(msg, err=True) if msg.startswith("warning:") else None  # noqa: E731
    if spec.generate is not None:  # prefill and two decode steps at every (batch, prompt) bucket
        from graphrun.generate.runner import GenerationRunner

        # the spec's max_new_tokens kept (it sizes the KV blocks and slots as the run's);
        # try_every_bucket ends each synthetic record after a few tokens
        runner = GenerationRunner(spec, log=log)
        try:
            return runner.try_every_bucket()
        finally:
            runner.close()
    with Runner(spec, log=log) as runner:
        return len(runner.states)


@main.command()
@debug_option
@click.argument("kind", type=click.Choice(["pipeline", "manifest", "all"]), required=False)
@click.option("--check", is_flag=True, help="Exit 1 if the written schemas are stale.")
@click.option("--stdout", "to_stdout", is_flag=True,
              help="Print one schema (pipeline unless named) instead of writing files.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Write (or --check) KIND.schema.json in this folder, nothing else.")
def schema(kind, check, to_stdout, out) -> None:
    """Print a JSON schema (--stdout), write it where --out says, or, run from inside a graphrun
    source checkout, rewrite (or --check) its schemas/ and the key table of its docs/spec.md."""
    from graphrun.manifest.schema import render

    if to_stdout:
        if kind == "all":
            fail(GraphrunError("--stdout prints one schema: name pipeline or manifest"))
        click.echo(render(kind or "pipeline"), nl=False)
        return
    kinds = ("pipeline", "manifest") if kind in (None, "all") else (kind,)
    targets = _schema_targets(kinds, out)
    stale = []
    for path, text in targets:
        if check:
            if (path.read_text() if path.is_file() else None) != text:
                stale.append(str(path))
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as err:
            fail(GraphrunError(f"cannot write {path}: {err.strerror or err}"))
        click.echo(f"wrote {path}")
    if stale:  # with --out, the command that rewrites them is that folder's, not the checkout's
        again = ("run `graphrun schema` and commit" if out is None else
                 f"run `graphrun schema{' ' + kind if kind else ''} --out {out}`")
        click.echo("stale schema(s): " + ", ".join(stale) + "; " + again, err=True)
        sys.exit(1)
    if check:
        click.echo("schemas are current")


def _schema_targets(kinds, out: Path | None) -> list[tuple[Path, str]]:
    """(file, text) to write: in --out, or in the checkout the working directory is in."""
    from graphrun.manifest.schema import (PACKAGE_DIR, SPEC_PAGE, checkout_root, path_of, render,
                                          runs_from, with_spec_reference)

    if out is not None:
        return [(path_of(k, out), render(k)) for k in kinds]
    root = checkout_root(Path.cwd())
    if root is None:
        fail(GraphrunError(
            f"{Path.cwd()} is not inside a graphrun source checkout, whose schemas/ and "
            "docs/spec.md this would rewrite: to write the schemas here, pass --out . ; to "
            "print one, --stdout (e.g. graphrun schema --stdout > pipeline.schema.json)"))
    if not runs_from(root):
        fail(GraphrunError(
            f"the graphrun running ({PACKAGE_DIR}) is not the checkout's "
            f"({root / 'graphrun'}), so its schemas would not describe that code: run "
            f"`python3 -m graphrun schema` from {root}, or pass --out"))
    targets = [(path_of(k, root / "schemas"), render(k)) for k in kinds]
    page = root / SPEC_PAGE
    if "pipeline" in kinds and page.is_file():
        targets.append((page, with_spec_reference(page.read_text())))
    return targets


@main.command()
@debug_option
@click.option("--model", "target", metavar="FILE.py:CALLABLE",
              help="The model's builder: 'file.py:build' or 'package.module:build'.")
@click.option("--builtin", metavar="NAME", help="A model shipped in graphrun (mlp, decoder).")
@click.option("--hf", metavar="DIR", help="A Hugging Face model folder (or a hub cache name) "
              "over a text file: embedding, next-token top-k or class by its config.json; "
              "needs the hf extra.")
@click.option("--arg", "args", multiple=True, metavar="KEY=VALUE",
              help="An argument for the builder, YAML-typed (repeatable): --arg vocab=1000.")
@click.option("--data", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The input file: .jsonl, .npy, .npz or .parquet.")
@click.option("-o", "--output", "spec_path", default="pipeline.yaml", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="The spec to write.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path),
              help="The spec's output.dir (default: runs/<the spec file's stem>, beside it).")
@click.option("--name", help="The pipeline's name (default: from the model).")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="data.batch_size; batch buckets are the powers of two below it, and it.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]),
              default="float32", show_default=True, help="model.dtype.")
@click.option("--id-field", help="The field holding record ids (default: guessed by name).")
@click.option("--text-field", metavar="FIELD[,FIELD]", help="With --hf: the text's field, or "
              "two joined by a comma for a pair a cross-encoder scores (query,passage); "
              "default: guessed by name.")
@click.option("--sample", type=click.IntRange(min=1), default=10000, show_default=True,
              help="Records read to learn the inputs.")
@click.option("--force", is_flag=True, help="Replace the spec file if it exists.")
@click.option("--task", type=click.Choice(["auto", "generate", "next-token"]), default="auto",
              show_default=True, help="With --hf: auto, what config.json's architecture "
              "computes in one pass (embedding, class; a causal LM over chat or Batch records "
              "generates, over text it asks which); generate, a generation job over a causal "
              "LM (prompts in, completions out); next-token, its next token's top k.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="With --task generate: generate.max_new_tokens [128].")
@click.option("--temperature", type=click.FloatRange(min=0), default=None,
              help="With --task generate: sample at this temperature (0 or none: greedy).")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None,
              help="With --temperature: nucleus sampling's top_p.")
@click.option("--top-k", type=click.IntRange(min=0), default=None,
              help="With --temperature: sample among the k most likely tokens (0: all).")
@click.option("--seed", type=int, default=None, help="With --temperature: the sampling seed.")
def init(target, builtin, hf, args, data, spec_path, out_dir, name, batch_size, dtype,
         id_field, text_field, sample, force, task, max_new_tokens, temperature, top_p, top_k,
         seed) -> None:
    """Write a spec for your model and data: inputs from the file, outputs from calling the
    model once, buckets from the records' sizes; prints what to check."""
    from graphrun.init.infer import init as init_spec
    from graphrun.init.hf import init_hf

    common = dict(data=data, spec_path=spec_path, out_dir=out_dir, name=name,
                  batch_size=batch_size, sample=sample, id_field=id_field, dtype=dtype,
                  force=force)
    try:
        if hf is None and text_field is not None:
            raise GraphrunError("--text-field names the text an --hf model tokenizes: give "
                                "--hf DIR too")
        if hf is None and any(v is not None for v in (max_new_tokens, temperature, top_p,
                                                       top_k, seed)):
            raise GraphrunError("--max-new-tokens and the sampling options are for a "
                                "generation job: give --hf DIR of a causal LM")
        if hf is None and task != "auto":
            raise GraphrunError(f"--task {task} needs --hf DIR: the folder of a causal "
                                "language model and its tokenizer")
        if hf is None:
            found = init_spec(target=target, builtin=builtin, args=_builder_args(args),
                              **common)
        elif target or builtin or args:
            raise GraphrunError("--hf takes the model from its folder: leave out --model, "
                                "--builtin and --arg")
        else:
            from graphrun.init.generate import Generation

            generation = Generation(max_new_tokens, temperature, top_p, top_k, seed)
            if generation.given and task == "next-token":
                raise GraphrunError("--max-new-tokens and the sampling options are a "
                                    "generation job's: use --task generate")
            found = init_hf(hf=hf, task=task, text_field=text_field, generation=generation,
                            **common)
    except GraphrunError as err:
        fail(err)
    click.echo(_init_report(found, spec_path))


def _builder_args(pairs) -> dict:
    import yaml

    args = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail(GraphrunError(f"--arg {pair!r}: expected KEY=VALUE, e.g. --arg vocab=1000"))
        try:
            args[key] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            fail(GraphrunError(f"--arg {pair!r}: the value is not YAML: {err}"))
    return args


def _init_report(found, spec_path: Path) -> str:
    p = found.profile
    lines = [f"wrote {spec_path} (and {found.schema_path.name} beside it, for editors)",
             f"read {p.sampled} records of {p.path.name}"
             + (f" (of {p.records})" if p.records else "")
             + (f"; ids: {p.id_field}" if p.id_field else "; no id field")]
    for n, f in found.inputs.items():
        lines.append(f"  input  {n}: [batch, {', '.join(map(str, f.dims))}] {f.dtype}".replace(
            ", ]", "]"))
    for n, (dims, dtype) in found.outputs.items():
        lines.append(f"  output {n}: [{', '.join(map(str, dims))}] {dtype}")
    for axis, values in found.buckets.items():
        lines.append(f"  buckets.{axis}: {values}")
    generate = getattr(found, "generate", None)
    if generate is not None:  # a generation job: no inputs or outputs of its own to call
        lines.append(f"  generate: {generate['max_new_tokens']} new tokens at most, "
                     f"{generate['sampling']['method']}; one completion per prompt")
    else:
        lines.append(f"  call ({found.call}): model("
                     + ", ".join(f"{n}=..." if found.call == "keyword" else n
                                 for n in found.inputs) + ")")
    lines.append("check:")
    lines += [f"  - {c}" for c in found.checks]
    lines.append(f"next: graphrun validate {spec_path} && graphrun run {spec_path}")
    return "\n".join(lines)
