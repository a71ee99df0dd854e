"""graphrun's own BERT loading Hugging Face BERT folders (model.hf.implementation auto/graphrun):
its outputs equal transformers' BertModel on padded batches, a task model's checkpoint loads
its encoder, a folder it cannot load as transformers would falls back with the reason in the
manifest, and an embedding job on such a folder never imports transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

import graphrun  # noqa: E402
from graphrun.base.errors import ModelError  # noqa: E402
from graphrun.models.bert import BertCheckpoint, find_bert, load_bert  # noqa: E402
from tests.children import imports_transformers  # noqa: E402

CONFIG = dict(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=96, max_position_embeddings=64, type_vocab_size=2)


def save(folder: Path, cls=None, pooler: bool = True, **changes) -> Path:
    torch.manual_seed(0)
    config = transformers.BertConfig(**{**CONFIG, **changes})
    model = (cls(config) if cls else transformers.BertModel(config, add_pooling_layer=pooler))
    with torch.no_grad():  # off the init's zero biases and unit norms, so each one shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(folder)
    return folder


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 120, (4, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 2:] = 0
    mask[3, :] = 0  # a bucket's spare row: padding only
    types = torch.zeros_like(ids)
    types[0, 5:] = 1
    return ids, mask, types


def test_outputs_equal_transformers_bertmodel_on_a_padded_batch(tmp_path):
    folder = save(tmp_path / "bert")
    found = find_bert(folder, "AutoModel", {})
    assert isinstance(found, BertCheckpoint), found
    ours = load_bert(found, torch.float32)
    theirs = transformers.AutoModel.from_pretrained(folder).eval()
    ids, mask, types = batch()
    with torch.no_grad():
        for kwargs in ({"attention_mask": mask, "token_type_ids": types},
                       {"attention_mask": mask}, {}):
            got, want = ours(ids, **kwargs), theirs(ids, **kwargs)
            real = (kwargs.get("attention_mask", torch.ones_like(ids)).sum(1) > 0)
            for name in ("last_hidden_state", "pooler_output"):
                torch.testing.assert_close(got[name][real], want[name][real],
                                           atol=2e-5, rtol=1e-4)
            assert torch.isfinite(got["last_hidden_state"]).all()


def test_a_task_models_checkpoint_loads_its_encoder(tmp_path):
    folder = save(tmp_path / "mlm", transformers.BertForPreTraining)
    found = find_bert(folder, "BertModel", {})
    assert isinstance(found, BertCheckpoint) and found.prefix == "bert."
    ours = load_bert(found, torch.float32)
    theirs = transformers.BertModel.from_pretrained(folder).eval()
    ids, mask, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask)["last_hidden_state"][:3],
                                   theirs(ids, attention_mask=mask).last_hidden_state[:3],
                                   atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("labels", [1, 3])
def test_a_sequence_classifiers_logits_equal_transformers(tmp_path, labels):
    folder = save(tmp_path / "clf", transformers.BertForSequenceClassification,
                  num_labels=labels)
    found = find_bert(folder, "AutoModelForSequenceClassification", {})
    assert isinstance(found, BertCheckpoint) and found.labels == labels, found
    ours = load_bert(found, torch.float32)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    ids, mask, types = batch()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, token_type_ids=types)["logits"]
        want = theirs(ids, attention_mask=mask, token_type_ids=types).logits
    assert got.shape == (4, labels)
    torch.testing.assert_close(got[:3], want[:3], atol=2e-5, rtol=1e-4)


def test_a_folder_it_cannot_load_as_transformers_would_says_why(tmp_path):
    folder = save(tmp_path / "bert")
    assert "class AutoModelForMaskedLM" in find_bert(folder, "AutoModelForMaskedLM", {})
    assert "not BertForSequenceClassification's" in find_bert(
        folder, "AutoModelForSequenceClassification", {})
    assert "kwargs (revision)" in find_bert(folder, "AutoModel", {"revision": "main"})
    no_pooler = tmp_path / "no-pooler"
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**CONFIG), add_pooling_layer=False
                           ).save_pretrained(no_pooler)
    assert "missing ['pooler.dense.bias'" in find_bert(no_pooler, "AutoModel", {})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu_new"}))
    assert "hidden_act 'gelu_new'" in find_bert(folder, "AutoModel", {})
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "roberta"}))
    assert "model_type 'roberta'" in find_bert(folder, "AutoModel", {})


def embed_spec(tmp_path: Path, folder: Path, **hf) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, 120)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    data = tmp_path / "texts.jsonl"
    rng = np.random.default_rng(0)
    data.write_text("".join(json.dumps({"id": i, "text": " ".join(
        f"w{w}" for w in rng.integers(2, 120, rng.integers(1, 30)))}) + "\n" for i in range(40)))
    spec = {"version": 1, "name": "embed", "device": "cpu",
            "model": {"hf": {"path": str(folder), "class": "AutoModel", **hf},
                      "dtype": "float32"},
            "inputs": {"input_ids": {"shape": ["batch", "seq"], "dtype": "int64",
                                     "range": [0, 120]},
                       "attention_mask": {"shape": ["batch", "seq"], "dtype": "int64",
                                          "range": [0, 2], "pad": 0}},
            "outputs": {"embedding": {"shape": ["batch", 48], "from": "last_hidden_state",
                                      "reduce": ["mean_pool", "l2_normalize"],
                                      "dtype": "float32"}},
            "buckets": {"batch": [4, 8], "seq": [8, 16, 32]},
            "data": {"path": str(data), "id_field": "id", "batch_size": 8,
                     "text": {"field": "text", "truncate": True}},
            "output": {"dir": str(tmp_path / "out"), "format": "npy"}}
    path = tmp_path / "embed.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def embeddings(out: Path) -> np.ndarray:
    return np.concatenate([np.load(p) for p in sorted(out.glob("part-*.embedding.npy"))])


def test_an_embedding_job_says_whose_code_ran_and_both_embed_alike(tmp_path):
    folder = save(tmp_path / "bert")
    ours = graphrun.run(graphrun.load_spec(embed_spec(tmp_path, folder)))
    assert ours.environment.model_code == "graphrun"
    assert ours.environment.model_code_reason == (
        "model.hf.implementation auto: graphrun's own BERT loads the folder as transformers' "
        "AutoModel would")
    mine = embeddings(tmp_path / "out")
    theirs = graphrun.run(graphrun.load_spec(embed_spec(tmp_path, folder,
                                                        implementation="transformers")),
                          overwrite=True)
    assert theirs.environment.model_code == "transformers"
    assert theirs.environment.model_code_reason == "model.hf.implementation: transformers"
    assert mine.shape == (40, 48)
    assert (mine * embeddings(tmp_path / "out")).sum(1).min() > 0.99999


def test_implementation_graphrun_on_a_folder_it_cannot_load_is_one_error(tmp_path):
    folder = save(tmp_path / "bert")
    spec = embed_spec(tmp_path, folder, implementation="graphrun", kwargs={"revision": "main"})
    with pytest.raises(ModelError, match=r"implementation: graphrun cannot load .*kwargs "
                                         r"\(revision\).*set implementation: auto"):
        graphrun.run(graphrun.load_spec(spec))
    fallback = graphrun.run(graphrun.load_spec(
        embed_spec(tmp_path, folder, kwargs={"revision": "main"})), overwrite=True)
    assert fallback.environment.model_code == "transformers"
    assert "kwargs (revision)" in fallback.environment.model_code_reason


def test_an_embedding_job_on_graphruns_bert_never_imports_transformers(tmp_path):
    spec = embed_spec(tmp_path, save(tmp_path / "bert"))
    assert not imports_transformers(spec)
    assert embeddings(tmp_path / "out").shape == (40, 48)


def test_an_encoder_saved_without_its_pooler_runs_on_graphruns_code(tmp_path):
    folder = save(tmp_path / "bert", pooler=False)
    spec = embed_spec(tmp_path, folder)
    assert not imports_transformers(spec)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["environment"]["model_code"] == "graphrun"
    assert "graphrun's own BERT loads the folder" in manifest["environment"]["model_code_reason"]
    mine = embeddings(tmp_path / "out")
    theirs = graphrun.run(graphrun.load_spec(embed_spec(tmp_path, folder,
                                                        implementation="transformers")),
                          overwrite=True)
    assert theirs.environment.model_code == "transformers"
    assert mine.shape == (40, 48)
    np.testing.assert_allclose(mine, embeddings(tmp_path / "out"), atol=1e-5)


@pytest.mark.parametrize("output", [{"from": "pooler_output"}, {"from": 1}, {}])
def test_an_output_reading_the_pooler_a_folder_lacks_is_refused(tmp_path, output):
    folder = save(tmp_path / "bert", pooler=False)
    path = embed_spec(tmp_path, folder)
    spec = yaml.safe_load(path.read_text())
    spec["outputs"] = {"pooler_output": {"shape": ["batch", 48], **output}}
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ModelError, match=r"no pooler weights .*outputs\.pooler_output reads "
                                         r"pooler_output: read last_hidden_state instead"):
        graphrun.run(graphrun.load_spec(path))
