"""The model step of the flow: builtin reference models and loading the spec's model."""

from graphrun.models.call import call_model, name_outputs
from graphrun.models.load import BUILTINS, build_model

__all__ = ["BUILTINS", "build_model", "call_model", "name_outputs"]
