"""`graphrun init --hf`, the text half: which field holds the text, and seq buckets from the
sampled texts' token lengths (init_hf.py and init_generate.py plan with these)."""

from __future__ import annotations

import numpy as np

from graphrun.base.errors import InputError
from graphrun.init.infer import propose_buckets

SEQ_VALUES = 4  # seq bucket values fitted to the sample's lengths, before the model's limit
TEXT_NAMES = ("text", "sentence", "sentences", "content", "prompt", "query", "document")


def text_field(profile, prefer: tuple[str, ...] = TEXT_NAMES) -> str:
    """The string field holding the text: one named as `prefer` names (in its order), else
    the only one."""
    texts = profile.texts
    if not texts:
        raise InputError("holds no text field (no string field besides the id"
                         + (f" {profile.id_field!r}" if profile.id_field else "") + "); "
                         "init --hf tokenizes a text field: give a .jsonl or .parquet file "
                         "whose records hold the text as a string", where=str(profile.path))
    named = [n for n in prefer if n in texts]
    if named:
        return named[0]
    if len(texts) == 1:
        return next(iter(texts))
    raise InputError(f"holds several string fields ({', '.join(texts)}) and none is named "
                     f"{' or '.join(prefer[:2])}: rename the text field to `{prefer[0]}`, or "
                     "pass --id-field for the one that is the id", where=str(profile.path))


# field names of a pair of texts a cross-encoder scores together, as datasets name them
PAIR_NAMES = (("query", "passage"), ("query", "document"), ("question", "passage"),
              ("question", "context"), ("question", "answer"), ("sentence1", "sentence2"),
              ("text", "text_pair"), ("premise", "hypothesis"))


def chosen_fields(profile, given: str | None, pairs: bool,
                  prefer: tuple[str, ...] = TEXT_NAMES) -> str | list[str]:
    """data.text.field: --text-field's one name or two (comma-separated), else for a model
    that scores pairs (a classifier) a pair named as PAIR_NAMES names one, else the one text
    field text_field() picks."""
    if given is not None:
        names = [n.strip() for n in given.split(",")]
        if not 1 <= len(names) <= 2 or not all(names) or len(set(names)) != len(names):
            raise InputError(f"--text-field {given!r}: give one field, or two different ones "
                             "joined by a comma for a pair (--text-field query,passage)")
        absent = [n for n in names if n not in profile.texts]
        if absent:
            raise InputError(f"--text-field: no string field {absent[0]!r} in the records "
                             f"(string fields: {', '.join(profile.texts) or 'none'})",
                             where=str(profile.path))
        return names[0] if len(names) == 1 else names
    if pairs:
        for pair in PAIR_NAMES:
            if all(n in profile.texts for n in pair):
                return list(pair)
    return text_field(profile, prefer)


def texts_of(profile, field: str | list[str]) -> list:
    """The sampled texts (a pair's as tuples) whose fields all hold strings."""
    names = [field] if isinstance(field, str) else field
    rows = zip(*(profile.texts[n] for n in names))
    return [row[0] if len(names) == 1 else row for row in rows
            if all(isinstance(t, str) for t in row)]


def token_lengths(tokenizer, texts: list[str]) -> np.ndarray:
    """Each text's (or pair's) length in tokens (special tokens included), uncut."""
    import copy

    backend = copy.deepcopy(tokenizer.backend_tokenizer)  # truncation off on our copy only
    backend.no_truncation()
    backend.no_padding()
    return np.array([len(e.ids) for e in backend.encode_batch(texts)] or [1], dtype=np.int64)


def plan_seq(found, texts: list[str], tokenizer, limit: int,
             window: int | None = None) -> None:
    """found (init_hf.HfInferred): its buckets (seq from the texts' token lengths) and
    whether longer texts are cut. window: data.group_by_length, whose batches are cut from
    each window sorted by length."""
    p = found.profile
    lengths = token_lengths(tokenizer, texts)
    whole = p.records is not None and p.records <= p.sampled
    found.limit, found.lengths = limit, (int(lengths.min()), int(lengths.max()))
    batched = lengths if window is None else np.concatenate(
        [np.sort(lengths[s:s + window]) for s in range(0, len(lengths), window)])
    found.buckets = {**propose_buckets(p, found.batch_size, {}),
                     "seq": seq_values(batched, found.batch_size, limit, whole)}
    found.truncate = not whole or found.lengths[1] > limit


def seq_values(lengths: np.ndarray, batch_size: int, limit: int, whole: bool) -> list[int]:
    """The seq bucket values: SEQ_VALUES fitted to what the sample's batches need (each its
    longest text, in file order, rounded up to a multiple of 8, which GPU kernels favour)
    with the least padding (plan.best_values); unless the sample is the whole file, then the
    model's limit too, so that a text the sample did not see is cut where the model would
    cut it, never at the sample's longest."""
    from graphrun.plan.planner import best_values

    cut = np.minimum(-(-lengths // 8) * 8, limit)
    starts = range(0, len(cut), batch_size)
    needs = np.array([cut[s:s + batch_size].max() for s in starts], dtype=np.int64)
    weights = np.array([len(cut[s:s + batch_size]) for s in starts], dtype=np.float64)
    values = best_values(needs, weights, SEQ_VALUES)
    return sorted(set(values) | (set() if whole else {limit}))
