"""Tokenisation of canonical preference groups and SFT examples, with an explicit policy for over-long rows.

Preference group -> `prompt_ids`, `chosen_completion_ids`, `rejected_completion_ids` (and `margin` when present).
For conversational prompts the ids come from the tokenizer's chat template: `prompt_ids` is the prompt rendered with
`add_generation_prompt=True`, and a completion is `render(prompt + [assistant response])[len(prompt_ids):]`. The
prompt rendering must be an exact token prefix of the full rendering; otherwise the row is rejected with an error
instead of being mis-masked. A plain-text response gets an EOS appended unless it ends with one, as TRL's trainers
append it.

What a completion keeps of the rendering depends on what it is for (`whole_rendering`):
- a reward model's sequence (DisRM, `whole_rendering=True`) is the whole rendering, as RewardTrainer tokenises it and
  as every consumer of a reward model renders a conversation (transformers' pooling, GRPO/RLOO's reward models): the
  score is read at its last token (`trl_longrm.scoring`), ChatML's newline after `<|im_end|>` included;
- a judgment a generative judge learns to write (`whole_rendering=False`) is cut after its first EOS (a completion of
  several messages after its last), every token a loss token: what the template writes after the EOS is not the
  judge's to generate. (CPOTrainer appends an EOS after ChatML's trailing newline, `<|im_end|>`, newline,
  `<|im_end|>`, which teaches a judge to stop after a newline: trained so, the demo's judge wrote 27 of 168 judgments
  without their score.)

SFT example -> `input_ids` and `completion_mask`. Conversations (`messages`) train their assistant turns, each up to
and including its EOS, built by rendering the conversation turn by turn and checking the same prefix property at
every turn, so templates without `{% generation %}` tags work too. TRL's conversational prompt/completion rows train
the whole rendering after the prompt, and plain-text ones the completion plus an EOS if it lacks one, as stock
SFTTrainer does.

Rows longer than `max_length` are dropped (`truncation="drop"`) or have the middle of their prompt's longest message
cut out (`truncation="truncate_prompt"`). Either way the counts are logged once per dataset and returned in a
[`TokenizationReport`].
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from datasets import Dataset, Features, List, Value
from transformers import PreTrainedTokenizerBase

from .errors import DataFormatError
from .records import DEFAULT_SOURCE
from .truncation import precut_middle, truncate_middle_to_fit


logger = logging.getLogger(__name__)

TRUNCATION_POLICIES = ("drop", "truncate_prompt")
_STATUS = "__tokenization_status"
KEPT, TRUNCATED, DROPPED = "kept", "truncated", "dropped"
# Why a row was dropped (each status starts with DROPPED), as the report counts it.
DROPPED_NO_ROOM, DROPPED_UNSETTLED = "dropped: no room", "dropped: unsettled"
# Cut-and-re-measure rounds before giving up on a row; re-rendering usually settles in one or two.
MAX_TRUNCATION_ROUNDS = 4
DROP_REASONS = {
    DROPPED: "longer than max_length with truncation='drop'",
    DROPPED_NO_ROOM: "responses alone fill max_length (only the prompt is ever cut)",
    DROPPED_UNSETTLED: f"still over max_length after {MAX_TRUNCATION_ROUNDS} rounds of cutting the prompt",
}


@dataclass
class TokenizationReport:
    """What tokenising one dataset did to its rows: how many were kept, dropped and truncated, and why.

    Example:
    ```python
    >>> dataset, report = tokenize_preference_dataset(groups, tokenizer, max_length=4096, truncation="truncate_prompt")
    >>> report.num_truncated, report.num_dropped
    (16, 0)
    ```
    """

    source: str = field(metadata={"help": "Name of the data source, as used in log and error messages."})
    num_rows: int = field(metadata={"help": "Rows before tokenisation."})
    num_kept: int = field(metadata={"help": "Rows in the output (truncated rows included)."})
    num_dropped: int = field(metadata={"help": "Rows removed because they did not fit in `max_length`."})
    num_truncated: int = field(metadata={"help": "Rows kept after cutting the middle of their prompt."})
    max_length: int | None = field(metadata={"help": "Token budget per row; None means no limit."})
    truncation: str = field(metadata={"help": "Policy for over-long rows: 'drop' or 'truncate_prompt'."})
    dropped_by_reason: dict[str, int] = field(
        default_factory=dict, metadata={"help": "Dropped rows per reason (a sentence), e.g. for an error message."}
    )

    def log(self) -> None:
        """Log the counts once: a warning when rows were dropped or truncated, an info line otherwise."""
        level = logging.WARNING if self.num_dropped or self.num_truncated else logging.INFO
        logger.log(
            level,
            "%s: tokenised %d rows with max_length=%s, truncation=%r: %d dropped as too long, %d truncated "
            "(middle of the prompt's longest message cut), %d kept.",
            self.source,
            self.num_rows,
            self.max_length,
            self.truncation,
            self.num_dropped,
            self.num_truncated,
            self.num_kept,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_policy(max_length: int | None, truncation: str) -> None:
    if truncation not in TRUNCATION_POLICIES:
        raise ValueError(f"unknown truncation policy {truncation!r}; expected one of {list(TRUNCATION_POLICIES)}")
    if max_length is not None and max_length <= 0:
        raise ValueError(f"max_length must be a positive number of tokens or None, got {max_length}")


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; completions must end with an EOS token")
    return tokenizer.eos_token_id


class _Encoder:
    """Chat-template rendering and tokenisation of one row, with errors naming the row.

    Texts are tokenised with `verbose=False`: the tokenizer's warning about sequences longer than the model's maximum
    would speak of the row before truncation, which `max_length` then bounds."""

    def __init__(self, tokenizer, index, source, chat_template_kwargs, whole_rendering: bool = False):
        self.whole_rendering = whole_rendering
        self.tokenizer = tokenizer
        self.index = index
        self.source = source
        self.template_kwargs = chat_template_kwargs or {}
        self.eos = _eos_id(tokenizer)

    def with_eos(self, ids: list[int]) -> list[int]:
        """`ids` ending with the EOS token (appended when they do not already end with it)."""
        return ids if ids and ids[-1] == self.eos else ids + [self.eos]

    def fail(self, message: str, key: str | None) -> DataFormatError:
        return DataFormatError(message, source=self.source, index=self.index, key=key)

    def render(self, messages: list[dict], add_generation_prompt: bool, key: str) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
            )
        except Exception as error:  # Jinja errors (e.g. `raise_exception` on an unknown role) carry no row
            raise self.fail(f"the chat template failed to render this row: {error}", key) from error
        # `apply_chat_template(tokenize=True)` tokenises the rendered text the same way: specials come from the text.
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def check_prefix(self, prefix: list[int], full: list[int], key: str, what: str) -> None:
        if full[: len(prefix)] != prefix:
            first = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
            raise self.fail(
                f"the chat template is not prefix-stable: {what} is not a token prefix of the rendering that "
                f"continues it (first difference at token {first}: {self.tokenizer.decode(prefix[first : first + 8])!r} "
                f"vs {self.tokenizer.decode(full[first : first + 8])!r}), so the loss mask cannot be derived safely",
                key,
            )

    def cut_after_eos(self, ids: list[int]) -> tuple[list[int], bool]:
        """`ids` up to and including the first EOS, and whether there was one."""
        if self.eos in ids:
            return ids[: ids.index(self.eos) + 1], True
        return ids, False

    # Preference groups ---------------------------------------------------------------------------------------------
    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, verbose=False)["input_ids"]
        return self.render(prompt, add_generation_prompt=True, key="prompt")

    def completion_ids(self, prompt, prompt_ids: list[int], response: str | list[dict], key: str) -> list[int]:
        """A response's tokens after the prompt: the whole rendering's (`whole_rendering`), else a list of messages
        (tool calls, the tool's answer, the reply) cut after its last EOS, a plain response after its first."""
        if isinstance(prompt, str):
            return self.with_eos(self.tokenizer(response, add_special_tokens=False, verbose=False)["input_ids"])
        messages = response if isinstance(response, list) else [{"role": "assistant", "content": response}]
        full = self.render(prompt + messages, False, key)
        self.check_prefix(prompt_ids, full, key, "the prompt rendered with add_generation_prompt=True")
        tail = full[len(prompt_ids) :]
        if self.whole_rendering:  # as RewardTrainer and every reward-model consumer render it
            return tail
        if isinstance(response, list):
            last = len(tail) - 1 - tail[::-1].index(self.eos) if self.eos in tail else None
            completion, has_eos = (tail, False) if last is None else (tail[: last + 1], True)
        else:
            completion, has_eos = self.cut_after_eos(tail)
        # A template that closes turns without the EOS token still gets one, so the model learns to stop.
        return completion if has_eos else completion + [self.eos]

    def completions(self, prompt, prompt_ids: list[int], responses: list[str]) -> list[list[int]]:
        keys = ["chosen"] + [f"rejected[{j}]" for j in range(len(responses) - 1)]
        return [self.completion_ids(prompt, prompt_ids, r, k) for r, k in zip(responses, keys)]

    # SFT -----------------------------------------------------------------------------------------------------------
    def conversation(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            key = f"messages[{i}]"
            if message["role"] == "assistant":
                head = self.render(messages[:i], True, key)
                self.check_prefix(ids, head, key, f"the rendering of messages[:{i}]")
                mask += [0] * (len(head) - len(ids))
                full = self.render(messages[: i + 1], False, key)
                self.check_prefix(head, full, key, f"messages[:{i}] rendered with add_generation_prompt=True")
                turn, has_eos = self.cut_after_eos(full[len(head) :])
                last = i == len(messages) - 1
                if not has_eos and last:  # as for preference completions: the final answer ends with EOS
                    full, turn = full + [self.eos], turn + [self.eos]
                mask += [1] * len(turn) + [0] * (len(full) - len(head) - len(turn))
                ids = full
            else:
                full = self.render(messages[: i + 1], False, key)
                self.check_prefix(ids, full, key, f"the rendering of messages[:{i}]")
                mask += [0] * (len(full) - len(ids))
                ids = full
        return ids, mask

    def prompt_completion(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        prompt_ids = self.tokenizer(prompt, verbose=False)["input_ids"]
        completion_ids = self.with_eos(self.tokenizer(completion, add_special_tokens=False, verbose=False)["input_ids"])
        return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)

    def prompt_completion_messages(self, messages: list[dict], num_prompt: int) -> tuple[list[int], list[int]]:
        """TRL's conversational prompt/completion: the prompt rendered with the generation prompt, then the rest of
        the rendering, all of it trained (stock SFTTrainer's `completion_mask`)."""
        prompt_ids = self.render(messages[:num_prompt], True, "prompt")
        full = self.render(messages, False, "completion")
        self.check_prefix(prompt_ids, full, "completion", "the prompt rendered with add_generation_prompt=True")
        return full, [0] * len(prompt_ids) + [1] * (len(full) - len(prompt_ids))


def _require(record: dict, keys: tuple[str, ...], index, source) -> None:
    for key in keys:
        if key not in record:
            raise DataFormatError(
                f"missing key in a canonical record (normalise the data with load_*_dataset or normalize_*_record "
                f"first); the record has keys {sorted(record)}",
                source=source,
                index=index,
                key=key,
            )


def _tokenize_preference(record, tokenizer, max_length, truncation, index, source, chat_template_kwargs, precut=True,
                         whole_rendering=False):
    _check_policy(max_length, truncation)
    _require(record, ("prompt", "chosen", "rejected"), index, source)
    if record.get("chat_template_kwargs"):  # the row's own `tools` / `chat_template_kwargs`, over the config's
        chat_template_kwargs = {**(chat_template_kwargs or {}), **json.loads(record["chat_template_kwargs"])}
    encoder = _Encoder(tokenizer, index, source, chat_template_kwargs, whole_rendering)
    prompt = record["prompt"]
    if max_length is not None and precut:
        # Cut a huge prompt by characters first: tokenising it whole would cost time and memory of its raw size.
        prompt = precut_middle(prompt, tokenizer, max_length)
    responses = [record["chosen"], *record["rejected"]]
    if record.get("completion_messages"):  # each response is the JSON text of its messages (see records.py)
        responses = [json.loads(r) for r in responses]
    prompt_ids = encoder.prompt_ids(prompt)
    completions = None
    if max_length is None or len(prompt_ids) < max_length:
        completions = encoder.completions(prompt, prompt_ids, responses)
    elif truncation == "drop":  # no room even for an EOS: skip rendering the completions after this long prompt
        return None, DROPPED

    status = KEPT
    # Every cut is measured, the last one too: MAX_TRUNCATION_ROUNDS cuts, then one final check.
    for cuts in range(MAX_TRUNCATION_ROUNDS + 1):
        if completions is not None:
            longest = max(len(c) for c in completions)
            if max_length is None or len(prompt_ids) + longest <= max_length:
                break
            if truncation == "drop":
                return None, DROPPED
            if cuts == MAX_TRUNCATION_ROUNDS:
                return None, DROPPED_UNSETTLED
        else:
            # The response's own tokens plus EOS: what a completion usually is. A wrong guess costs one more round.
            longest = 1 + max(
                len(
                    tokenizer(r if isinstance(r, str) else json.dumps(r), add_special_tokens=False, verbose=False)[
                        "input_ids"
                    ]
                )
                for r in responses
            )
        prompt = truncate_middle_to_fit(
            prompt,
            tokenizer,
            lambda p: len(encoder.prompt_ids(p)),
            max_tokens=max_length - longest,
            num_tokens=len(prompt_ids),
        )
        if prompt is None:  # the completions alone (nearly) fill max_length
            return None, DROPPED_NO_ROOM
        prompt_ids = encoder.prompt_ids(prompt)
        completions = encoder.completions(prompt, prompt_ids, responses)
        status = TRUNCATED

    out = {
        "prompt_ids": prompt_ids,
        "chosen_completion_ids": completions[0],
        "rejected_completion_ids": completions[1:],
    }
    if "margin" in record:
        out["margin"] = record["margin"]
    return out, status


def _tokenize_sft(record, tokenizer, max_length, truncation, index, source, chat_template_kwargs, precut=True,
                  assistant_only_loss=None):
    _check_policy(max_length, truncation)
    encoder = _Encoder(tokenizer, index, source, chat_template_kwargs)
    if "messages" in record:
        prompt, encode = record["messages"], encoder.conversation
        num_prompt = record.get("num_prompt_messages")
        if num_prompt is not None and assistant_only_loss is not True:  # True: its assistant turns only, as stock

            def encode(messages):
                return encoder.prompt_completion_messages(messages, num_prompt)

        if max_length is not None and precut:  # as for preference prompts
            prompt = precut_middle(prompt, tokenizer, max_length)

        def count(messages):  # one rendering; the turn-by-turn encoding renders the conversation once per turn
            return len(encoder.render(messages, False, "messages"))
    else:
        _require(record, ("prompt", "completion"), index, source)
        prompt, completion = record["prompt"], record["completion"]
        if max_length is not None and precut:
            prompt = precut_middle(prompt, tokenizer, max_length)

        def encode(p):
            return encoder.prompt_completion(p, completion)

        def count(p):
            return len(encode(p)[0])

    budget = max_length
    if max_length is not None and count(prompt) > max_length:
        if truncation == "drop":
            return None, DROPPED
        input_ids = None
    else:
        input_ids, mask = encode(prompt)

    status = KEPT
    for cuts in range(MAX_TRUNCATION_ROUNDS + 1):
        if input_ids is not None:
            if max_length is None or len(input_ids) <= max_length:
                break
            if truncation == "drop":
                return None, DROPPED
            if cuts == MAX_TRUNCATION_ROUNDS:
                return None, DROPPED_UNSETTLED
            budget -= len(input_ids) - max_length  # an EOS appended by the encoding is not in `count`
        prompt = truncate_middle_to_fit(prompt, tokenizer, count, max_tokens=budget)
        if prompt is None:
            return None, DROPPED_NO_ROOM
        input_ids, mask = encode(prompt)
        status = TRUNCATED
    return {"input_ids": input_ids, "completion_mask": mask}, status


def tokenize_preference_record(
    record: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = None,
    truncation: str = "drop",
    index: int | None = None,
    source: str = DEFAULT_SOURCE,
    chat_template_kwargs: dict[str, Any] | None = None,
    whole_rendering: bool = False,
) -> dict[str, Any] | None:
    """Tokenise one canonical preference group; returns None when the group does not fit and is dropped.

    `whole_rendering=True` keeps what the chat template writes after a response's EOS (a reward model's sequences, see
    the module's docstring); by default a completion ends at its EOS (a generative judge's judgments).

    `max_length` bounds `len(prompt_ids) + len(longest completion)`. With `truncation="truncate_prompt"` the middle
    of the prompt's longest message is cut until it fits; a group is dropped only when its completions alone leave no
    room for the prompt.

    Example:
    ```python
    >>> record = {"prompt": [{"role": "user", "content": "Judge this."}], "chosen": "good", "rejected": ["bad"]}
    >>> out = tokenize_preference_record(record, tokenizer)
    >>> tokenizer.decode(out["chosen_completion_ids"])
    'good<|im_end|>'
    ```
    """
    out, _ = _tokenize_preference(record, tokenizer, max_length, truncation, index, source, chat_template_kwargs,
                                  whole_rendering=whole_rendering)  # fmt: skip
    return out


def scoring_ids(
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[dict] | str,
    responses: list[str],
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[list[int]]:
    """The tokens a DisRM reads to score each of `responses` to `prompt`: exactly the sequences it is trained on.

    Each is `prompt_ids + completion_ids` as `tokenize_preference_record(..., whole_rendering=True)` builds them: the
    conversation as the chat template renders it (the prompt once, with the generation prompt, then the response's
    turn and whatever the template writes after it), or a plain prompt and response with an EOS. The score is read at
    the last token (`trl_longrm.scoring.score_index`), where transformers' sequence classification, RewardTrainer and
    GRPO read it (GRPO reads a plain-text row without the EOS: `trl_longrm.scoring`).

    Example:
    ```python
    >>> [ids] = scoring_ids(tokenizer, [{"role": "user", "content": "Judge this."}], ["good"])
    >>> tokenizer.decode(ids[-3:])  # a ChatML template writes a newline after the EOS
    'good<|im_end|>\n'
    ```
    """
    encoder = _Encoder(tokenizer, None, DEFAULT_SOURCE, chat_template_kwargs, whole_rendering=True)
    prompt_ids = encoder.prompt_ids(prompt)
    return [
        prompt_ids + encoder.completion_ids(prompt, prompt_ids, response, f"responses[{i}]")
        for i, response in enumerate(responses)
    ]


def tokenize_sft_record(
    record: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = None,
    truncation: str = "drop",
    index: int | None = None,
    source: str = DEFAULT_SOURCE,
    chat_template_kwargs: dict[str, Any] | None = None,
    assistant_only_loss: bool | None = None,
) -> dict[str, Any] | None:
    """Tokenise one canonical SFT example into `input_ids` and `completion_mask`; None when it is dropped.

    `max_length` bounds the whole sequence; `truncation="truncate_prompt"` cuts the middle of the longest
    non-assistant message (assistant turns are targets and are never cut). A conversational prompt/completion trains
    all of its completion's rendering, or with `assistant_only_loss=True` its assistant turns only (as stock).

    Example:
    ```python
    >>> record = {"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]}
    >>> out = tokenize_sft_record(record, tokenizer)
    >>> tokenizer.decode([t for t, m in zip(out["input_ids"], out["completion_mask"]) if m])
    'A.<|im_end|>'
    ```
    """
    out, _ = _tokenize_sft(
        record, tokenizer, max_length, truncation, index, source, chat_template_kwargs,
        assistant_only_loss=assistant_only_loss,
    )  # fmt: skip
    return out


def _map_row(row, index, tokenize, empty, **kwargs):
    out, status = tokenize(row, index=index, **kwargs)
    return {**(empty if out is None else out), _STATUS: status}


def _tokenize_dataset(
    dataset, tokenize, features, tokenizer, max_length, truncation, num_proc, source_name, kwargs, keep_columns=()
):
    _check_policy(max_length, truncation)
    source = source_name or "<dataset>"
    empty = {name: (0.0 if name == "margin" else []) for name in features}
    missing = [column for column in keep_columns if column not in dataset.column_names]
    if missing:
        raise ValueError(f"{source}: no column(s) {missing} to keep; the columns are {dataset.column_names}")
    kept_features = {column: dataset.features[column] for column in keep_columns}
    mapped = dataset.map(
        _map_row,
        with_indices=True,
        fn_kwargs={
            "tokenize": tokenize,
            "empty": empty,
            "tokenizer": tokenizer,
            "max_length": max_length,
            "truncation": truncation,
            "source": source,
            "chat_template_kwargs": kwargs,
        },
        remove_columns=[column for column in dataset.column_names if column not in keep_columns],
        # Explicit types: a batch made only of dropped rows would otherwise infer `list<null>` columns.
        features=Features({**kept_features, **features, _STATUS: Value("string")}),
        num_proc=num_proc,
        desc=f"Tokenising {source}",
    )
    statuses = list(mapped[_STATUS])
    kept = [i for i, status in enumerate(statuses) if not status.startswith(DROPPED)]
    dropped_by_reason = {}
    for status in statuses:
        if status.startswith(DROPPED):
            reason = DROP_REASONS[status]
            dropped_by_reason[reason] = dropped_by_reason.get(reason, 0) + 1
    if len(kept) < len(mapped):
        mapped = mapped.select(kept)
    mapped = mapped.remove_columns(_STATUS)
    report = TokenizationReport(
        source=source,
        num_rows=len(statuses),
        num_kept=len(kept),
        num_dropped=len(statuses) - len(kept),
        num_truncated=statuses.count(TRUNCATED),
        max_length=max_length,
        truncation=truncation,
        dropped_by_reason=dropped_by_reason,
    )
    report.log()
    return mapped, report


def tokenize_preference_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = None,
    truncation: str = "drop",
    num_proc: int | None = None,
    source_name: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    whole_rendering: bool = False,
    keep_columns: tuple[str, ...] = (),
) -> tuple[Dataset, TokenizationReport]:
    """Tokenise canonical preference groups (see [`load_preference_dataset`]) with `datasets.map`; `whole_rendering`
    as in [`tokenize_preference_record`] (True for a reward model's sequences).

    Returns the dataset with columns `prompt_ids`, `chosen_completion_ids`, `rejected_completion_ids` (and `margin`,
    and the `keep_columns` of `dataset`, unchanged) and a [`TokenizationReport`] with the dropped/truncated counts,
    which are also logged once.

    Example:
    ```python
    >>> groups = load_preference_dataset("/path/to/longrm_simpo_sample")
    >>> tokenized, report = tokenize_preference_dataset(groups, tokenizer, max_length=2048, truncation="truncate_prompt")
    ```
    """
    ids = List(Value("int32"))
    features = {"prompt_ids": ids, "chosen_completion_ids": ids, "rejected_completion_ids": List(ids)}
    if "margin" in dataset.column_names:
        features["margin"] = Value("float64")
    return _tokenize_dataset(
        dataset,
        functools.partial(_tokenize_preference, whole_rendering=whole_rendering),
        features,
        tokenizer,
        max_length,
        truncation,
        num_proc,
        source_name,
        chat_template_kwargs,
        tuple(keep_columns),
    )


def tokenize_sft_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = None,
    truncation: str = "drop",
    num_proc: int | None = None,
    source_name: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    assistant_only_loss: bool | None = None,
) -> tuple[Dataset, TokenizationReport]:
    """Tokenise canonical SFT examples (see [`load_sft_dataset`]) into `input_ids` and `completion_mask`
    (`assistant_only_loss` as in [`tokenize_sft_record`]).

    Example:
    ```python
    >>> examples = load_sft_dataset("sft.jsonl")
    >>> tokenized, report = tokenize_sft_dataset(examples, tokenizer, max_length=4096, truncation="drop")
    ```
    """
    features = {"input_ids": List(Value("int32")), "completion_mask": List(Value("int8"))}
    return _tokenize_dataset(
        dataset,
        functools.partial(_tokenize_sft, assistant_only_loss=assistant_only_loss),
        features,
        tokenizer,
        max_length,
        truncation,
        num_proc,
        source_name,
        chat_template_kwargs,
    )
