"""models/heads.py: outputs picked and reduced inside the step, against plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from graphrun.base.errors import ModelError
from graphrun.models.heads import Heads
from graphrun.spec.keys import OutputSpec


class Fields(nn.Module):
    """Returns a dict, as a transformers model does: hidden [B, S, 4] and logits [B, S, 10]."""

    def forward(self, input_ids, attention_mask):
        hidden = torch.stack([input_ids.float(), -input_ids.float(), input_ids.float() ** 2,
                              torch.ones_like(input_ids).float()], -1)
        logits = torch.arange(10.0) * input_ids.float().unsqueeze(-1)
        return {"last_hidden_state": hidden, "logits": logits}


def heads(**outputs) -> Heads:
    specs = {n: OutputSpec.model_validate(o) for n, o in outputs.items()}
    return Heads(Fields(), specs, ["input_ids", "attention_mask"], "keyword")


IDS = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def test_mean_pool_counts_only_real_positions_and_l2_normalize():
    out = heads(e={"shape": ["batch", 4], "from": "last_hidden_state",
                   "reduce": ["mean_pool", "l2_normalize"]})(input_ids=IDS, attention_mask=MASK)
    hidden = Fields()(IDS, MASK)["last_hidden_state"]
    want = torch.stack([hidden[0, :3].mean(0), hidden[1, :2].mean(0)])
    torch.testing.assert_close(out["e"], F.normalize(want, dim=-1))


def test_cls_last_pool_softmax_argmax_topk_and_cast():
    out = heads(
        cls={"shape": ["batch", 4], "from": "last_hidden_state", "reduce": ["cls_pool"]},
        last={"shape": ["batch", 10], "from": "logits", "reduce": ["last_pool"]},
        arg={"shape": ["batch"], "from": "logits", "reduce": ["last_pool", "argmax"]},
        ids={"shape": ["batch", 3], "from": "logits", "reduce": ["last_pool", "softmax"],
             "topk": {"k": 3}},
        vals={"shape": ["batch", 3], "from": "logits", "reduce": ["last_pool", "softmax"],
              "topk": {"k": 3, "take": "values"}, "dtype": "float16"},
    )(input_ids=IDS, attention_mask=MASK)
    logits = Fields()(IDS, MASK)["logits"]
    last = torch.stack([logits[0, 2], logits[1, 1]])  # the last real position of each row
    torch.testing.assert_close(out["cls"], Fields()(IDS, MASK)["last_hidden_state"][:, 0])
    torch.testing.assert_close(out["last"], last)
    assert out["arg"].tolist() == [9, 9]
    probs = torch.softmax(last, -1)
    assert out["ids"].tolist() == probs.topk(3).indices.tolist()
    assert out["vals"].dtype == torch.float16
    torch.testing.assert_close(out["vals"], probs.topk(3).values.half())


def test_unknown_field_and_pool_of_a_flat_tensor_say_what_is_there():
    with pytest.raises(ModelError, match="no field 'pooler_output' .*last_hidden_state, logits"):
        heads(p={"shape": ["batch", 4], "from": "pooler_output"})(input_ids=IDS,
                                                                 attention_mask=MASK)
    with pytest.raises(ModelError, match="mean_pool needs a \\[batch, seq, ...\\] tensor"):
        heads(p={"shape": ["batch"], "from": "logits",
                 "reduce": ["last_pool", "mean_pool"]})(input_ids=IDS, attention_mask=MASK)


def test_the_spec_refuses_unknown_steps_and_argmax_before_the_end():
    with pytest.raises(ValidationError, match="mean_pool"):
        OutputSpec.model_validate({"shape": ["batch"], "reduce": ["max_pool"]})
    with pytest.raises(ValidationError, match="argmax must be the last step"):
        OutputSpec.model_validate({"shape": ["batch"], "reduce": ["argmax", "softmax"]})
    with pytest.raises(ValidationError, match="greater than 0"):
        OutputSpec.model_validate({"shape": ["batch"], "topk": {"k": 0}})
