"""graphrun: run PyTorch inference through CUDA Graphs, driven by one YAML file."""

__version__ = "0.1.0"

from .errors import (CaptureError, GraphrunError, InputError, Interrupted,  # noqa: E402
                     ModelError, OutputError, SpecError)
from .spec_load import load_spec  # noqa: E402


def run(spec, **kwargs):
    """The whole job: the spec's input file -> outputs + manifest (see pipeline.run)."""
    from .pipeline import run as _run

    return _run(spec, **kwargs)


def __getattr__(name):
    if name == "Runner":  # imports torch; `graphrun validate` need not pay for it
        from .engine import Runner

        return Runner
    if name == "ray":  # graphrun.ray.dataset_map without its own import; Ray loads on use
        import importlib

        return importlib.import_module("graphrun.ray")
    raise AttributeError(name)


__all__ = ["load_spec", "run", "Runner", "GraphrunError", "SpecError", "InputError",
           "ModelError", "CaptureError", "OutputError", "Interrupted", "__version__"]
