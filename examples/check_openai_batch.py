"""Check an OpenAI Batch output file against the Batch API's output line shape, and against the
request file it answers: one line per request, in the requests' order.

    python examples/check_openai_batch.py requests.jsonl runs/batch/part-00000.jsonl ...
    python examples/check_openai_batch.py --n 2 requests.jsonl ...   # the spec's generate.n

Exits 1 and prints each problem where a line does not have the shape the Batch API writes:
{id, custom_id, response: {status_code, request_id, body: {id, object, created, model,
choices: [{index, message: {role, content} | text, logprobs, finish_reason}] (one per sample
of the request's n), usage: {prompt_tokens, completion_tokens, total_tokens}}}, error: null |
{code, message}}.
"""

from __future__ import annotations

import json
import sys

OBJECTS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion"}


def line_problems(line: dict, url: str, n: int = 1) -> list[str]:
    """What is wrong with one output line answering a request to `url` for `n` samples ([] if
    nothing)."""
    bad = []
    if set(line) != {"id", "custom_id", "response", "error"}:
        return [f"keys {sorted(line)}, expected id, custom_id, response, error"]
    if not isinstance(line["id"], str) or not line["id"]:
        bad.append("id is not a non-empty string")
    response, error = line["response"], line["error"]
    if error is not None:
        if not (isinstance(error, dict) and isinstance(error.get("message"), str)
                and isinstance(error.get("code"), str)):
            bad.append("error is not {code, message}")
        if response is not None and response.get("status_code", 400) < 400:
            bad.append("an error line with a success status")
        return bad
    if not isinstance(response, dict) or response.get("status_code") != 200:
        return bad + ["response is not {status_code: 200, ...} on a line without error"]
    if not isinstance(response.get("request_id"), str):
        bad.append("response.request_id is not a string")
    body = response.get("body")
    if not isinstance(body, dict):
        return bad + ["response.body is not an object"]
    for key, kind in (("id", str), ("object", str), ("created", int), ("model", str),
                      ("choices", list), ("usage", dict)):
        if not isinstance(body.get(key), kind):
            bad.append(f"body.{key} is not a {kind.__name__}")
    if bad:
        return bad
    if body["object"] != OBJECTS[url]:
        bad.append(f"body.object {body['object']!r}, expected {OBJECTS[url]!r}")
    if len(body["choices"]) != n:
        bad.append(f"{len(body['choices'])} choices for n {n}")
    for k, choice in enumerate(body["choices"]):
        if choice.get("index") != k:
            bad.append(f"choices[{k}].index is {choice.get('index')!r}")
        if choice.get("finish_reason") not in ("stop", "length"):
            bad.append(f"choices[{k}].finish_reason {choice.get('finish_reason')!r}")
        if "logprobs" not in choice:
            bad.append(f"choices[{k}] has no logprobs key")
        if url == "/v1/chat/completions":
            message = choice.get("message")
            if not (isinstance(message, dict) and message.get("role") == "assistant"
                    and isinstance(message.get("content"), str)):
                bad.append(f"choices[{k}].message is not {{role: assistant, content: str}}")
        elif not isinstance(choice.get("text"), str):
            bad.append(f"choices[{k}].text is not a string")
    usage = body["usage"]
    counts = [usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")]
    if not all(isinstance(c, int) and c >= 0 for c in counts) or counts[0] + counts[1] != counts[2]:
        bad.append(f"usage {usage} is not three counts with total = prompt + completion")
    return bad


def check(requests: list[dict], outputs: list[dict], default_n: int = 1) -> list[str]:
    """Problems of a whole output: every request answered once, in order, each line's shape
    and its choices (the request's n, else default_n: the spec's generate.n)."""
    bad = []
    if len(outputs) != len(requests):
        bad.append(f"{len(outputs)} output lines for {len(requests)} requests")
    for k, (request, line) in enumerate(zip(requests, outputs)):
        if line.get("custom_id") != request.get("custom_id"):
            bad.append(f"line {k + 1}: custom_id {line.get('custom_id')!r}, expected "
                       f"{request.get('custom_id')!r} (input order)")
        url = request.get("url") if request.get("url") in OBJECTS else "/v1/chat/completions"
        body = request.get("body") if isinstance(request.get("body"), dict) else {}
        n = body.get("n") if type(body.get("n")) is int else default_n
        bad += [f"line {k + 1}: {p}" for p in line_problems(line, url, n)]
    return bad


def read_lines(path: str, strict: bool) -> list[dict]:
    """A JSONL file's objects; a request line that is not JSON stands as {} (it gets an
    error line, whose custom_id is null)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            if raw.strip():
                try:
                    out.append(json.loads(raw))
                except ValueError:
                    if strict:
                        raise
                    out.append({"custom_id": None})
    return out


def main(argv: list[str]) -> int:
    default_n = 1
    if argv[:1] == ["--n"] and len(argv) > 1 and argv[1].isdigit():
        default_n, argv = int(argv[1]), argv[2:]
    if len(argv) < 2:
        print(__doc__)
        return 2
    try:
        requests = read_lines(argv[0], strict=False)
        outputs = [line for path in argv[1:] for line in read_lines(path, strict=True)]
    except (OSError, ValueError) as e:
        print(f"cannot read: {e}")
        return 1
    bad = check(requests, outputs, default_n)
    for problem in bad:
        print(problem)
    print(f"{len(outputs)} lines, {len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
