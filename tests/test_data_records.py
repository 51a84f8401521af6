"""Normalisation of single rows: every adapter, format detection, key overrides and every bad-input case."""

import copy
import math
import pickle

import pytest

from trl_longrm.data import (
    DataFormatError,
    load_preference_dataset,
    load_sft_dataset,
    normalize_preference_record,
    normalize_sft_record,
    resolve_preference_layout,
)


SYSTEM = {"role": "system", "content": "You judge responses."}
USER = {"role": "user", "content": "Context ... Question ... Response ..."}


def longrm_row(**overrides):
    row = {"chat_template": [SYSTEM, USER], "chosen": "[Score: 8]", "rejects": ["[Score: 2]", "[Score: 3]"]}
    row.update(overrides)
    return row


# ---------------------------------------------------------------------------------------------------------- adapters
def test_longrm_preference_row():
    row = longrm_row(prompt_ctx_length=123, scores={"a": 1})
    record = normalize_preference_record(row, index=0, source="s")
    assert record == {"prompt": [SYSTEM, USER], "chosen": "[Score: 8]", "rejected": ["[Score: 2]", "[Score: 3]"]}
    assert resolve_preference_layout(row.keys()).data_format == "longrm"


def test_trl_standard_explicit_prompt_single_and_list_rejected():
    single = normalize_preference_record({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."})
    assert single == {"prompt": "The sky is", "chosen": " blue.", "rejected": [" green."]}
    listed = normalize_preference_record(
        {"prompt": "The sky is", "chosen": " blue.", "rejected": [" red.", " green."]}
    )
    assert listed["rejected"] == [" red.", " green."]


def test_trl_conversational_explicit_prompt():
    row = {
        "prompt": [USER],
        "chosen": [{"role": "assistant", "content": "good"}],
        "rejected": [{"role": "assistant", "content": "bad"}],
    }
    assert normalize_preference_record(row) == {"prompt": [USER], "chosen": "good", "rejected": ["bad"]}
    # k rejected completions, each a one-message list.
    row["rejected"] = [[{"role": "assistant", "content": "bad"}], [{"role": "assistant", "content": "worse"}]]
    assert normalize_preference_record(row)["rejected"] == ["bad", "worse"]


def test_trl_conversational_implicit_prompt_matches_trl_extract_prompt():
    from trl.data_utils import maybe_extract_prompt

    chosen = [SYSTEM, USER, {"role": "assistant", "content": "It is blue."}]
    rejected = [SYSTEM, USER, {"role": "assistant", "content": "It is green."}]
    record = normalize_preference_record({"chosen": chosen, "rejected": rejected})
    reference = maybe_extract_prompt({"chosen": chosen, "rejected": rejected})  # TRL's own extraction
    assert record["prompt"] == reference["prompt"] == [SYSTEM, USER]
    assert record["chosen"] == reference["chosen"][0]["content"]
    assert record["rejected"] == [reference["rejected"][0]["content"]]
    # Several rejected conversations share the same prompt.
    third = [SYSTEM, USER, {"role": "assistant", "content": "It is red."}]
    record = normalize_preference_record({"chosen": chosen, "rejected": [rejected, third]})
    assert record["prompt"] == [SYSTEM, USER] and record["rejected"] == ["It is green.", "It is red."]


def test_trl_standard_implicit_prompt_matches_trl_extract_prompt():
    from trl.data_utils import extract_prompt

    row = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    reference = extract_prompt(dict(row))
    record = normalize_preference_record(row)
    assert record == {
        "prompt": reference["prompt"],
        "chosen": reference["chosen"],
        "rejected": [reference["rejected"]],
    }
    assert record["prompt"] + record["chosen"] == row["chosen"]


def test_string_prompt_beside_full_conversations_is_implicit():
    # As TRL's maybe_extract_prompt: the string prompt only repeats the first turn.
    chosen = [USER, {"role": "assistant", "content": "yes"}]
    rejected = [USER, {"role": "assistant", "content": "no"}]
    record = normalize_preference_record({"prompt": USER["content"], "chosen": chosen, "rejected": rejected})
    assert record == {"prompt": [USER], "chosen": "yes", "rejected": ["no"]}


def test_margin_and_key_overrides():
    row = {"question": [USER], "good": "a", "bad": ["b"], "margin": 2}
    record = normalize_preference_record(row, prompt_key="question", chosen_key="good", rejected_key="bad")
    assert record == {"prompt": [USER], "chosen": "a", "rejected": ["b"], "margin": 2.0}
    assert isinstance(record["margin"], float)
    # Explicit format with overrides: LongRM requires a list of rejects even under other names.
    record = normalize_preference_record(
        {"ctx": [USER], "chosen": "a", "negs": ["b", "c"]}, data_format="longrm", prompt_key="ctx", rejected_key="negs"
    )
    assert record["rejected"] == ["b", "c"]


def test_arrow_filled_none_fields_are_dropped_from_messages():
    row = longrm_row(chat_template=[{**SYSTEM, "tool_calls": None}, {**USER, "name": "alice"}])
    assert normalize_preference_record(row)["prompt"] == [SYSTEM, {**USER, "name": "alice"}]


def test_sft_adapters():
    longrm = normalize_sft_record({"chat_template": [SYSTEM, USER], "golden": "The answer."})
    assert longrm == {"messages": [SYSTEM, USER, {"role": "assistant", "content": "The answer."}]}
    messages = [USER, {"role": "assistant", "content": "hi"}, USER, {"role": "assistant", "content": "bye"}]
    assert normalize_sft_record({"messages": messages}) == {"messages": messages}
    conv_pc = normalize_sft_record({"prompt": [USER], "completion": [{"role": "assistant", "content": "ok"}]})
    # The prompt's length marks where the completion starts: stock SFTTrainer trains all of its rendering.
    assert conv_pc == {"messages": [USER, {"role": "assistant", "content": "ok"}], "num_prompt_messages": 1}
    mixed_pc = normalize_sft_record({"prompt": [USER], "completion": "ok"})
    assert mixed_pc == conv_pc
    standard = normalize_sft_record({"prompt": "2 + 2 =", "completion": " 4"})
    assert standard == {"prompt": "2 + 2 =", "completion": " 4"}
    renamed = normalize_sft_record({"conv": messages}, messages_key="conv")
    assert renamed == {"messages": messages}


def test_sft_dataset_from_longrm_rows_appends_golden():
    rows = [{"chat_template": [USER], "golden": f"answer {i}"} for i in range(3)]
    dataset = load_sft_dataset(rows)
    assert dataset.column_names == ["messages"]
    assert [m[-1] for m in dataset["messages"]] == [{"role": "assistant", "content": f"answer {i}"} for i in range(3)]


def test_error_pickles_with_its_location():
    error = DataFormatError("bad", source="f.jsonl", index=3, key="rejects")
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.source, clone.index, clone.key, str(clone)) == ("f.jsonl", 3, "rejects", str(error))
    assert str(error) == "f.jsonl, row 3, key 'rejects': bad"


# ------------------------------------------------------------------------------------------------------- bad input
def _mutate(row, path, value):
    row = copy.deepcopy(row)
    target = row
    for part in path[:-1]:
        target = target[part]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return row


_DELETE = object()

# (case id, path to mutate in a LongRM row, new value, key named in the error, words in the message)
LONGRM_BAD_CASES = [
    ("missing chosen", ("chosen",), _DELETE, "chosen", "missing key"),
    ("missing rejects", ("rejects",), _DELETE, "rejects", "missing key"),
    ("empty rejects", ("rejects",), [], "rejects", "at least one"),
    ("non-list rejects", ("rejects",), "[Score: 1]", "rejects", "must be a list"),
    ("non-string reject", ("rejects", 1), 7, "rejects[1]", "must be a string"),
    ("None reject", ("rejects", 0), None, "rejects[0]", "None"),
    ("non-string chosen", ("chosen",), {"text": "x"}, "chosen", "must be a string"),
    ("empty chosen", ("chosen",), "   ", "chosen", "non-empty"),
    ("None chosen", ("chosen",), None, "chosen", "None"),
    ("NaN chosen", ("chosen",), math.nan, "chosen", "NaN"),
    ("unknown role", ("chat_template", 1, "role"), "narrator", "chat_template[1].role", "unknown role"),
    ("empty prompt", ("chat_template",), [], "chat_template", "non-empty list"),
    ("messages not a list", ("chat_template",), {"role": "user", "content": "x"}, "chat_template", "list"),
    ("message without content", ("chat_template", 1, "content"), _DELETE, "chat_template[1]", "'content'"),
    ("message without role", ("chat_template", 0, "role"), _DELETE, "chat_template[0]", "'role'"),
    ("non-string content", ("chat_template", 1, "content"), ["part"], "chat_template[1].content", "string"),
    ("prompt ends with assistant", ("chat_template", 1, "role"), "assistant", "chat_template", "must not end"),
    ("NaN margin", ("margin",), math.nan, "margin", "NaN"),
    ("non-number margin", ("margin",), "big", "margin", "finite number"),
]


@pytest.mark.parametrize(
    "path,value,key,words", [case[1:] for case in LONGRM_BAD_CASES], ids=[case[0] for case in LONGRM_BAD_CASES]
)
def test_bad_longrm_rows_name_source_row_and_key(path, value, key, words):
    rows = [longrm_row(margin=1.0) for _ in range(3)]
    rows[2] = _mutate(rows[2], path, value)
    with pytest.raises(DataFormatError) as info:
        load_preference_dataset(rows, source_name="train_groups.jsonl")
    error = info.value
    assert (error.source, error.index, error.key) == ("train_groups.jsonl", 2, key)
    message = str(error)
    assert message.startswith(f"train_groups.jsonl, row 2, key {key!r}:") and words in message


TRL_BAD_CASES = [
    (
        "message without content or tool calls",
        {"prompt": [USER], "chosen": [{"role": "assistant", "content": None}], "rejected": "b"},
        "chosen[0].content",
        "needs content or tool_calls",
    ),
    (
        "chosen with user role",
        {"prompt": [USER], "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
        "chosen",
        "must start with the assistant's message",
    ),
    (
        "several messages after a plain prompt",
        {"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}] * 2, "rejected": "b"},
        "prompt",
        "needs a conversational prompt",
    ),
    (
        "implicit prompt, identical conversations",
        {
            "chosen": [USER, {"role": "assistant", "content": "a"}],
            "rejected": [USER, {"role": "assistant", "content": "a"}],
        },
        "rejected[0]",
        "identical",
    ),
    (
        "implicit prompt, nothing shared",
        {"chosen": "abc", "rejected": "xyz"},
        "chosen",
        "share no prefix",
    ),
    ("empty prompt string", {"prompt": "", "chosen": "a", "rejected": "b"}, "prompt", "non-empty"),
    ("rejected of wrong type", {"prompt": "p", "chosen": "a", "rejected": 3}, "rejected", "a response or a list"),
]


@pytest.mark.parametrize("row,key,words", [c[1:] for c in TRL_BAD_CASES], ids=[c[0] for c in TRL_BAD_CASES])
def test_bad_trl_rows_name_source_row_and_key(row, key, words):
    with pytest.raises(DataFormatError) as info:
        normalize_preference_record(row, index=5, source="hub:prefs")
    assert (info.value.source, info.value.index, info.value.key) == ("hub:prefs", 5, key)
    assert words in str(info.value) and "hub:prefs, row 5" in str(info.value)


SFT_BAD_CASES = [
    ("missing golden", {"chat_template": [USER]}, {}, "golden", "missing key"),
    ("no assistant turn", {"messages": [SYSTEM, USER]}, {}, "messages", "no assistant"),
    ("starts with assistant", {"messages": [{"role": "assistant", "content": "x"}, USER]}, {}, "messages", "start"),
    (
        "golden plus final assistant",
        {"chat_template": [USER, {"role": "assistant", "content": "x"}], "golden": "y"},
        {},
        "chat_template",
        "ends with an assistant",
    ),
    ("empty completion", {"prompt": "p", "completion": ""}, {}, "completion", "non-empty"),
    ("renamed messages missing", {"messages": [USER]}, {"messages_key": "conv"}, "conv", "missing key"),
]


@pytest.mark.parametrize("row,kwargs,key,words", [c[1:] for c in SFT_BAD_CASES], ids=[c[0] for c in SFT_BAD_CASES])
def test_bad_sft_rows_name_source_row_and_key(row, kwargs, key, words):
    with pytest.raises(DataFormatError) as info:
        normalize_sft_record(row, index=9, source="sft.parquet", **kwargs)
    assert (info.value.source, info.value.index, info.value.key) == ("sft.parquet", 9, key)
    assert words in str(info.value)


def test_unknown_and_undetectable_formats_name_the_source():
    with pytest.raises(DataFormatError, match=r"^src, row 0: unknown data_format 'dpo'"):
        normalize_preference_record(longrm_row(), index=0, source="src", data_format="dpo")
    with pytest.raises(DataFormatError, match=r"^src: cannot detect the preference format"):
        load_preference_dataset([{"question": "q", "answer": "a"}], source_name="src")
    with pytest.raises(DataFormatError, match=r"^src: cannot detect the SFT format"):
        load_sft_dataset([{"question": "q", "answer": "a"}], source_name="src")


def test_mixed_conversational_and_standard_rows_are_rejected():
    rows = [{"prompt": [USER], "chosen": "a", "rejected": "b"}, {"prompt": "plain", "chosen": "a", "rejected": "b"}]
    with pytest.raises(DataFormatError) as info:
        load_preference_dataset(rows, source_name="mixed")
    assert (info.value.index, info.value.key) == (1, "prompt") and "cannot mix" in str(info.value)
    rows = [
        {"prompt": "p", "chosen": "a", "rejected": "b"},
        {"prompt": "p", "chosen": "a", "rejected": "b", "margin": 1},
    ]
    with pytest.raises(DataFormatError, match="row 1, key 'margin'"):
        load_preference_dataset(rows, source_name="mixed")
