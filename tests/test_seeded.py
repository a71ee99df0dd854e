"""The seeded init (models/seeded.py): splitmix64 in torch ops, values independent of the device
and of chunking, PyTorch defaults' scales, a rule for every tensor; the builtins built with it."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from graphrun.base.errors import ModelError
from graphrun.models.builtin import seeded
from graphrun.models.builtin.decoder import build_decoder
from graphrun.models.load import build_model
from graphrun.models.builtin.mlp import build_mlp
from graphrun.models.builtin.seeded import Constant, NoInitRule, Uniform, materialise
from graphrun.spec.keys import PipelineSpec

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
DECODER_ARGS = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 50, "max_len": 16,
                "max_batch": 4}
MASK = 2**64 - 1


def reference_splitmix64(state: int, n: int) -> list[int]:
    """Vigna's splitmix64 in Python ints, the outputs as uint64."""
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(z ^ (z >> 31))
    return out


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def drawn(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors drawn at random (not the constant ones: norms' 1 and 0, zero biases)."""
    return {k: v for k, v in model.state_dict().items() if v.unique().numel() > 1}


# splitmix64 and the values it gives.

@pytest.mark.parametrize("state", [0, 1, -1, 2**63 - 1, -2**63, seeded.stream(7, "fc.weight")])
def test_torch_splitmix64_equals_the_reference_bit_for_bit(state):
    got = seeded.splitmix64(state, 0, 300, CPU).tolist()
    assert [v & MASK for v in got] == reference_splitmix64(state & MASK, 300)
    tail = seeded.splitmix64(state, 250, 300, CPU).tolist()  # a chunk starting mid-stream
    assert tail == got[250:]


def test_splitmix64_first_output_is_the_published_one():
    assert seeded.splitmix64(0, 0, 1, CPU).item() & MASK == 0xE220A8397B1DCDAF


def test_streams_depend_on_seed_and_name_not_on_the_process():
    assert len({seeded.stream(s, n) for s in (0, 1) for n in ("a.weight", "a.bias")}) == 4
    # blake2b, not hash(): pinned, so the same spec gives the same model in every process
    assert seeded.stream(0, "fc.weight") == 3783205402695081086
    assert -2**63 <= seeded.stream(123, "x") < 2**63


def test_values_do_not_depend_on_the_chunk_size():
    whole = seeded.uniform_values(11, 1000, 0.5, CPU, torch.float32)
    assert torch.equal(seeded.uniform_values(11, 1000, 0.5, CPU, torch.float32, chunk=7), whole)


def test_uniform_values_are_the_top_24_bits_as_signed_scaled_exactly():
    top = [(b & MASK) >> 40 for b in seeded.splitmix64(5, 0, 64, CPU).tolist()]
    want = torch.tensor([(t - 2**24 if t >= 2**23 else t) / 2**23 for t in top])
    assert torch.equal(seeded.uniform_values(5, 64, 1.0, CPU, torch.float32), want)


def test_a_lower_dtype_is_the_float32_values_rounded():
    full = seeded.uniform_values(3, 5000, 0.1, CPU, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(seeded.uniform_values(3, 5000, 0.1, CPU, dtype), full.to(dtype))


def test_a_big_linear_weight_has_pytorch_defaults_scale():
    with torch.device("meta"):
        lin = nn.Linear(1024, 2048)
    materialise(lin, seed=0)
    w, bound = lin.weight, 1 / math.sqrt(1024)
    assert w.shape == (2048, 1024) and w.device == CPU and w.dtype == torch.float32
    assert w.abs().max() <= bound and w.abs().max() > 0.999 * bound
    assert abs(w.mean().item()) < 3 * (bound / math.sqrt(3)) / math.sqrt(w.numel())
    assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.01)
    assert lin.bias.abs().max() <= bound and lin.bias.unique().numel() > 1900
    assert isinstance(lin.weight, nn.Parameter) and lin.weight.requires_grad


def test_default_rules_for_embedding_and_norms_and_conv():
    with torch.device("meta"):
        model = nn.ModuleDict({"emb": nn.Embedding(4000, 64), "norm": nn.LayerNorm(64),
                               "conv": nn.Conv2d(3, 8, kernel_size=3)})
    materialise(model, seed=0)
    assert model["emb"].weight.std().item() == pytest.approx(1.0, rel=0.02)
    assert torch.equal(model["norm"].weight, torch.ones(64))
    assert torch.equal(model["norm"].bias, torch.zeros(64))
    assert model["conv"].weight.abs().max() <= 1 / math.sqrt(3 * 3 * 3)


def test_a_tensor_without_a_rule_raises_naming_it():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), Odd())
    with pytest.raises(NoInitRule, match=r"'1.scale' \(Odd.scale\): give Odd a seeded_init"):
        materialise(model, seed=0)


def test_a_module_hook_and_a_rules_table_give_the_rule():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(3))
            self.register_buffer("offset", torch.empty(2))
            self.register_buffer("steps", torch.empty(2, dtype=torch.int64), persistent=False)

        def seeded_init(self, name):
            return Constant(2.0) if name == "scale" else None

    with torch.device("meta"):
        model = Scaled()
    materialise(model, seed=0, rules={Scaled: lambda m, name: Uniform(0.25)})
    assert torch.equal(model.scale, torch.full((3,), 2.0))
    assert model.offset.abs().max() <= 0.25 and not model.offset.is_meta
    assert model.steps.is_meta  # non-persistent: scratch, the model's own to fill


def test_an_integer_state_tensor_raises():
    with torch.device("meta"):
        model = nn.Module()
        model.register_buffer("count", torch.empty(1, dtype=torch.int64))
    with pytest.raises(NoInitRule, match="'count' is torch.int64: seeded init draws floats"):
        materialise(model, seed=0, rules={nn.Module: lambda m, name: Uniform(1.0)})


def test_tied_parameters_stay_tied():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    materialise(model, seed=0)
    assert model[1].weight is model[0].weight and not model[0].weight.is_meta


# The builtins.

@pytest.mark.parametrize("build, args", [(build_mlp, {"in_features": 8, "hidden": 32}),
                                         (build_decoder, DECODER_ARGS)])
def test_same_arguments_same_weights_other_seed_other_weights(build, args):
    rng = torch.get_rng_state()
    a, b, other = build(**args), build(**args), build(**args, seed=1)
    assert torch.equal(torch.get_rng_state(), rng)
    sa, sb, so = state_of(a), state_of(b), state_of(other)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(not torch.equal(sa[k], so[k]) for k in drawn(a))


@pytest.mark.parametrize("build, args", [(build_mlp, {"in_features": 8, "hidden": 32}),
                                         (build_decoder, DECODER_ARGS)])
def test_no_two_tensors_of_a_model_share_values(build, args):
    heads = {k: v.flatten()[:32] for k, v in drawn(build(**args)).items()}
    assert len(heads) > 5
    for (ka, a), (kb, b) in itertools.combinations(heads.items(), 2):
        assert not torch.equal(a, b[:a.numel()]), (ka, kb)


def test_decoder_keeps_its_scales_and_makes_its_scratch_on_the_device_in_dtype():
    model = build_decoder(**DECODER_ARGS, dtype=torch.bfloat16)
    assert {t.dtype for t in model.parameters()} == {torch.bfloat16}
    w = model.tok_emb.weight.float()
    bound = 0.02 * math.sqrt(3) * (1 + 2**-8)  # within bfloat16's rounding
    assert w.abs().max() <= bound and w.std().item() == pytest.approx(0.02, rel=0.1)
    assert not model.blocks[0].attn.qkv.bias.any()
    attn = model.blocks[0].attn
    assert attn.ctx_k.float().std().item() == pytest.approx(0.5, rel=0.1)
    assert attn.cache_k.dtype == torch.bfloat16 and attn.cache_k.shape == (4, 4, 16, 8)
    assert torch.equal(attn.cache_v, attn.ctx_v.expand(4, -1, -1, -1))
    assert torch.equal(model.key_pos, torch.arange(16))
    float32 = build_decoder(**DECODER_ARGS)
    assert all(torch.equal(v, state_of(float32)[k].to(torch.bfloat16))
               for k, v in state_of(model).items())


def test_on_the_meta_device_nothing_is_made_and_a_load_makes_the_scratch():
    model = build_decoder(**DECODER_ARGS, device="meta")
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.key_pos is None and model.blocks[0].attn.cache_k is None
    saved = build_decoder(**DECODER_ARGS, seed=4)
    model.load_state_dict(saved.state_dict(), assign=True)
    assert torch.equal(model.blocks[1].attn.cache_v, saved.blocks[1].attn.cache_v)
    assert torch.equal(model.key_pos, torch.arange(16))


@pytest.mark.slow
def test_building_on_meta_imports_nothing_heavy():
    """A meta normal_ or arange imports torch._dynamo (seconds of a run's start-up)."""
    code = ("import sys; from graphrun.models.builtin.decoder import build_decoder; "
            "from graphrun.models.builtin.mlp import build_mlp; build_decoder(device='meta'); "
            "build_mlp(device='meta'); print(sorted({'torch._dynamo', 'sympy'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert done.stdout.strip() == "[]"


def builtin_spec(builtin: str, args: dict, dtype: str = "float32") -> PipelineSpec:
    return PipelineSpec.model_validate({
        "version": 1, "name": "t", "model": {"builtin": builtin, "args": args, "dtype": dtype},
        "inputs": {"x": {"shape": ["batch", 8]}}, "outputs": {"y": {"shape": ["batch", 4]}},
        "buckets": {"batch": [1, 4]}, "data": {"path": "/nonexistent/d.jsonl"},
        "output": {"dir": "/nonexistent/out"}})


def test_build_model_makes_the_builtin_in_the_spec_dtype():
    args = {k: v for k, v in DECODER_ARGS.items() if k != "max_batch"}
    model = build_model(builtin_spec("decoder", args, "bfloat16"), CPU)
    direct = build_decoder(**DECODER_ARGS, dtype=torch.bfloat16)
    assert all(torch.equal(v, state_of(direct)[k]) for k, v in state_of(model).items())


@pytest.mark.parametrize("key", ["device", "dtype"])
def test_device_or_dtype_in_builtin_args_is_refused(key):
    with pytest.raises(ModelError, match=f"model.args.{key}: graphrun sets a builtin's {key}"):
        build_model(builtin_spec("mlp", {key: "cpu"}), CPU)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_and_cuda_builds_are_bitwise_equal(dtype):
    cuda = torch.device("cuda")
    for build, args in [(build_mlp, {"in_features": 64, "hidden": 256}),
                        (build_decoder, DECODER_ARGS | {"vocab": 5000})]:
        on_cpu, on_gpu = state_of(build(**args, dtype=dtype)), build(**args, device=cuda,
                                                                     dtype=dtype)
        assert all(t.device.type == "cuda" for t in [*on_gpu.parameters(), *on_gpu.buffers()])
        for k, v in state_of(on_gpu).items():
            assert torch.equal(v.cpu(), on_cpu[k]), k
    big = seeded.uniform_values(9, 3 * 2**24 + 5, 0.1, cuda, dtype)  # several device chunks
    assert torch.equal(big.cpu(), seeded.uniform_values(9, 3 * 2**24 + 5, 0.1, CPU, dtype))


def test_on_meta_skips_initialisers_of_meta_tensors_only():
    with seeded.on_meta():
        emb = nn.Embedding(10, 4)  # its normal_ on meta would import torch._dynamo
        kept = torch.zeros(3, device="cpu").fill_(2.0)
    assert emb.weight.is_meta and torch.equal(kept, torch.full((3,), 2.0))
