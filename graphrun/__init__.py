"""graphrun: run PyTorch inference through CUDA Graphs, driven by one YAML file."""

import sys
import types

from graphrun.base.errors import (CaptureError, GraphrunError, InputError, Interrupted,
                                  ModelError, OutputError, SpecError)
from graphrun.base.version import __version__
from graphrun.spec.load import load_spec


def run(spec, **kwargs):
    """The whole job: the spec's input file -> outputs + manifest (see job/spine.run)."""
    from graphrun.job.spine import run as _run

    return _run(spec, **kwargs)


def generate(model_or_spec, prompts, **params):
    """Completions of prompts, in order, in-process (see graphrun.LLM and llm/llm.py)."""
    from graphrun.llm import generate as _generate

    return _generate(model_or_spec, prompts, **params)


def chat(model_or_spec, conversations, **params):
    """Completions of chat conversations, in order, in-process (see graphrun.LLM)."""
    from graphrun.llm import chat as _chat

    return _chat(model_or_spec, conversations, **params)


class _CallablePackage(types.ModuleType):
    """graphrun.generate once the package of that name is imported (the import binds the
    package to the root's name): the package, callable as the function above."""

    def __call__(self, model_or_spec, prompts, **params):
        from graphrun.llm import generate as _generate

        return _generate(model_or_spec, prompts, **params)


class _Root(types.ModuleType):
    def __setattr__(self, name, value):
        if name == "generate" and isinstance(value, types.ModuleType):
            value.__class__ = _CallablePackage
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Root


def __getattr__(name):
    if name == "Runner":  # imports torch; `graphrun validate` need not pay for it
        from graphrun.engine import Runner

        return Runner
    if name in ("LLM", "GenerateOutput"):  # torch too
        import graphrun.llm

        return getattr(graphrun.llm, name)
    if name == "ray":  # graphrun.ray.dataset_map without its own import; Ray loads on use
        import importlib

        return importlib.import_module("graphrun.ray")
    raise AttributeError(name)


__all__ = ["load_spec", "run", "Runner", "LLM", "GenerateOutput", "generate", "chat",
           "GraphrunError", "SpecError", "InputError", "ModelError", "CaptureError",
           "OutputError", "Interrupted", "__version__"]
