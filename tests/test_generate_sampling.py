"""The pick inside the step: counter-based Gumbel draws whose frequencies match
softmax(logits / temperature), top-k and top-p limits, and record keys."""

from __future__ import annotations

import pytest
import torch

from graphrun.generate.config import Sampling
from graphrun.generate.sampling import (filter_scores, penalize, pick, record_key,
                                        token_logprobs, uniforms)

VOCAB = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.25])


def draws(s: Sampling, rows: int = 20000, index: int = 0) -> torch.Tensor:
    """One pick per row for `rows` records with the same logits: a record's draw is a
    function of its key and place only, so the rows are independent samples."""
    keys = torch.tensor([record_key(s.seed, i) for i in range(rows)])
    logits = LOGITS.expand(rows, VOCAB).contiguous()
    return pick(logits, *per_row(s, rows), keys, torch.full((rows,), index),
                torch.arange(VOCAB), sample=s.method == "sample", filtered=True)


def per_row(s: Sampling, rows: int) -> tuple[torch.Tensor, ...]:
    """The spec's sampling as per-row temperature, top_k, top_p, min_p (temperature 0:
    greedy)."""
    t = s.temperature if s.method == "sample" else 0.0
    return (torch.full((rows,), t), torch.full((rows,), s.top_k),
            torch.full((rows,), s.top_p), torch.full((rows,), s.min_p))


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_frequencies_match_the_softmax_at_each_temperature():
    # 7 degrees of freedom: the 0.999 quantile of chi-square is 24.3
    for temperature in (0.7, 1.0, 2.0):
        s = Sampling(method="sample", temperature=temperature, seed=3)
        tokens = draws(s)
        assert chi_square(tokens, (LOGITS / temperature).softmax(-1)) < 24.3, temperature


def test_a_wrong_distribution_is_told_apart():
    """The test above can fail: draws at temperature 1 against the softmax at 2."""
    tokens = draws(Sampling(method="sample", temperature=1.0, seed=3))
    assert chi_square(tokens, (LOGITS / 2.0).softmax(-1)) > 100


def test_top_k_and_top_p_draw_only_inside_their_sets():
    top3 = set(torch.topk(LOGITS, 3).indices.tolist())
    assert set(draws(Sampling(method="sample", top_k=3), 4000).tolist()) == top3
    probs = LOGITS.softmax(-1)
    ranked = torch.argsort(probs, descending=True)
    nucleus = set(ranked[:(probs[ranked].cumsum(0) < 0.6).sum() + 1].tolist())
    got = draws(Sampling(method="sample", top_p=0.6), 4000)
    assert set(got.tolist()) == nucleus
    # within the nucleus, the renormalised softmax
    scores = filter_scores(LOGITS[None], torch.tensor([0]), torch.tensor([0.6]),
                           torch.tensor([0.0]))[0]
    assert chi_square(got, scores.softmax(-1)) < 24.3


def test_min_p_draws_only_tokens_at_least_min_p_of_the_most_likely():
    probs = LOGITS.softmax(-1)
    kept = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    got = draws(Sampling(method="sample", min_p=0.3), 4000)
    assert set(got.tolist()) == kept and len(kept) < VOCAB
    # within the kept set, the renormalised softmax; min_p 0 keeps every token
    scores = filter_scores(LOGITS[None], torch.tensor([0]), torch.tensor([1.0]),
                           torch.tensor([0.3]))[0]
    assert chi_square(got, scores.softmax(-1)) < 24.3
    assert torch.equal(filter_scores(LOGITS[None], torch.tensor([0]), torch.tensor([1.0]),
                                     torch.tensor([0.0]))[0], LOGITS)


def test_penalties_are_vllms_per_row():
    """vLLM's apply_penalties, written as its code does (masked in-place ops), on random
    logits and counts: each row its own repetition, presence and frequency penalty."""
    gen = torch.Generator().manual_seed(0)
    b, v = 6, 50
    logits = torch.randn(b, v, generator=gen) * 3
    counts = torch.randint(0, 3, (b, v), generator=gen, dtype=torch.int32)
    counts[torch.rand(b, v, generator=gen) < 0.6] = 0
    prompt = torch.rand(b, v, generator=gen) < 0.2
    rep = torch.tensor([1.0, 1.3, 0.7, 2.0, 1.0, 1.1])
    pres = torch.tensor([0.0, 0.5, -0.5, 1.0, 0.0, 2.0])
    freq = torch.tensor([0.0, 0.2, 0.3, -1.0, 1.5, 0.0])
    want = logits.clone()
    reps = torch.where(prompt | (counts > 0), rep[:, None], 1.0)
    want[want > 0] /= reps[want > 0]
    want[want <= 0] *= reps[want <= 0]
    want -= freq[:, None] * counts
    want -= pres[:, None] * (counts > 0)
    got = penalize(logits, counts, prompt, rep, pres, freq)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got[0], logits[0])  # every penalty off: the logits as they were


def test_token_logprobs_are_the_picked_tokens_then_the_best_first():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    token = torch.tensor([3, 0])
    values, ids = token_logprobs(logits, token, 3)
    lp = logits.log_softmax(-1)
    assert torch.allclose(values[:, 0], lp[[0, 1], token])
    assert ids.tolist() == [[0, 1, 2], [7, 6, 5]]
    assert torch.allclose(values[:, 1:], lp.gather(1, ids))
    assert token_logprobs(logits, token, 0)[1].shape == (2, 0)


def test_draws_depend_on_key_and_place_only():
    s = Sampling(method="sample", seed=1)
    a = draws(s, 500, index=4)
    assert torch.equal(a, draws(s, 500, index=4))  # the same again
    assert not torch.equal(a, draws(s, 500, index=5))  # another place
    assert not torch.equal(a, draws(Sampling(method="sample", seed=2), 500, index=4))


def test_greedy_is_the_argmax():
    zero = torch.zeros(1, dtype=torch.long)
    assert pick(LOGITS[None], *per_row(Sampling(), 1), zero, zero, torch.arange(VOCAB),
                sample=False, filtered=False).item() == 0
    # a greedy row (temperature 0) beside sampled ones stays the argmax
    rows = per_row(Sampling(method="sample", temperature=2.0), 64)
    rows[0][0] = 0.0
    keys = torch.tensor([record_key(0, i) for i in range(64)])
    got = pick(LOGITS.expand(64, VOCAB), *rows, keys, torch.zeros(64).long(),
               torch.arange(VOCAB), sample=True, filtered=True)
    assert got[0] == 0 and len(set(got[1:].tolist())) > 1


def test_uniforms_are_open_interval_and_spread():
    u = uniforms(torch.tensor([record_key(0, i) for i in range(64)]), torch.zeros(64).long(),
                 torch.arange(1024))
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01


def test_record_keys_are_stable_and_tell_types_apart():
    assert record_key(0, 5) == record_key(0, 5)
    assert record_key(0, 5) != record_key(0, "5")
    assert record_key(0, "a") != record_key(1, "a")
    assert -2**63 <= record_key(7, "x") < 2**63


def test_the_two_stage_argmax_is_torchs_first_maximum_ties_and_ragged_parts_included():
    from graphrun.generate.sampling import ARGMAX_PARTS, SPLIT_ARGMAX, first_argmax

    gen = torch.Generator().manual_seed(5)
    for v in (SPLIT_ARGMAX, SPLIT_ARGMAX + 1, 128256, 50257):
        x = torch.randint(-3, 4, (6, v), generator=gen).float()  # many equal maxima per row
        x[1] = float("-inf")  # no finite score: torch says 0
        x[2, -1] = 10.0  # the maximum in the last, ragged part
        x[3, v // ARGMAX_PARTS] = 10.0  # at a part's first column
        got = first_argmax(x)
        assert got.dtype == torch.int64 and got.tolist() == x.argmax(dim=-1).tolist()
    small = torch.randn(3, 100, generator=gen)
    assert first_argmax(small).tolist() == small.argmax(dim=-1).tolist()


# The pick's kernel (generate/pick_kernels.py): what torch's ops pick, in one read.

def pick_kernel_failures(device: str) -> list[str]:
    """The kernel's greedy, drawn and filtered-draw picks against torch's ops on `device`, on
    scores with ties, -inf and ragged last parts, temperatures 0 and not; the failures."""
    from graphrun.generate import sampling

    failures = []
    gen = torch.Generator().manual_seed(3)
    for rows, vocab in ((5, 1000), (9, 3001), (2, 1024), (1, 1)):
        x = (torch.randint(-3, 4, (rows, vocab), generator=gen).float()  # equal maxima
             + torch.randn(rows, vocab, generator=gen) * (torch.arange(rows) % 2)[:, None])
        x[0, : vocab // 2] = float("-inf")
        if rows > 2:
            x[2] = float("-inf")  # every score -inf: torch says column 0
        x = x.to(device)
        temperature = (torch.rand(rows, generator=gen) * 2).to(device)
        temperature[::3] = 0.0
        keys = torch.tensor([record_key(0, i) for i in range(rows)], device=device)
        index = torch.arange(rows, device=device) * 7
        ids = torch.arange(vocab, device=device)
        for name, got, want in (
                ("greedy", sampling._kernel_pick(x), x.argmax(dim=-1)),
                ("drawn", sampling._kernel_pick(x, temperature=temperature, keys=keys,
                                                index=index),
                 sampling.draw_eager(x, temperature, keys, index, ids)),
                ("filtered", sampling._kernel_pick(x, keys=keys, index=index),
                 sampling.draw_eager(x, None, keys, index, ids))):
            if not torch.equal(got, want):
                failures.append(f"{name} {rows} x {vocab}: {got} against {want}")
    return failures + ([f"given up: {sampling.kernel_failure()}"]
                       if sampling.kernel_failure() else [])


def test_the_pick_kernel_in_the_interpreter_picks_what_torchs_ops_pick():
    pytest.importorskip("triton", reason="the pick's kernel is written in Triton")
    from tests.triton_interpreter import run_interpreted

    p = run_interpreted("import tests.test_generate_sampling as t",
                        "t.pick_kernel_failures('cpu')")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]


def test_a_pick_kernel_that_differs_from_torchs_ops_is_given_up(monkeypatch):
    """check_kernel: a kernel that runs yet picks otherwise is given up with its reason, and
    every later pick is torch's."""
    from graphrun.generate import sampling

    monkeypatch.setattr(sampling.SWITCH, "failures", [])
    monkeypatch.setattr(sampling, "_checked", {})
    # a spy deep inside the pick: the kernel "runs" on the CPU and is off by one column
    monkeypatch.setattr(sampling, "_kernel_takes", lambda x: not sampling.SWITCH.failures)
    real = sampling.draw_eager

    def off_by_one(x, temperature=None, keys=None, index=None):
        ids = torch.arange(x.shape[1])
        return 1 + (x.argmax(-1) if keys is None else real(x, temperature, keys, index, ids))

    monkeypatch.setattr(sampling, "_kernel_pick", off_by_one)
    assert sampling.check_kernel(torch.device("cpu"), 500) == []
    assert "the pick kernel differs from torch's ops on cpu in 48 of 48 picks" in \
        sampling.kernel_failure()
    keys = torch.tensor([record_key(0, i) for i in range(4)])
    x = torch.randn(4, 500)
    got = pick(x, torch.ones(4), torch.zeros(4).long(), torch.ones(4), torch.zeros(4), keys,
               torch.zeros(4).long(), torch.arange(500), sample=True, filtered=False)
    want = real(x, None, keys, torch.zeros(4).long(), torch.arange(500))
    assert got.tolist() == want.tolist()


@pytest.mark.cuda
def test_on_the_gpu_the_pick_kernel_picks_what_torchs_ops_pick(monkeypatch):
    pytest.importorskip("triton", reason="the pick's kernel is written in Triton")
    from graphrun.generate import sampling

    monkeypatch.setattr(sampling.SWITCH, "failures", [])
    monkeypatch.setattr(sampling, "_checked", {})
    assert sampling.check_kernel(torch.device("cuda"), 128256) == ["pick"]
    assert pick_kernel_failures("cuda") == []


@pytest.mark.cuda
def test_on_the_gpu_a_sampled_job_draws_the_same_tokens_with_the_pick_kernel_or_without(
        monkeypatch):
    pytest.importorskip("triton", reason="the pick's kernel is written in Triton")
    from graphrun.generate import GenerateConfig, build_engine, build_llama, sampling

    model = build_llama(layers=2, d_model=64, heads=4, kv_heads=2, vocab=20000, max_len=64,
                        device="cuda", dtype=torch.float32)
    prompts = [[3, 8, 1], [9] * 12, [4, 5, 6, 7, 8], [2]]
    tokens = []
    for failures in ([], ["off"]):  # a failure noted: torch's ops
        monkeypatch.setattr(sampling.SWITCH, "failures", failures)
        config = GenerateConfig(max_new_tokens=24, sampling=Sampling(
            method="sample", temperature=1.0, top_p=1.0, seed=0))
        gen = build_engine(model, config, slots=4, max_prompt=16, rows=[1, 4], device="cuda",
                           dtype=torch.float32, block_size=4)
        tokens.append([c.token_ids for c in gen.generate(prompts, list(range(4)))])
        gen.close()
    assert tokens[0] == tokens[1]


# The decode step's bookkeeping after the pick (generate/steps.advance): its kernel against
# torch's ops.

def advance_failures(device: str) -> list[str]:
    """steps.advance's kernel against advance_eager (steps.advance_differs) on seeded slot
    states: the job's own check's, no stop ids at all, one slot, more rows than a program
    takes; the failures."""
    from graphrun.generate import sampling, steps

    failures = [f"{slots} slots, {rows} rows, {width} stop ids: {', '.join(wrong)} differ"
                for slots, rows, width in ((80, 70, 3), (5, 5, 0), (300, 256, 9), (1, 1, 1))
                if (wrong := steps.advance_differs(torch.device(device), slots, rows, width))]
    if not steps._check_advance(torch.device(device)):  # the job's own check agrees
        failures.append("steps._check_advance found the kernel differs")
    return failures + ([f"given up: {sampling.kernel_failure()}"]
                       if sampling.kernel_failure() else [])


def test_a_bookkeeping_kernel_that_differs_from_torchs_ops_is_given_up(monkeypatch):
    """steps.check_kernels: after the pick's check, a bookkeeping kernel that runs yet leaves
    the rows where they were is given up with its reason (with the pick's: one switch), and
    later steps move rows on with torch's ops."""
    from types import SimpleNamespace

    from graphrun.generate import sampling, steps

    monkeypatch.setattr(sampling.SWITCH, "failures", [])
    monkeypatch.setattr(steps, "_advance_checked", {})
    monkeypatch.setattr(sampling, "check_kernel", lambda device, vocab: ["pick"])
    # the kernel "runs" on the CPU and does nothing
    monkeypatch.setattr(sampling.SWITCH, "on", lambda device: not sampling.SWITCH.failures)
    launched = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append(grid)

    monkeypatch.setattr(sampling.SWITCH, "kernels", SimpleNamespace(advance=Launcher()),
                        raising=False)
    assert steps.check_kernels(torch.device("cpu"), 500) == []
    assert launched and "the bookkeeping kernel differs from torch's ops on cpu in done, " \
        "index, seq_lens, token, picked" in sampling.kernel_failure()
    state = SimpleNamespace(device=torch.device("cpu"), done=torch.tensor([False, True]),
                            stops=torch.tensor([[3], [3]]), index=torch.tensor([0, 2]),
                            max_new=torch.tensor([5, 5]), seq_lens=torch.tensor([4, 9]).int(),
                            token=torch.zeros(2).long(), picked=torch.zeros(2).long())
    steps.advance(state, torch.tensor([3, 4]), 2, 7)
    assert len(launched) == 1  # given up: torch's ops moved the rows
    assert state.done.tolist() == [True, True] and state.index.tolist() == [1, 2]
    assert state.token.tolist() == [3, 7] and state.seq_lens.tolist() == [5, 9]


def test_the_bookkeeping_kernel_in_the_interpreter_moves_rows_on_as_torchs_ops_do():
    pytest.importorskip("triton", reason="the bookkeeping's kernel is written in Triton")
    from tests.triton_interpreter import run_interpreted

    p = run_interpreted("import tests.test_generate_sampling as t", "t.advance_failures('cpu')")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]


@pytest.mark.cuda
def test_on_the_gpu_the_bookkeeping_kernel_moves_rows_on_as_torchs_ops_do(monkeypatch):
    pytest.importorskip("triton", reason="the bookkeeping's kernel is written in Triton")
    from graphrun.generate import sampling

    monkeypatch.setattr(sampling.SWITCH, "failures", [])
    assert advance_failures("cuda") == []
