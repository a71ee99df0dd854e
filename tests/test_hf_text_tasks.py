"""A sequence classifier and a cross-encoder (pairs of texts, data.text.field: [query,
passage]) through the data.text path, each against the model's own eager outputs on each
record; a bad pair field or record gets one clear message."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or
    importlib.util.find_spec("tokenizers") is None,
    reason="needs transformers and tokenizers (the hf extra)")

from tests.test_init_hf import LIMIT, SPECIALS, WORDS  # noqa: E402


def save_tokenizer(folder) -> int:
    """A WordPiece tokenizer over WORDS in BERT's layout, pairs included ([CLS] a [SEP] b
    [SEP], token types 0 then 1); its vocab size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                      cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                      model_max_length=LIMIT).save_pretrained(folder)
    return len(vocab)


def save_classifier(folder, labels: int):
    """A seeded one-layer BERT classifier and its tokenizer (labels 1: a cross-encoder's
    single relevance logit)."""
    import transformers as tf

    vocab = save_tokenizer(folder)
    torch.manual_seed(labels)
    config = tf.BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=32,
                           max_position_embeddings=LIMIT, num_labels=labels)
    tf.BertForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return save_classifier(tmp_path_factory.mktemp("classify"), 3)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return save_classifier(tmp_path_factory.mktemp("rerank"), 1)


def words(rng, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi + 1))))


def spec_for(tmp_path, folder, labels: int, field, records: list[dict], **data) -> "Path":
    with open(tmp_path / "data.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    spec = {"version": 1, "name": "cls", "device": "cpu",
            "model": {"hf": {"path": str(folder),
                             "class": "AutoModelForSequenceClassification"}},
            "inputs": {n: {"shape": ["batch", "seq"], "dtype": "int64", "range": [0, r],
                           "pad": 0}
                       for n, r in (("input_ids", len(WORDS) + 5), ("attention_mask", 2),
                                    ("token_type_ids", 2))},
            "outputs": {"logits": {"shape": ["batch", labels], "from": "logits",
                                   "dtype": "float32"}},
            "buckets": {"batch": [1, 4], "seq": [8, 16, LIMIT]},
            "data": {"path": "data.jsonl", "id_field": "id", "batch_size": 4,
                     "text": {"field": field, "truncate": True}, **data},
            "output": {"dir": "out", "format": "npy"}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def outputs(tmp_path) -> tuple[list, np.ndarray]:
    ids = np.concatenate([np.load(p, allow_pickle=True)
                          for p in sorted((tmp_path / "out").glob("*.ids.npy"))])
    got = np.concatenate([np.load(p) for p in sorted((tmp_path / "out").glob("*.logits.npy"))])
    return ids.tolist(), got


def eager_logits(folder, *texts) -> np.ndarray:
    """The model's own logits for one record: its text, or its pair, tokenized by
    transformers as the model card says (truncation at the model's limit)."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(folder)
    model = tf.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    enc = tok(*texts, return_tensors="pt", truncation=True, max_length=LIMIT)
    assert "token_type_ids" in enc  # a pair's second text is told apart by its type
    with torch.inference_mode():
        return model(**enc).logits[0].numpy()


def test_a_sequence_classifier_gives_its_eager_logits(tmp_path, classifier):
    rng = np.random.default_rng(0)
    texts = [words(rng, 1, 40) for _ in range(14)]  # some past the 32-token limit: cut
    path = spec_for(tmp_path, classifier, 3, "text",
                    [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)],
                    group_by_length=8)
    manifest = graphrun.run(graphrun.load_spec(path))
    ids, got = outputs(tmp_path)
    assert ids == [f"r{i}" for i in range(len(texts))] and got.shape == (len(texts), 3)
    for row, text in zip(got, texts):
        np.testing.assert_allclose(row, eager_logits(classifier, text), rtol=1e-4, atol=1e-5)
    long = sum(len(t.split()) + 2 > LIMIT for t in texts)
    assert long and manifest.totals.texts_truncated == long
    assert manifest.environment.model_code == "graphrun"  # its own BERT, against transformers


def test_a_cross_encoder_scores_each_pair_as_it_does_eagerly(tmp_path, reranker):
    rng = np.random.default_rng(1)
    pairs = [(words(rng, 1, 6), words(rng, 1, 40)) for _ in range(13)]
    path = spec_for(tmp_path, reranker, 1, ["query", "passage"],
                    [{"id": i, "query": q, "passage": p} for i, (q, p) in enumerate(pairs)])
    result = CliRunner().invoke(main, ["run", str(path)])
    assert result.exit_code == 0, result.output
    ids, got = outputs(tmp_path)
    assert ids == list(range(len(pairs))) and got.shape == (len(pairs), 1)
    for row, (q, p) in zip(got, pairs):
        np.testing.assert_allclose(row, eager_logits(reranker, q, p), rtol=1e-4, atol=1e-5)
    # the pair's tokens: [CLS] query [SEP] passage [SEP], token types 0 then 1
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    long = sum(len(q.split()) + len(p.split()) + 3 > LIMIT for q, p in pairs)
    assert long and manifest["totals"]["texts_truncated"] == long
    assert f"texts: {long} texts cut to {LIMIT} tokens" in result.output


def test_a_pair_with_a_field_missing_or_not_text_is_rejected_with_its_line(tmp_path,
                                                                           reranker):
    records = [{"id": 0, "query": "a cat", "passage": "the cat sat"},
               {"id": 1, "query": "a dog"},  # line 2: no passage
               {"id": 2, "query": "a bird", "passage": 7},  # line 3: not a string
               {"id": 3, "qeury": "red", "passage": "a red roof"},  # line 4: a typo
               {"id": 4, "query": "the mat", "passage": "on the mat"}]
    path = spec_for(tmp_path, reranker, 1, ["query", "passage"], records,
                    on_bad_record="skip")
    manifest = graphrun.run(graphrun.load_spec(path))
    assert (manifest.totals.records_out, manifest.totals.records_rejected) == (2, 3)
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").open()]
    where = {r["id"]: (r["where"], r["reason"]) for r in rejects}
    assert where[1][0] == "data.jsonl:2" and "missing field 'passage'" in where[1][1]
    assert "the pair's second text" in where[1][1]
    assert where[2] == ("data.jsonl:3", "passage: expected a string, got a number")
    assert where[3][0] == "data.jsonl:4" and "missing field 'query'" in where[3][1]
    assert "qeury" in where[3][1]  # the close name is suggested
    ids, got = outputs(tmp_path)
    assert ids == [0, 4]


@pytest.mark.parametrize("field,message", [
    ("[query, passage, title]", "names 3 fields; give one field (a text) or a list of two"),
    ("[]", "names 0 fields"),
    ("[query, query]", "names 'query' twice"),
    ("[query, 5]", "give a field's name, or a list of two names for a pair"),
])
def test_a_wrong_field_list_is_one_clear_message(tmp_path, reranker, field, message):
    path = spec_for(tmp_path, reranker, 1, ["query", "passage"], [])
    result = CliRunner().invoke(main, ["validate", str(path), "--set",
                                       f"data.text.field={field}"])
    assert result.exit_code != 0 and message in result.output, result.output
    assert "data.text.field" in result.output and "Traceback" not in result.output


def test_a_parquet_pair_is_read_as_the_jsonl_one(tmp_path, reranker):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from graphrun.read.stream import read_batches

    rng = np.random.default_rng(2)
    records = [{"id": i, "query": words(rng, 1, 4), "passage": words(rng, 1, 30)}
               for i in range(9)]
    spec = graphrun.load_spec(spec_for(tmp_path, reranker, 1, ["query", "passage"], records))
    pq.write_table(pa.table({k: [r[k] for r in records] for k in records[0]}),
                   tmp_path / "data.parquet", row_group_size=4)
    parquet = spec.model_copy(update={"data": spec.data.model_copy(
        update={"path": tmp_path / "data.parquet"})})
    a, b = list(read_batches(spec)), list(read_batches(parquet))
    for x, y in zip(a, b):
        for name in x.fields:
            assert all(np.array_equal(u, v) for u, v in zip(x.fields[name], y.fields[name]))
    types = a[0].fields["token_type_ids"][0]
    assert types[0] == 0 and types[-1] == 1  # the passage's tokens are type 1


def init(tmp_path, folder, data, *extra):
    spec_path = tmp_path / "init" / "pipe.yaml"
    result = CliRunner().invoke(main, ["init", "--hf", str(folder), "--data", str(data),
                                       "-o", str(spec_path), "--out-dir", str(tmp_path / "out"),
                                       "--batch-size", "4", *map(str, extra)])
    return spec_path, result


def test_init_writes_a_cross_encoder_spec_for_query_passage_records(tmp_path, reranker):
    rng = np.random.default_rng(3)
    pairs = [(words(rng, 1, 5), words(rng, 2, 20)) for _ in range(10)]
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for i, (q, p) in enumerate(pairs):
            f.write(json.dumps({"id": f"p{i}", "query": q, "passage": p}) + "\n")
    spec_path, result = init(tmp_path, reranker, tmp_path / "pairs.jsonl")
    assert result.exit_code == 0, result.output
    assert "a pair, 'query' then 'passage'" in result.output
    assert "its one logit" in result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.data.text.fields == ["query", "passage"]
    assert list(spec.outputs) == ["logits"] and spec.outputs["logits"].shape == ["batch", 1]
    assert "token_type_ids" in spec.inputs
    assert graphrun.run(spec).status == "completed"
    ids, got = outputs(tmp_path)
    assert ids == [f"p{i}" for i in range(10)]
    for row, (q, p) in zip(got, pairs):
        np.testing.assert_allclose(row, eager_logits(reranker, q, p), rtol=1e-4, atol=1e-5)


def test_init_writes_a_classifiers_logits_and_takes_the_pair_it_is_told(tmp_path, classifier):
    rng = np.random.default_rng(4)
    rows = [{"id": i, "a": words(rng, 1, 5), "b": words(rng, 1, 9)} for i in range(8)]
    with open(tmp_path / "ab.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    spec_path, result = init(tmp_path, classifier, tmp_path / "ab.jsonl", "--text-field", "a,b")
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.data.text.fields == ["a", "b"]
    assert list(spec.outputs) == ["logits", "probs", "label"]
    assert graphrun.run(spec).status == "completed"
    _, got = outputs(tmp_path)
    for row, r in zip(got, rows):
        np.testing.assert_allclose(row, eager_logits(classifier, r["a"], r["b"]), rtol=1e-4,
                                   atol=1e-5)
    for given, message in (("a,c", "no string field 'c'"), ("a,b,a", "give one field, or two")):
        _, result = init(tmp_path, classifier, tmp_path / "ab.jsonl", "--text-field", given,
                         "--force")
        assert result.exit_code != 0 and message in result.output, result.output
        assert "Traceback" not in result.output


def test_a_generation_job_takes_no_pair(tmp_path, reranker):
    path = spec_for(tmp_path, reranker, 1, ["query", "passage"], [])
    spec = yaml.safe_load(path.read_text())
    for key in ("inputs", "outputs", "buckets"):
        spec.pop(key)
    spec["buckets"] = {"batch": [1, 4], "seq": [16, 32]}
    spec["generate"] = {"max_new_tokens": 4}
    path.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code != 0
    assert "each record is one prompt: name its one field, not a pair" in result.output
