"""graphrun: run PyTorch inference through CUDA Graphs, driven by one YAML file."""

from graphrun.base.errors import (CaptureError, GraphrunError, InputError, Interrupted,
                                  ModelError, OutputError, SpecError)
from graphrun.base.version import __version__
from graphrun.spec.load import load_spec


def run(spec, **kwargs):
    """The whole job: the spec's input file -> outputs + manifest (see job/spine.run)."""
    from graphrun.job.spine import run as _run

    return _run(spec, **kwargs)


def __getattr__(name):
    if name == "Runner":  # imports torch; `graphrun validate` need not pay for it
        from graphrun.engine import Runner

        return Runner
    if name == "ray":  # graphrun.ray.dataset_map without its own import; Ray loads on use
        import importlib

        return importlib.import_module("graphrun.ray")
    raise AttributeError(name)


__all__ = ["load_spec", "run", "Runner", "GraphrunError", "SpecError", "InputError",
           "ModelError", "CaptureError", "OutputError", "Interrupted", "__version__"]
