"""What the reward server accepts, checked field by field before anything is held: verl's request (one sample, from
`trl_longrm.rewards.verl.JudgeRewardManager`) and OpenRLHF's (`--reward.remote_url`: `query`, `prompts`, `labels`).

A request that breaks a rule is refused alone with a 4xx naming the field (`BadRequest`); it never joins a group, so
one bad sample cannot fail its siblings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


VERL_FIELDS = ("uid", "group_size", "prompt", "response")
OPENRLHF_FIELDS = ("query", "prompts", "labels")
MESSAGE_FIELDS = ("role", "content")


class BadRequest(Exception):
    """A request the server refuses: `status` (400, 413, ...) and a message naming the field at fault."""

    def __init__(self, message: str, status: int = 400, field: str | None = None):
        super().__init__(message)
        self.status, self.field = status, field


@dataclass
class Sample:
    """One sample to reward: its group key (verl's `uid`, OpenRLHF's prompt text), the prompt the judge reads (text
    or chat messages), the response, and the group size it was sent with (None: the server's `--group-size`)."""

    key: str
    prompt: object
    response: str
    group_size: int | None = None


def parse_json(body: bytes) -> object:
    """The request body as JSON, or `BadRequest` saying why not (not UTF-8, not JSON, nested past what the parser
    takes)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadRequest(f"the body is not UTF-8 ({error.reason} at byte {error.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise BadRequest(f"the body is not JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    except RecursionError:
        raise BadRequest("the body's JSON is nested too deeply") from None


def _unknown(payload: dict, allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(set(payload) - set(allowed))
    if extra:
        raise BadRequest(f"{where}: unknown field(s) {extra}; the fields are {list(allowed)}", field=extra[0])


def _object(payload, where: str) -> dict:
    if not isinstance(payload, dict):
        raise BadRequest(f"{where}: the body must be a JSON object, got {type(payload).__name__}")
    return payload


def check_prompt(prompt, field: str) -> object:
    """A prompt the judge can read: text, or a non-empty list of `{"role", "content"}` messages of text."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest(f"`{field}` must be text or a non-empty list of chat messages, got {_kind(prompt)}", field=field)
    for i, message in enumerate(prompt):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"`{where}` must be a message object, got {_kind(message)}", field=field)
        _unknown(message, MESSAGE_FIELDS, f"`{where}`")
        for key in MESSAGE_FIELDS:
            if not isinstance(message.get(key), str):
                raise BadRequest(f"`{where}.{key}` must be text, got {_kind(message.get(key))}", field=field)
    return prompt


def _kind(value) -> str:
    return "nothing" if value is None else type(value).__name__


def verl_sample(payload, max_group_size: int) -> Sample:
    """The sample of a `POST /verl` body: `{"uid", "group_size", "prompt", "response"}`."""
    payload = _object(payload, "/verl")
    _unknown(payload, VERL_FIELDS, "/verl")
    for key in ("uid", "prompt", "response"):
        if key not in payload:
            raise BadRequest(f"/verl: the field `{key}` is missing", field=key)
    uid = payload["uid"]
    if isinstance(uid, bool) or not isinstance(uid, (str, int)) or uid == "":
        raise BadRequest(f"`uid` must be non-empty text or an integer, got {uid!r:.80}", field="uid")
    size = payload.get("group_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= max_group_size):
        raise BadRequest(f"`group_size` must be an integer from 1 to {max_group_size}, got {size!r:.80}", field="group_size")
    if not isinstance(payload["response"], str):
        raise BadRequest(f"`response` must be text, got {_kind(payload['response'])}", field="response")
    return Sample(str(uid), check_prompt(payload["prompt"], "prompt"), payload["response"], size)


def openrlhf_samples(payload, special_tokens: list[str]) -> list[Sample]:
    """The samples of an OpenRLHF body: `{"query": [...], "prompts": [...], "labels": [...]}`, lists of equal length
    (OpenRLHF's executor sends one sample), each grouped by its prompt text. The labels (a rule reward's ground truth)
    are not read by a judge."""
    payload = _object(payload, "OpenRLHF's request")
    _unknown(payload, OPENRLHF_FIELDS, "OpenRLHF's request")
    lists = {}
    for key in ("query", "prompts"):
        if key not in payload:
            raise BadRequest(f"OpenRLHF's request: the field `{key}` is missing", field=key)
        value = payload[key]
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise BadRequest(f"`{key}` must be a non-empty list of texts, got {_kind(payload[key])}", field=key)
        lists[key] = value
    labels = payload.get("labels")
    if isinstance(labels, list) and len(labels) != len(lists["query"]):
        raise BadRequest(f"`labels` has {len(labels)} entries for {len(lists['query'])} queries", field="labels")
    if len(lists["prompts"]) != len(lists["query"]):
        raise BadRequest(f"`prompts` has {len(lists['prompts'])} entries for {len(lists['query'])} queries", field="prompts")
    return [Sample(p, p, openrlhf_response(q, p, special_tokens)) for q, p in zip(lists["query"], lists["prompts"])]


def openrlhf_response(query: str, prompt: str, special: list[str]) -> str:
    """The response in OpenRLHF's query: the prompt the policy saw, then the response, decoded with special tokens.

    OpenRLHF cuts a prompt too long for `--max_len` from the front (keeping its last tokens) before generating, and the
    query is the decoded cut prompt plus the response: the response is then what follows the longest end of the prompt
    that the query starts with (a cut inside a character decodes to U+FFFD first, dropped). Trailing special tokens of
    the judge's tokenizer (the policy's end-of-turn token) are removed."""
    if query.startswith(prompt):
        response = query[len(prompt) :]
    else:
        response = _after_prompt_tail(query.lstrip("\ufffd"), prompt)
    stripped = True
    while stripped:
        stripped = False
        response = response.rstrip()
        for token in special:
            if token and response.endswith(token):
                response = response[: -len(token)]
                stripped = True
    return response


def _after_prompt_tail(query: str, prompt: str) -> str:
    """`query` after the longest suffix of `prompt` it starts with (the whole query when it starts with none).

    The query's first characters are looked up in the prompt (`str.find`, fast), and each place checked from the
    earliest (the longest suffix): a long prompt costs a few scans, not a character-by-character match."""
    probe = query[: min(64, len(query))]
    start = prompt.find(probe) if probe else -1
    while start >= 0:
        tail = prompt[start:]
        if query.startswith(tail):
            return query[len(tail) :]
        start = prompt.find(probe, start + 1)
    # The cut prompt is shorter than the probe: the longest suffix of the prompt that starts the query (of a few
    # characters at least: a response that merely starts as the prompt ends is not cut).
    for size in range(min(len(prompt), len(probe)), 7, -1):
        if query.startswith(prompt[-size:]):
            return query[size:]
    return query
