"""`graphrun init --hf`, the text half: which field holds the text, and the batch and seq
buckets planned for the batches the run forms from the sampled texts' token lengths
(init/hf.py and init/generate.py plan with these)."""

from __future__ import annotations

import numpy as np

from graphrun.base.errors import InputError

GRAPHS = 12  # graphs planned per text job: each seq value less padding; unselected are never set up
GROUP_CAP = 16384  # records per window at most: a window's inputs and outputs wait in memory
SEQ_MULTIPLE = 8  # seq values are multiples of 8 (GPU kernels favour them), up to the limit
TEXT_NAMES = ("text", "sentence", "sentences", "content", "prompt", "query", "document")
# a text this many times longer than the sample's 95th percentile is an outlier: planned
# without, so that one huge record does not set the buckets of every batch
OUTLIER_TIMES = 4


def text_field(profile, prefer: tuple[str, ...] = TEXT_NAMES) -> str:
    """The string field holding the text: one named as `prefer` names (in its order), else
    the only one."""
    texts = profile.texts
    if not texts:
        raise InputError("holds no text field (no string field besides the id"
                         + (f" {profile.id_field!r}" if profile.id_field else "") + "); "
                         "init --hf tokenizes a text field: give a .jsonl or .parquet file "
                         "whose records hold the text as a string" + _not_messages(profile),
                         where=str(profile.path))
    named = [n for n in prefer if n in texts]
    # a named field blank in most records (Alpaca's optional `input`) is no prompt beside one
    # that holds text
    held = [n for n in named if 2 * sum(_blank(v) for v in texts[n]) < len(texts[n])]
    if named:
        return (held or named)[0]
    if len(texts) == 1:
        return next(iter(texts))
    raise InputError(f"holds several string fields ({', '.join(texts)}) and none is named "
                     f"{' or '.join(prefer[:2])}: rename the text field to `{prefer[0]}`, or "
                     "pass --id-field for the one that is the id", where=str(profile.path))


def _blank(value) -> bool:
    """Whether a sampled value holds no text: an empty or whitespace string, or none."""
    return not isinstance(value, str) or not value.strip()


def _not_messages(profile) -> str:
    """What to do with a field of conversations in another shape than OpenAI's messages
    (ShareGPT's {from, value}): init writes data.chat only for messages with a role."""
    for name, values in profile.objects.items():
        turns = [v for v in values if isinstance(v, list) and v]
        if turns and all(isinstance(m, dict) for v in turns for m in v):
            keys = sorted({k for v in turns for m in v for k in m if isinstance(k, str)})
            return (f", or chat messages: field {name!r} holds lists of objects with keys "
                    f"{', '.join(keys[:4])}, not messages {{role, content}} (role system, "
                    "user or assistant): rename them so (ShareGPT's from: human/gpt and value "
                    "are role: user/assistant and content) and init writes a chat job")
    return ""


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


def texts_of(profile, field: str | list[str], ids: bool = False) -> list:
    """The sampled texts (a pair's as tuples) whose fields all hold strings; ids: a
    generation job's prompts, token ids too (1-D integer arrays)."""
    names = [field] if isinstance(field, str) else field
    rows = zip(*(_column(profile, n) for n in names))
    return [row[0] if len(names) == 1 else row for row in rows
            if all(_prompt(t, ids) for t in row)]


def _column(profile, name: str) -> list:
    """A text field's sampled values, or a field of token ids' (profile.token_ids)."""
    return profile.texts[name] if name in profile.texts else profile.token_ids[name]


def _prompt(value, ids: bool) -> bool:
    """A string, or with ids a prompt of token ids the run takes (read/prompts.given_ids; the
    sample holds a list as an array)."""
    from graphrun.read.prompts import given_ids

    return isinstance(value, str) or (ids and isinstance(value, np.ndarray) and value.ndim == 1
                                      and not isinstance(given_ids(value.tolist(), ""), str))


def non_texts(profile, field: str | list[str], generate: bool = False,
              vocab: int | None = None) -> list[str]:
    """"file:line: why" for each sampled record texts_of leaves out, with run's reason: the
    record's own (no text field, a bad id; read/text.record_problem) where the sample kept
    the records, else its text's. generate: a prompt of token ids is no bad record (the run
    reads it, and init plans the buckets from its length) unless an id is at or past the
    model's `vocab` ids."""
    from graphrun.read.text import record_problem

    names = [field] if isinstance(field, str) else field
    columns = [_column(profile, n) for n in names]
    wheres = profile.wheres or [f"record {i + 1}" for i in range(len(columns[0]))]
    rows = profile.rows or [dict(zip(names, values)) for values in zip(*columns)]
    out = []
    for where, record in zip(wheres, rows):
        why = ((record_problem(record, names, profile.id_field) if profile.rows else "")
               or _text_problem(record, names, generate, vocab))
        if why:
            out.append(f"{where}: {why}")
    return out


def repeated_ids(profile, bad: set[str]) -> list[str]:
    """"file:line: why" for each sampled record, not already bad (bad: places), whose id an
    earlier such record holds: the run rejects it with this reason (read/ids.py, which
    compares ids as text)."""
    from graphrun.read.ids import id_texts

    if not profile.id_field or not profile.rows:
        return []
    seen, out = set(), []
    for where, row in zip(profile.wheres, profile.rows):
        value = row.get(profile.id_field)
        if where in bad or type(value) not in (str, int):
            continue
        text = id_texts([value])[0]
        if text in seen:
            out.append(f"{where}: duplicate id {value!r}: an earlier record has the same id")
        seen.add(text)
    return out


def _text_problem(record: dict, names: list[str], generate: bool,
                  vocab: int | None = None) -> str:
    """The run's reason for a record's text fields (read/prompts.Prompts.of, and for token
    ids read/text.past_vocab against the model's `vocab` ids), or ""."""
    from graphrun.read.prompts import given_ids, kind
    from graphrun.read.text import past_vocab

    for name in names:
        value = record[name]
        value = value.tolist() if isinstance(value, np.ndarray) else value
        if isinstance(value, str):
            continue
        if generate and isinstance(value, list):  # a generation job reads token ids
            why = given_ids(value, name)
            if isinstance(why, str):
                return why
            return (past_vocab(value, vocab, name) or "") if vocab is not None else ""
        return f"{name}: expected a string, got {kind(value)}"
    return ""


def text_wheres(profile, field: str | list[str], ids: bool = False) -> list[str]:
    """Where each of texts_of's texts is in the file (file:line), in the same order."""
    names = [field] if isinstance(field, str) else field
    column = _column(profile, names[0])
    wheres = profile.wheres or [f"record {i + 1}" for i in range(len(column))]
    return [w for w, *row in zip(wheres, *(_column(profile, n) for n in names))
            if all(_prompt(t, ids) for t in row)]


def outliers(lengths: np.ndarray) -> np.ndarray:
    """[n] bool: the texts far longer than the rest (OUTLIER_TIMES the 95th percentile)."""
    if len(lengths) < 20:  # too few to tell the rest's spread
        return np.zeros(len(lengths), dtype=bool)
    return lengths > OUTLIER_TIMES * max(float(np.percentile(lengths, 95)), SEQ_MULTIPLE)


def token_lengths(tokenizer, texts: list, special: bool = True) -> np.ndarray:
    """Each text's (or pair's) length in tokens (special tokens included, unless the texts
    hold theirs: rendered chats), uncut; a prompt of token ids (an integer array) is its own
    length, as the run takes it."""
    import copy

    words = [t for t in texts if not isinstance(t, np.ndarray)]
    if words:
        backend = copy.deepcopy(tokenizer.backend_tokenizer)  # truncation off on our copy only
        backend.no_truncation()
        backend.no_padding()
        encoded = iter(backend.encode_batch(words, add_special_tokens=special))
    return np.array([len(t) if isinstance(t, np.ndarray) else len(next(encoded).ids)
                     for t in texts] or [1], dtype=np.int64)


def group_window(profile, batch_size: int, most: int = GROUP_CAP) -> int:
    """data.group_by_length for a text file: the whole file in one window where it holds at
    most `most` records, else windows of about `most` in whole batches."""
    cap = -(-most // batch_size) * batch_size
    return min(profile.records, cap) if profile.records else cap


def batch_shapes(lengths: np.ndarray, batch_size: int, window: int | None,
                 slack: int = 0) -> list[tuple]:
    """(records, longest, tokens) of each batch the run forms from these lengths: cut in file
    order, or (window) from each window sorted by length, as read/grouping.py does. slack:
    the longest is taken over the next `slack` records of the window too."""
    out = []
    for start in range(0, len(lengths), window or len(lengths)):
        part = lengths[start:start + (window or len(lengths))]
        part = np.sort(part, kind="stable") if window else part
        for b in range(0, len(part), batch_size):
            rows = part[b:b + batch_size]
            out.append((len(rows), int(part[b:b + batch_size + slack].max()), int(rows.sum())))
    return out


SAMPLE_WINDOWS = 64  # whole windows a file's plan weighs at most against its last, short one


def file_batch_shapes(lengths: np.ndarray, batch_size: int, window: int, records: int,
                      slack: int = 0) -> list[tuple]:
    """batch_shapes of a file of `records` records grouped in windows of `window`, known from
    a sample of it (`lengths`): each window's lengths taken as distributed as the sample's, a
    batch cut at ranks [a, b) of its sorted window gets the sample's length at rank b's
    quantile as its longest. (The sample cut into its share of a window instead gives every
    window a short last batch, which whole windows of whole batches do not have, and batches
    four times as wide in length.)"""
    srt = np.sort(lengths)
    s = len(srt)
    total = np.concatenate([[0], np.cumsum(srt)])
    full, rest = divmod(records, window)
    out = []
    for n, times in ((window, min(full, SAMPLE_WINDOWS)), (rest, 1 if rest else 0)):
        rows = []
        for a in range(0, n, batch_size):
            b = min(a + batch_size, n)
            top = min(s - 1, -(-(b + slack) * s // n) - 1)
            lo = min(s - 1, a * s // n)
            hi = max(lo + 1, -(-b * s // n))
            rows.append((b - a, int(srt[top]), round((total[hi] - total[lo]) / (hi - lo) * (b - a))))
        out += rows * times
    return out


def plan_grouped(found, texts: list[str], tokenizer, limit: int, *,
                 window_most: int = GROUP_CAP, slack: int = 0, planner=None,
                 evaluator=None, special: bool = True):
    """found (init_hf.HfInferred): data.group_by_length (found.window), and the batch and seq
    buckets planned for the batches grouping forms from the sampled texts' token lengths,
    never past `limit`; found.padding: the token padding expected (batches in file order with
    their own best plan, then grouped). planner: histogram -> Evaluation, by default
    plan/planner.py's plan of at most GRAPHS graphs; evaluator: (histogram, lists) -> its
    Evaluation, by default plan/planner.py's evaluate. slack: a batch's need covers the next
    `slack` records too (batch_shapes), so that a record the run rejects and the sample did
    not, which moves every later cut of its window by one, still finds its bucket; the padding
    expected is that of the batches' own lengths. Returns the grouped batches' histogram."""
    from graphrun.plan.auto import covering
    from graphrun.plan.planner import batches_histogram, evaluate, plan
    from graphrun.spec.keys import BATCH

    if planner is None:
        def planner(hist):
            return plan(hist, GRAPHS, {"seq": SEQ_MULTIPLE})
    evaluator = evaluator or evaluate
    p = found.profile
    lengths = token_lengths(tokenizer, texts, special)
    whole = p.whole
    found.limit, found.lengths = limit, (int(lengths.min()), int(lengths.max()))
    far = outliers(lengths)
    if far.any():  # the seq buckets are planned without them (said)
        generate = found.task is not None and found.task.kind == "generate"
        wheres = (found.prompt_wheres if found.prompt_wheres is not None
                  else text_wheres(p, found.text_field, generate))
        found.outliers = [(wheres[i] if i < len(wheres) else f"text {i + 1}", int(lengths[i]))
                          for i in np.flatnonzero(far)]
        # a generation job rejects them; otherwise the run cuts them at the largest bucket,
        # so they join the batches as long as the longest of the rest
        lengths = lengths[~far] if generate else np.where(far, lengths[~far].max(), lengths)
    found.truncate = not whole or found.lengths[1] > limit or bool(found.outliers)
    found.window = group_window(p, found.batch_size, window_most)
    # a sample of part of the file stands for the file's windows (file_batch_shapes)
    sampled = not whole and bool(p.records)
    cut = np.minimum(lengths, limit)
    axes = (BATCH, "seq")
    # a text the sample did not see is cut at the limit, or at the largest bucket (outliers)
    every = {} if whole or found.outliers else {"seq": limit}

    def shapes(group: int | None, slack: int = 0) -> list[tuple]:
        if group is not None and sampled:
            return file_batch_shapes(cut, found.batch_size, group, p.records, slack)
        return batch_shapes(cut, found.batch_size, group, slack)

    def planned(group: int | None):
        needs = batches_histogram(axes, shapes(group, slack), prompts=cut)
        own = batches_histogram(axes, shapes(group), prompts=cut)
        chosen = planner(covering(needs, every, {"seq": limit}))
        return chosen, evaluator(own, chosen.lists), own

    chosen, grouped, batches = planned(found.window)
    _, in_order, _ = planned(None)
    found.buckets = {BATCH: chosen.lists[BATCH], "seq": chosen.lists["seq"]}
    if found.outliers:
        found.max_length = found.buckets["seq"][-1]
    found.padding = (in_order.waste, grouped.waste)
    return batches
