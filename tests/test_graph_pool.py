"""engine/graphs.py: the graph set-up both kinds of job share (GraphPool, Graph), and generation's
place in the feed (generate/scheduler.py's Scheduler) beside a forward pass's Launcher."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from graphrun.base.units import MiB
from graphrun.engine.graphs import Graph, GraphPool, SetUp

PACKAGE = Path(__file__).resolve().parent.parent / "graphrun"


class StandInGraph:
    """What a Graph needs of a captured graph: replay()."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def cpu_pool(**kw) -> GraphPool:
    import torch

    return GraphPool(torch.device("cpu"), graphs=False, **kw)


def test_graph_set_up_is_written_once_for_both_kinds_of_job():
    """The capture itself, the pool and its replacement after a failed capture live in
    engine/graphs.py; a forward pass's capture and generation's graph table use it."""
    made_here = {"graph_pool_handle(", "capture_begin(", "capture_end(", "CUDAGraph()"}
    found = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if any(word in p.read_text() for word in made_here)}
    assert found == {"engine/graphs.py"}
    for user in ("engine/capture.py", "generate/graphs.py"):
        assert "from graphrun.engine.graphs import" in (PACKAGE / user).read_text()


def test_a_graph_set_aside_runs_its_eager_step_and_is_kept_alive():
    calls = []
    captured = StandInGraph()
    entry = Graph(lambda: calls.append("eager"), captured)
    entry.run()
    assert captured.replays == 1 and not calls
    pool = cpu_pool()
    pool.set_aside(entry)
    entry.run()
    assert calls == ["eager"] and captured.replays == 1
    assert entry.graph is None and pool.retired == [captured]  # its pool blocks stay held
    pool.set_aside(entry)  # an entry already eager: nothing more kept
    assert pool.retired == [captured]


def test_a_key_that_falls_back_runs_eagerly_on_every_lane_with_its_reason():
    """A forward pass's bucket holds a graph per lane, a generation step one: either way every
    graph is set aside and the key says why."""
    key = SetUp(status="captured", set_up="setup")
    graphs = [Graph(lambda: None, StandInGraph()) for _ in range(2)]
    pool = cpu_pool()
    pool.fall_back(key, graphs, "verification failed: boom")
    assert (key.status, key.reason, key.set_up) == ("eager", "verification failed: boom", "setup")
    assert all(g.graph is None and g.run is g.step for g in graphs) and len(pool.retired) == 2


def test_warm_up_runs_the_step_as_often_as_asked_without_a_device():
    calls = []
    seconds = cpu_pool().warm_up(lambda: calls.append(1), 3)
    assert len(calls) == 3 and seconds >= 0


def test_the_budget_is_passed_only_beyond_it_and_says_by_how_much():
    pool = cpu_pool(budget_bytes=4 * MiB)
    pool.spent = 4 * MiB
    assert pool.past_budget() is None
    pool.spent = 5 * MiB
    assert pool.past_budget() == ("would take the graphs to 5.0 MiB, past "
                                  "memory_budget_mib=4")
    assert cpu_pool().past_budget() is None  # no budget
    assert cpu_pool().pool is None  # nothing captured: no pool


def test_a_generation_job_runs_through_its_scheduler_in_input_order(tmp_path):
    """The feed drives generation through the runner's launcher, a Scheduler of its own (the
    runner poses as nothing): parts handed over, completions back in input order."""
    import graphrun
    from graphrun.engine.launch import slot_count
    from graphrun.feed.loop import feed_stream
    from graphrun.generate.runner import GenerationRunner
    from graphrun.generate.scheduler import Scheduler
    from graphrun.read.records import RecordBatch
    from tests.test_generate_job import NEW, write_spec

    runner = GenerationRunner(graphrun.load_spec(write_spec(tmp_path, n=3)))
    try:
        feed = runner.launcher
        assert isinstance(feed, Scheduler) and feed is not runner
        assert not any(hasattr(runner, n) for n in ("host_slots", "slot_bytes", "stage",
                                                    "launch", "max_batch"))
        assert feed.make_room(False) == 1
        assert feed.make_room(True) == slot_count(feed.max_batch * runner.max_prompt * 8)
        assert feed.current_stream() is None
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16], [17, 18, 19]]
        source = []
        for start in (0, 4):  # two record batches: 4 prompts (one part of 4), then 2
            rows = prompts[start:start + 4]
            ids = np.arange(start, start + len(rows))
            tokens = np.zeros((len(rows), 4), dtype=np.int64)
            for i, p in enumerate(rows):
                tokens[i, :len(p)] = p
            source.append(RecordBatch(indices=ids, ids=ids.tolist(), where=[""] * len(ids),
                                      fields={"input_ids": tokens},
                                      lengths={"seq": np.array([len(p) for p in rows])},
                                      rejects=[]))
        written = []

        class Keep:
            def write(self, indices, ids, outputs, batch_start=None):
                written.extend(zip(ids, outputs["prompt_tokens"].tolist(),
                                   outputs["output_tokens"].tolist()))

            def reject(self, *a):
                raise AssertionError(a)

        feed_stream(feed, source, Keep(), on_batches=lambda ran, n, first: None,
                    on_read=lambda rb: None, should_stop=lambda: False, overlap=True)
        assert written == [(i, len(p), NEW) for i, p in enumerate(prompts)]
        assert sorted((b.batch, s.records) for b, s in feed.parts.items()) == [(2, 2), (4, 4)]
    finally:
        runner.close()


@pytest.mark.cuda
def test_generation_graphs_past_the_budget_run_eagerly_with_the_reason_and_the_same_tokens():
    """A budget that holds the KV cache but no graph: every graph is captured, then set aside
    (kept alive in the pool), and its step runs eagerly; the tokens are eager's."""
    import torch

    from graphrun.generate import GenerateConfig, build_engine, build_llama

    torch.manual_seed(0)
    model = build_llama(layers=1, d_model=32, heads=4, kv_heads=2, vocab=128, max_len=64,
                        device="cuda")
    config = GenerateConfig(max_new_tokens=6)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    eager = build_engine(model, config, slots=4, max_prompt=16, device="cuda",
                         backend="eager")
    want = [c.token_ids for c in eager.generate(prompts)]
    budget = (eager.kv_bytes + 1) / MiB
    eager.close()
    tight = build_engine(model, config, slots=4, max_prompt=16, device="cuda",
                         memory_budget_mib=budget)
    try:
        graphs = tight.graphs()
        assert graphs and all(g["status"] == "eager" and "past memory_budget_mib" in g["reason"]
                              for g in graphs), graphs
        assert len(tight.table.pool.retired) == len(graphs)
        assert [c.token_ids for c in tight.generate(prompts)] == want
    finally:
        tight.close()
