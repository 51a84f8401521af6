"""Normalisation of one row of preference or SFT data into the canonical records the trainers consume.

Canonical preference group: `prompt` (list of `{"role", "content"}` messages, or a plain string for TRL's standard
format), `chosen` (str), `rejected` (list[str], at least one), `margin` (float) when the source has one, and
`chat_template_kwargs` (a JSON object as a string) when the source has TRL's per-row `tools` or `chat_template_kwargs`
columns: the arguments RewardTrainer passes to the chat template for that row, `{"tools": ..., **chat_template_kwargs}`
(JSON, so that rows with different tools or arguments share one Arrow type). A conversational completion of several
messages or with tool calls (TRL's tool-call data: the assistant's call, the tool's answer, the assistant's reply) is
kept whole: the record then has `completion_messages=True`, and each of its responses is the JSON text of its list of
messages (plain responses of that row included, as one assistant message).

Canonical SFT example: `messages` (list of messages with at least one assistant turn) for conversational data, or
`prompt` (str) + `completion` (str) for TRL's standard prompt/completion data.

Supported input layouts:
- LongRM preference: `chat_template` (messages) + `chosen` (str) + `rejects` (list[str]).
- TRL preference, explicit prompt: `prompt` + `chosen` + `rejected` (strings, or message lists: one assistant message,
  or several messages / tool calls); `rejected` may be one response or a list of them.
- TRL preference, implicit prompt: `chosen` + `rejected` holding full conversations (or strings) sharing a prefix; the
  prefix becomes the prompt (TRL's `extract_prompt`).
- LongRM SFT: `chat_template` (messages) + `golden` (the answer, appended as the final assistant turn).
- TRL SFT: `messages`, or `prompt` + `completion` (strings or message lists).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trl.data_utils import extract_prompt

from .errors import DataFormatError


KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool")
DATA_FORMATS = ("auto", "longrm", "trl")
DEFAULT_SOURCE = "<record>"

# Default column names of each layout; explicit `*_key` arguments override them.
LONGRM_PREFERENCE_KEYS = {"prompt": "chat_template", "chosen": "chosen", "rejected": "rejects"}
TRL_PREFERENCE_KEYS = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
LONGRM_SFT_KEYS = {"messages": "chat_template", "completion": "golden"}
TRL_SFT_KEYS = {"messages": "messages", "prompt": "prompt", "completion": "completion"}


@dataclass(frozen=True)
class PreferenceLayout:
    """Resolved layout of a preference source: its format and the column of each field.

    `prompt_optional` is True for TRL data whose prompt column is absent, where the prompt is implicit in
    `chosen`/`rejected`.
    """

    data_format: str
    prompt_key: str
    chosen_key: str
    rejected_key: str
    prompt_optional: bool


@dataclass(frozen=True)
class SFTLayout:
    """Resolved layout of an SFT source. `messages_key` is None for the prompt/completion form."""

    data_format: str
    messages_key: str | None
    prompt_key: str | None
    completion_key: str | None


def _check_format(data_format: str, source: str) -> None:
    if data_format not in DATA_FORMATS:
        raise DataFormatError(
            f"unknown data_format {data_format!r}; expected one of {list(DATA_FORMATS)}", source=source
        )


def resolve_preference_layout(
    columns,
    data_format: str = "auto",
    prompt_key: str | None = None,
    chosen_key: str | None = None,
    rejected_key: str | None = None,
    source: str = DEFAULT_SOURCE,
) -> PreferenceLayout:
    """Pick the preference layout from the column names (or `data_format`) and apply explicit key overrides.

    Example:
    ```python
    >>> resolve_preference_layout(["chat_template", "chosen", "rejects"]).rejected_key
    'rejects'
    ```
    """
    _check_format(data_format, source)
    columns = set(columns)
    if data_format == "auto":
        if "rejects" in columns or ("chat_template" in columns and "prompt" not in columns):
            data_format = "longrm"
        elif "rejected" in columns or (rejected_key is not None and rejected_key in columns):
            data_format = "trl"
        else:
            raise DataFormatError(
                f"cannot detect the preference format from the columns {sorted(columns)}: expected LongRM columns "
                "(`chat_template`, `chosen`, `rejects`) or TRL columns (`prompt`, `chosen`, `rejected`, or `chosen` and "
                "`rejected` with an implicit prompt); pass data_format= and prompt_key/chosen_key/rejected_key",
                source=source,
            )
    defaults = LONGRM_PREFERENCE_KEYS if data_format == "longrm" else TRL_PREFERENCE_KEYS
    resolved_prompt_key = prompt_key or defaults["prompt"]
    return PreferenceLayout(
        data_format=data_format,
        prompt_key=resolved_prompt_key,
        chosen_key=chosen_key or defaults["chosen"],
        rejected_key=rejected_key or defaults["rejected"],
        # Only TRL data may leave the prompt implicit, and only when the user did not name a prompt column.
        prompt_optional=data_format == "trl" and prompt_key is None and resolved_prompt_key not in columns,
    )


def resolve_sft_layout(
    columns,
    data_format: str = "auto",
    messages_key: str | None = None,
    prompt_key: str | None = None,
    completion_key: str | None = None,
    source: str = DEFAULT_SOURCE,
) -> SFTLayout:
    """Pick the SFT layout from the column names (or `data_format`) and apply explicit key overrides.

    Example:
    ```python
    >>> resolve_sft_layout(["prompt", "completion"]).messages_key is None
    True
    ```
    """
    _check_format(data_format, source)
    columns = set(columns)
    if data_format == "auto":
        if "golden" in columns or "chat_template" in columns:
            data_format = "longrm"
        elif messages_key is not None or "messages" in columns or ("prompt" in columns and "completion" in columns):
            data_format = "trl"
        else:
            raise DataFormatError(
                f"cannot detect the SFT format from the columns {sorted(columns)}: expected LongRM columns "
                "(`chat_template`, `golden`) or TRL columns (`messages`, or `prompt` and `completion`); pass "
                "data_format= and messages_key",
                source=source,
            )
    if data_format == "longrm":
        return SFTLayout(
            "longrm",
            messages_key or LONGRM_SFT_KEYS["messages"],
            None,
            completion_key or LONGRM_SFT_KEYS["completion"],
        )
    if messages_key is not None or (TRL_SFT_KEYS["messages"] in columns and prompt_key is None):
        return SFTLayout("trl", messages_key or TRL_SFT_KEYS["messages"], None, None)
    return SFTLayout("trl", None, prompt_key or TRL_SFT_KEYS["prompt"], completion_key or TRL_SFT_KEYS["completion"])


class _RowChecker:
    """Value checks for one row; every failure names the source, row index and key."""

    def __init__(self, row: Any, index: int | None, source: str):
        self.index = index
        self.source = source
        if not isinstance(row, Mapping):
            self.fail(f"a row must be a mapping of column names to values, got {type(row).__name__}")
        self.row = row

    def fail(self, message: str, key: str | None = None):
        raise DataFormatError(message, source=self.source, index=self.index, key=key)

    def layout(self, resolve, *args):
        """The layout of this row alone; a failure names the row too."""
        try:
            return resolve(self.row.keys(), *args, source=self.source)
        except DataFormatError as error:
            self.fail(error.reason)

    def get(self, key: str) -> Any:
        if key not in self.row:
            self.fail(f"missing key; the row has keys {sorted(self.row)}", key)
        return self.present(self.row[key], key)

    def present(self, value: Any, key: str) -> Any:
        if value is None:
            self.fail("missing value (None)", key)
        if isinstance(value, float) and math.isnan(value):
            self.fail("missing value (NaN)", key)
        return value

    def text(self, value: Any, key: str) -> str:
        value = self.present(value, key)
        if not isinstance(value, str):
            self.fail(f"must be a string, got {type(value).__name__}", key)
        if not value.strip():
            self.fail("must be a non-empty string", key)
        return value

    def messages(self, value: Any, key: str) -> list[dict[str, Any]]:
        value = self.present(value, key)
        if not isinstance(value, (list, tuple)):
            self.fail(f"must be a list of {{'role', 'content'}} messages, got {type(value).__name__}", key)
        if not value:
            self.fail("must be a non-empty list of messages", key)
        cleaned = []
        for i, message in enumerate(value):
            where = f"{key}[{i}]"
            is_call = isinstance(message, Mapping) and message.get("content") is None and message.get("tool_calls")
            if not isinstance(message, Mapping) or "role" not in message or ("content" not in message and not is_call):
                self.fail(f"each message must be a mapping with 'role' and 'content', got {message!r:.200}", where)
            role = self.present(message["role"], f"{where}.role")
            if role not in KNOWN_ROLES:
                self.fail(f"unknown role {role!r}; expected one of {list(KNOWN_ROLES)}", f"{where}.role")
            if is_call:
                cleaned.append({k: v for k, v in message.items() if v is not None})  # a tool call: no content
                continue
            content = self.present(message["content"], f"{where}.content")
            if not isinstance(content, str):
                self.fail(f"message content must be a string, got {type(content).__name__}", f"{where}.content")
            # Arrow fills fields that other rows have (e.g. `tool_calls`) with None; they are not part of this message.
            cleaned.append({k: v for k, v in message.items() if v is not None})
        return cleaned

    def prompt(self, value: Any, key: str) -> str | list[dict[str, Any]]:
        value = self.present(value, key)
        if isinstance(value, str):
            return self.text(value, key)
        messages = self.messages(value, key)
        if messages[-1]["role"] == "assistant":
            self.fail(
                "the prompt must not end with an assistant message (the response is the next assistant turn)", key
            )
        return messages

    def completion_messages(self, value: Any, key: str) -> list[dict[str, Any]]:
        """A conversational completion: messages starting with the assistant's; a message may have `tool_calls`
        instead of content (TRL's tool-call format)."""
        if not isinstance(value, (list, tuple)) or not value:
            self.fail("must be a non-empty list of messages", key)
        cleaned = []
        for i, message in enumerate(value):
            where = f"{key}[{i}]"
            if not isinstance(message, Mapping) or "role" not in message:
                self.fail(f"each message must be a mapping with 'role' and 'content', got {message!r:.200}", where)
            role = self.present(message["role"], f"{where}.role")
            if role not in KNOWN_ROLES:
                self.fail(f"unknown role {role!r}; expected one of {list(KNOWN_ROLES)}", f"{where}.role")
            content = message.get("content")
            if content is None and not message.get("tool_calls"):
                self.fail("missing value (None): a message needs content or tool_calls", f"{where}.content")
            if content is not None and not isinstance(content, str):
                self.fail(f"message content must be a string, got {type(content).__name__}", f"{where}.content")
            # Arrow fills fields that other messages have (e.g. `tool_calls`, `name`) with None: not part of this one.
            cleaned.append({k: v for k, v in message.items() if v is not None})
        if cleaned[0]["role"] != "assistant":
            self.fail(
                f"a conversational response must start with the assistant's message, got {cleaned[0]['role']!r}", key
            )
        return cleaned

    def response(self, value: Any, key: str) -> str | list[dict[str, Any]]:
        """A response: a string, or a conversational completion. One plain assistant message gives its text; several
        messages or tool calls give the cleaned messages (see `completion_messages`)."""
        value = self.present(value, key)
        if isinstance(value, (list, tuple)):
            messages = self.completion_messages(value, key)
            if len(messages) == 1 and set(messages[0]) == {"role", "content"}:
                return self.text(messages[0]["content"], f"{key}[0].content")
            return messages
        return self.text(value, key)

    def margin(self, value: Any, key: str) -> float:
        value = self.present(value, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(f"must be a finite number, got {value!r}", key)
        return float(value)


# TRL's per-row chat template columns (RewardTrainer's `tokenize_fn`): tool definitions and extra template arguments.
TEMPLATE_COLUMNS = ("tools", "chat_template_kwargs")


def _row_template_kwargs(check: _RowChecker, row: Mapping[str, Any], conversational: bool) -> str | None:
    """The row's chat template arguments as RewardTrainer builds them, `{"tools": tools, **chat_template_kwargs}`, as
    a JSON string; None when the row has neither column."""
    if not any(column in row for column in TEMPLATE_COLUMNS):
        return None
    tools = row.get("tools")
    if isinstance(tools, str):  # TRL's datasets store tools as a JSON string, as RewardTrainer reads them
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            check.fail(
                f"must be a list of tool definitions or its JSON text; the JSON does not parse: {error}", "tools"
            )
    if tools is not None and not isinstance(tools, (list, tuple)):
        check.fail(f"must be a list of tool definitions (or its JSON text), got {type(tools).__name__}", "tools")
    kwargs = row.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        check.fail(
            f"must be a mapping of chat template arguments, got {type(kwargs).__name__}", "chat_template_kwargs"
        )
    kwargs = dict(kwargs or {})
    if not conversational and (tools or kwargs):
        key = "tools" if tools else "chat_template_kwargs"
        check.fail("a row with a plain-text prompt is not rendered with a chat template, so this cannot apply", key)
    try:
        return json.dumps({"tools": list(tools) if tools is not None else None, **kwargs})
    except TypeError as error:
        check.fail(f"the chat template arguments must be JSON values: {error}", "chat_template_kwargs")


def _is_conversation(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and isinstance(value[0], Mapping)


def _rejected_items(check: _RowChecker, value: Any, key: str, data_format: str) -> list[Any]:
    """The raw rejected responses as a list (one response or a list of them)."""
    value = check.present(value, key)
    if data_format == "longrm" and not isinstance(value, (list, tuple)):
        check.fail(f"must be a list of rejected responses, got {type(value).__name__}", key)
    if isinstance(value, str) or _is_conversation(value):
        return [value]
    if not isinstance(value, (list, tuple)):
        check.fail(f"must be a response or a list of responses, got {type(value).__name__}", key)
    if not value:
        check.fail("must hold at least one rejected response, got an empty list", key)
    return list(value)


def _split_implicit_prompt(check: _RowChecker, chosen: Any, rejected: list[Any], layout: PreferenceLayout):
    """Prompt shared by `chosen` and every rejected response, via TRL's `extract_prompt`, plus the remainders."""
    chosen_key, rejected_key = layout.chosen_key, layout.rejected_key
    conversational = not isinstance(chosen, str)
    if conversational:
        chosen = check.messages(chosen, chosen_key)
    else:
        check.text(chosen, chosen_key)
    cut = None
    for j, item in enumerate(rejected):
        key = f"{rejected_key}[{j}]"
        if conversational:
            item = check.messages(item, key)
        elif not isinstance(item, str):
            check.fail(f"must be a string like {chosen_key!r}, got {type(item).__name__}", key)
        rejected[j] = item
        shorter = min(len(chosen), len(item))
        # `extract_prompt` assumes the two differ within their common length; otherwise the split is meaningless.
        if chosen[:shorter] == item[:shorter]:
            check.fail(
                f"cannot extract the implicit prompt: {chosen_key!r} and this response are identical or one is a "
                "prefix of the other",
                key,
            )
        length = len(extract_prompt({"chosen": chosen, "rejected": item})["prompt"])
        cut = length if cut is None else min(cut, length)
    prompt = chosen[:cut]
    if not prompt:
        check.fail(
            f"cannot extract the implicit prompt: {chosen_key!r} and {rejected_key!r} share no prefix", chosen_key
        )
    return prompt, chosen[cut:], [item[cut:] for item in rejected]


def normalize_preference_record(
    row: Mapping[str, Any],
    index: int | None = None,
    source: str = DEFAULT_SOURCE,
    prompt_key: str | None = None,
    chosen_key: str | None = None,
    rejected_key: str | None = None,
    data_format: str = "auto",
    margin_key: str = "margin",
    layout: PreferenceLayout | None = None,
    num_rejected: int | None = None,
) -> dict[str, Any]:
    """Normalise one preference row (LongRM or TRL layout) to `{prompt, chosen, rejected[, margin]
    [, chat_template_kwargs]}`.

    `num_rejected` keeps the first `num_rejected` rejected responses of the row (LongRM's `num_rejects`: its rows list
    the judgments that disagree with the consensus first); a row with fewer keeps all of its own, and the responses
    past them are not read. None keeps all.

    Raises [`DataFormatError`] naming `source`, `index` and the key for any malformed value.

    Example:
    ```python
    >>> row = {"chat_template": [{"role": "user", "content": "Judge this."}], "chosen": "good", "rejects": ["bad"]}
    >>> normalize_preference_record(row)
    {'prompt': [{'role': 'user', 'content': 'Judge this.'}], 'chosen': 'good', 'rejected': ['bad']}
    ```
    """
    check = _RowChecker(row, index, source)
    if layout is None:
        layout = check.layout(resolve_preference_layout, data_format, prompt_key, chosen_key, rejected_key)
    chosen = check.get(layout.chosen_key)
    rejected = _rejected_items(check, check.get(layout.rejected_key), layout.rejected_key, layout.data_format)
    if num_rejected is not None:
        rejected = rejected[:num_rejected]

    prompt = row.get(layout.prompt_key)
    implicit = layout.prompt_optional and layout.prompt_key not in row
    if not implicit and layout.data_format == "trl" and prompt is not None:
        # As TRL's `maybe_extract_prompt`: a string prompt next to full conversations (not completions, which start
        # with the assistant) is only a copy of their first turn, and the real prompt is implicit.
        implicit = isinstance(prompt, str) and _is_conversation(chosen) and chosen[0].get("role") != "assistant"
    if implicit:
        prompt, chosen, rejected = _split_implicit_prompt(check, chosen, rejected, layout)
    else:
        prompt = check.prompt(check.get(layout.prompt_key), layout.prompt_key)

    responses = [check.response(chosen, layout.chosen_key)]
    responses += [check.response(item, f"{layout.rejected_key}[{j}]") for j, item in enumerate(rejected)]
    completion_messages = any(isinstance(r, list) for r in responses)
    if completion_messages:
        if isinstance(prompt, str):
            check.fail("a completion of several messages or with tool calls needs a conversational prompt", "prompt")
        # One Arrow type for every response of the row: each as the JSON text of its messages.
        responses = [
            json.dumps(r if isinstance(r, list) else [{"role": "assistant", "content": r}], ensure_ascii=False)
            for r in responses
        ]
    record = {"prompt": prompt, "chosen": responses[0], "rejected": responses[1:]}
    if completion_messages:
        record["completion_messages"] = True
    if margin_key in row:
        record["margin"] = check.margin(row[margin_key], margin_key)
    template_kwargs = _row_template_kwargs(check, row, conversational=not isinstance(prompt, str))
    if template_kwargs is not None:
        record["chat_template_kwargs"] = template_kwargs
    return record


def normalize_sft_record(
    row: Mapping[str, Any],
    index: int | None = None,
    source: str = DEFAULT_SOURCE,
    messages_key: str | None = None,
    prompt_key: str | None = None,
    completion_key: str | None = None,
    data_format: str = "auto",
    layout: SFTLayout | None = None,
) -> dict[str, Any]:
    """Normalise one SFT row to `{messages}` (conversational) or `{prompt, completion}` (standard strings).

    LongRM rows (`chat_template` + `golden`) get the answer appended as the final assistant turn; TRL conversational
    prompt/completion rows are joined into `messages`, with `num_prompt_messages` saying where the completion starts
    (its whole rendering is trained, as stock SFTTrainer trains it).

    Example:
    ```python
    >>> row = {"chat_template": [{"role": "user", "content": "Q?"}], "golden": "A."}
    >>> normalize_sft_record(row)["messages"][-1]
    {'role': 'assistant', 'content': 'A.'}
    ```
    """
    check = _RowChecker(row, index, source)
    if layout is None:
        layout = check.layout(resolve_sft_layout, data_format, messages_key, prompt_key, completion_key)

    num_prompt_messages = None
    if layout.messages_key is not None:
        key = layout.messages_key
        messages = check.messages(check.get(key), key)
        if layout.completion_key is not None:  # LongRM: the golden answer is the final assistant turn
            answer = check.text(check.get(layout.completion_key), layout.completion_key)
            if messages[-1]["role"] == "assistant":
                check.fail(f"ends with an assistant message although {layout.completion_key!r} is its answer", key)
            messages = messages + [{"role": "assistant", "content": answer}]
    else:
        key = layout.prompt_key
        prompt = check.prompt(check.get(layout.prompt_key), layout.prompt_key)
        completion = check.present(check.get(layout.completion_key), layout.completion_key)
        if isinstance(prompt, str):
            return {"prompt": prompt, "completion": check.text(completion, layout.completion_key)}
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": check.text(completion, layout.completion_key)}]
        messages = prompt + check.messages(completion, layout.completion_key)
        num_prompt_messages = len(prompt)

    if messages[0]["role"] == "assistant":
        check.fail("the conversation must not start with an assistant message", key)
    if not any(message["role"] == "assistant" for message in messages):
        check.fail("the conversation has no assistant message, so there is nothing to learn", key)
    if num_prompt_messages is not None:
        # TRL's conversational prompt/completion: the completion is everything after the prompt (stock's mask)
        return {"messages": messages, "num_prompt_messages": num_prompt_messages}
    return {"messages": messages}
