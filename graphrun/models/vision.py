"""timm vision models named in the spec (model.timm): built by name with their arguments,
with seeded random weights (model.weights, when given, replaces them)."""

from __future__ import annotations

import torch
from torch import nn

from graphrun.base.errors import ModelError
from graphrun.base.extras import install_hint
from graphrun.base.phases import LIBRARY_IMPORTS, phase


def load_timm(spec_timm) -> nn.Module:
    try:
        with phase(LIBRARY_IMPORTS.format("timm")):  # timm imports torchvision
            import timm
    except Exception as e:  # noqa: BLE001 - timm imports torchvision, which can fail to load
        raise ModelError(f"model.timm needs timm, which could not be imported ({type(e).__name__}:"
                         f" {e}); install it: {install_hint('vision')}; timm imports torchvision: "
                         "install the torchvision build that matches your torch") from None
    if not timm.is_model(spec_timm.name):
        close = timm.list_models(f"*{spec_timm.name[:6]}*")[:8]
        raise ModelError(f"model.timm.name: timm has no model {spec_timm.name!r}"
                         + (f"; similar: {', '.join(close)}" if close else ""))
    # the seed of the random weights only, not the process's random state
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec_timm.seed)
        try:
            return timm.create_model(spec_timm.name, pretrained=False, **spec_timm.args)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ModelError(f"model.timm {spec_timm.name!r} could not be built from args "
                             f"{spec_timm.args}: {type(e).__name__}: {e}") from e
