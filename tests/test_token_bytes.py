"""A token's own bytes and its logprob text (generate/token_bytes.py), for the decoders causal
LMs ship (byte-level BPE; SentencePiece's byte fallback and word-start mark), and the
OpenAI Batch output built on them (write/sinks/openai_batch.choice_logprobs)."""

from __future__ import annotations

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

from graphrun.generate.token_bytes import (byte_alphabet, logprob_text, text_bytes,  # noqa: E402
                                           token_bytes, token_texts)
from graphrun.write.sinks.openai_batch import choice_logprobs  # noqa: E402


def byte_level() -> Tokenizer:
    """GPT-2's layout: the 256 byte characters, then merges: ' the' and 'é' (two bytes)."""
    to_char = {b: c for c, b in byte_alphabet().items()}
    vocab = {to_char[b]: b for b in range(256)}
    vocab.update({"Ġt": 256, "Ġth": 257, "Ġthe": 258, to_char[0xC3] + to_char[0xA9]: 259})
    merges = [("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e"), (to_char[0xC3], to_char[0xA9])]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|end|>", special=True)])
    return tok


def sentencepiece() -> Tokenizer:
    """Llama 2's layout: byte fallback pieces, the word-start mark, a decoder that strips the
    first space."""
    vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)},
             "▁the": 258, "▁": 259, "cat": 260}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    return tok


def test_byte_level_tokens_give_their_own_bytes_not_a_replacement_character():
    tok = byte_level()
    of = token_bytes(tok)
    assert tok.decode([0xE2], skip_special_tokens=False) == "\ufffd"  # what decoding alone gives
    assert of(0xE2) == b"\xe2"
    assert of(258) == b" the" and of(259) == "é".encode()
    end = tok.token_to_id("<|end|>")
    assert of(end) == b"<|end|>"
    texts = token_texts(tok)
    assert texts(0xE2) == "bytes:\\xe2" and texts(258) == " the" and texts(259) == "é"


def test_sentencepiece_pieces_keep_their_space_and_byte_fallback_gives_the_byte():
    tok = sentencepiece()
    of = token_bytes(tok)
    assert tok.decode([258]) == "the"  # the decoder strips the first token's space
    assert of(258) == b" the" and of(259) == b" " and of(260) == b"cat"
    assert of(2 + 0xE2) == b"\xe2" and of(1) == b"<s>"
    # three byte pieces of one character: their bytes join into it
    euro = "€".encode()
    assert b"".join(of(2 + b) for b in euro).decode() == "€"


def test_a_logprob_text_reads_back_as_its_bytes():
    for raw in (b" the", "é".encode(), b"\xe2", b"\xe2\x82", b"", b"bytes:", "€".encode()):
        assert bytes(text_bytes(logprob_text(raw))) == raw
    assert logprob_text(b"\xe2\x82") == "bytes:\\xe2\\x82"


def outputs(texts: list[str], tops: list[list[str]], top_lps: list[list[float]]) -> dict:
    return {"logprobs": [np.full(len(texts), -1.0, np.float32)],
            "tokens": [np.array(texts, dtype=str)],
            "top_tokens": [np.array(tops, dtype=str)],
            "top_logprobs": [np.array(top_lps, dtype=np.float32)]}


def test_chat_logprobs_carry_each_tokens_real_bytes():
    euro = "€".encode()
    texts = [" a", logprob_text(euro[:1]), logprob_text(euro[1:])]
    got = choice_logprobs(outputs(texts, [[t] for t in texts], [[-1.0]] * 3), 0, chat=True)
    content = got["content"]
    assert [e["bytes"] for e in content] == [[32, 97], [euro[0]], list(euro[1:])]
    assert bytes(b for e in content for b in e["bytes"]).decode() == " a€"
    assert content[1]["top_logprobs"][0]["bytes"] == [euro[0]]


def test_completions_keep_the_likelier_of_two_alternatives_that_read_alike_and_offsets_count_characters():
    euro = "€".encode()
    texts = [" a", logprob_text(euro[:1]), logprob_text(euro[1:]), "b"]
    tops = [["x", "y", "x"]] * 4  # ids 7 and 9, say, both read "x"
    got = choice_logprobs(outputs(texts, tops, [[-0.5, -1.0, -2.0]] * 4), 0, chat=False)
    assert got["top_logprobs"][0] == {"x": -0.5, "y": -1.0}
    # " a" at 0, the euro sign's bytes both at 2 (where it starts), "b" after it at 3
    assert got["text_offset"] == [0, 2, 2, 3]
