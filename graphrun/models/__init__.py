"""The model step of the flow: builtin reference models and loading the spec's model.

The names below are imported when first asked for: a process that only tokenizes text (a JSONL
child process reading data.text) imports models.hf's tokenizer helpers without torch."""

__all__ = ["BUILTINS", "build_model", "call_model", "name_outputs"]


def __getattr__(name: str):
    if name in ("call_model", "name_outputs"):
        from graphrun.models import call
        return getattr(call, name)
    if name in ("BUILTINS", "build_model"):
        from graphrun.models import load
        return getattr(load, name)
    raise AttributeError(f"module 'graphrun.models' has no attribute {name!r}")
