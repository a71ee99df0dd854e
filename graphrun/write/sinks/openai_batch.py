"""openai_batch shards (output.format openai_batch): part-00000.jsonl, one OpenAI Batch API
output line per request, in input order: {id, custom_id, response: {status_code, request_id,
body: chat.completion | text_completion}, error}, a choice per sample (index 0 to n-1) and
usage's completion_tokens summed over them; a request graphrun rejected gets its line
too, with status_code 400 and error {code, message} (Shards hands the rejects over in order).
"""

from __future__ import annotations

import codecs
import hashlib
import time
from pathlib import Path

import numpy as np

from graphrun.generate.records import SAMPLES_OUTPUT
from graphrun.generate.token_bytes import text_bytes
from graphrun.spec.endpoints import CHAT, COMPLETIONS, file_endpoint
from graphrun.spec.keys import PipelineSpec
from graphrun.write.sinks.ids import plain
from graphrun.write.sinks.jsonl import JsonlSink
from graphrun.write.strict_json import strict_dumps

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # graphrun's -> OpenAI's
ERROR_CODE = "invalid_request"


def endpoint_of(spec: PipelineSpec) -> str:
    """The url the output's lines answer: a Batch file's own, chat records' chat, else
    completions."""
    if spec.data.format == "openai_batch":
        return file_endpoint(spec.data.path) or CHAT
    return CHAT if spec.data.chat is not None else COMPLETIONS


def model_name(spec: PipelineSpec) -> str:
    m = spec.model
    if m.hf is not None:
        return Path(m.hf.path).name or m.hf.path
    return m.builtin or spec.name


def _hex(kind: str, rid) -> str:
    """A stable id for a request's line (the same on a resumed or repeated run)."""
    return hashlib.sha256(f"{kind}:{rid}".encode()).hexdigest()[:24]


def choice_logprobs(outputs: dict, i: int, chat: bool) -> dict | None:
    """Record i's choices[].logprobs (None where it asked none): chat's {content: [{token,
    logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], refusal}, completions' {tokens,
    token_logprobs, top_logprobs: [{token: logprob}], text_offset} (offsets in the completion)."""
    lps = outputs["logprobs"][i]
    if not len(lps):
        return None
    texts, tops = outputs["tokens"][i].tolist(), outputs["top_tokens"][i].tolist()
    top_lps, lps = outputs["top_logprobs"][i].tolist(), lps.tolist()
    if chat:
        def entry(text: str, lp: float) -> dict:
            return {"token": text, "logprob": lp, "bytes": text_bytes(text)}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in zip(ta, tb)]}
                            for t, lp, ta, tb in zip(texts, lps, tops, top_lps)],
                "refusal": None}
    return {"tokens": texts, "token_logprobs": lps,
            "top_logprobs": [_ranked(ta, tb) for ta, tb in zip(tops, top_lps)],
            "text_offset": text_offsets(texts)}


def _ranked(texts: list[str], logprobs: list[float]) -> dict[str, float]:
    """Completions' {token: logprob} of one position, most likely first: where two ids read as
    one text, the likelier one's value stands."""
    out: dict[str, float] = {}
    for text, lp in zip(texts, logprobs):
        out.setdefault(text, lp)
    return out


def text_offsets(texts: list[str]) -> list[int]:
    """Where each token starts in the completion's text, in characters: a token inside a
    character (part of its bytes) starts where that character does."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(decoder.decode(bytes(text_bytes(text))))
    return offsets


class OpenAIBatchSink(JsonlSink):
    """JSONL lines shaped as the Batch API's output file; bound to one spec by bound()."""

    takes_rejects = True
    chat = True
    model = ""

    @classmethod
    def bound(cls, spec: PipelineSpec) -> type["OpenAIBatchSink"]:
        return type(cls.__name__, (cls,), {"chat": endpoint_of(spec) == CHAT,
                                           "model": model_name(spec)})

    @staticmethod
    def check(outputs: dict) -> None:
        pass  # the generation job's own outputs: the format reads them by name

    def add(self, ids, outputs: dict) -> None:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        created = int(time.time())
        for i, rid in enumerate(ids):
            rid = plain(rid)
            prompt, new = int(outputs["prompt_tokens"][i]), int(outputs["output_tokens"][i])
            samples = outputs[SAMPLES_OUTPUT][i]
            body = {"id": ("chatcmpl-" if self.chat else "cmpl-") + _hex("body", rid),
                    "object": "chat.completion" if self.chat else "text_completion",
                    "created": created, "model": self.model,
                    "choices": [self._choice(k, s) for k, s in enumerate(samples)],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": new,
                              "total_tokens": prompt + new}}
            self._line(rid, rid, {"status_code": 200, "request_id": "req_" + _hex("req", rid),
                                  "body": body}, None)

    def _choice(self, index: int, sample: dict) -> dict:
        text = sample["text"]
        choice = ({"index": index, "message": {"role": "assistant", "content": text}}
                  if self.chat else {"index": index, "text": text})
        lp = sample.get("logprobs")  # the sample's own logprob outputs, one row
        choice.update(logprobs=choice_logprobs(lp, 0, self.chat) if lp else None,
                      finish_reason=FINISH[sample["finish_reason"]])
        return choice

    def add_reject(self, rid, where: str, reason: str) -> None:
        """A request graphrun did not serve: its error line."""
        rid = plain(rid)
        key = (rid, where)  # a repeated or missing custom_id's line has an id of its own
        self._line(rid, key, {"status_code": 400, "request_id": "req_" + _hex("req", key),
                              "body": None},
                   {"code": ERROR_CODE, "message": f"{reason} ({where})"})

    def _line(self, rid, key, response: dict, error: dict | None) -> None:
        line = {"id": "batch_req_" + _hex("line", key), "custom_id": rid,
                "response": response, "error": error}
        self.f.write(strict_dumps(line, separators=(",", ":"), ensure_ascii=False) + "\n")
