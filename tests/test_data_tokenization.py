"""Tokenisation of preference groups and SFT examples: masks, prefix checks, long-input policies and reports."""

import logging

import pytest
from datasets import Dataset

from trl_longrm.data import (
    DataFormatError,
    cut_middle,
    load_preference_dataset,
    scoring_ids,
    tokenize_preference_dataset,
    tokenize_preference_record,
    tokenize_sft_dataset,
    tokenize_sft_record,
    truncate_middle_to_fit,
)
from trl_longrm.testing_utils import EOS_TOKEN, build_chat_tokenizer


SYSTEM = {"role": "system", "content": "You judge responses."}
USER = {"role": "user", "content": "Is the sky blue? Response: yes it is."}
LOGGER = "trl_longrm.data.tokenization"


def render(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def group(prompt=(SYSTEM, USER), chosen="[Score: 9]", rejected=("[Score: 2]", "[Score: 4] longer answer"), **extra):
    return {"prompt": list(prompt), "chosen": chosen, "rejected": list(rejected), **extra}


def long_context(n_words, head="HEADSTART alpha beta", tail="question: which city? TAILEND"):
    filler = " ".join(["the river of the city has a long name"] * (n_words // 9 + 1))
    return f"{head} {filler} {tail}"


# ------------------------------------------------------------------------------------------- preference groups
@pytest.mark.parametrize("prompt", [[SYSTEM, USER], "Is the sky blue? Response: yes it is."])
def test_scoring_ids_are_the_reward_model_training_sequences(tokenizer, prompt):
    """What an evaluation scores (`scoring_ids`) is what DisRM training scores (`whole_rendering=True`): the whole chat
    rendering, ChatML's newline after the EOS included, as RewardTrainer and GRPO render it; a plain prompt and
    response end at an EOS. A generative judge's completions (the default) end at the EOS."""
    record = group(prompt=prompt) if isinstance(prompt, list) else {"prompt": prompt, "chosen": "a", "rejected": ["b"]}
    responses = [record["chosen"], *record["rejected"]]
    out = tokenize_preference_record(record, tokenizer, whole_rendering=True)
    expected = [out["prompt_ids"] + c for c in [out["chosen_completion_ids"], *out["rejected_completion_ids"]]]
    sequences = scoring_ids(tokenizer, prompt, responses)
    assert sequences == expected
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    judged = tokenize_preference_record(record, tokenizer)
    assert all(c[-1] == eos for c in [judged["chosen_completion_ids"], *judged["rejected_completion_ids"]])
    if isinstance(prompt, list):
        for ids, response in zip(sequences, responses):
            full = tokenizer(
                render(tokenizer, [*prompt, {"role": "assistant", "content": response}]), add_special_tokens=False
            )
            assert ids == full["input_ids"] and tokenizer.decode(ids[-2:]) == EOS_TOKEN + "\n"
        assert judged["chosen_completion_ids"] == out["chosen_completion_ids"][:-1]  # the newline is cut
    else:
        assert all(ids[-1] == eos for ids in sequences) and judged == out


def test_conversational_group_ids_decode_to_prompt_and_responses_with_eos(tokenizer):
    record = group(margin=1.5)
    out = tokenize_preference_record(record, tokenizer)
    assert set(out) == {"prompt_ids", "chosen_completion_ids", "rejected_completion_ids", "margin"}
    assert out["margin"] == 1.5
    # The prompt is exactly the template's rendering with the generation prompt.
    assert tokenizer.decode(out["prompt_ids"]) == render(tokenizer, record["prompt"], add_generation_prompt=True)
    assert (
        out["prompt_ids"] == tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True)["input_ids"]
    )
    # Each completion is the response followed by EOS; the template's trailing newline is not a loss token.
    assert tokenizer.decode(out["chosen_completion_ids"]) == "[Score: 9]" + EOS_TOKEN
    assert [tokenizer.decode(ids) for ids in out["rejected_completion_ids"]] == [
        "[Score: 2]" + EOS_TOKEN,
        "[Score: 4] longer answer" + EOS_TOKEN,
    ]
    # Prompt + completion reproduces the template's full rendering, minus what follows the EOS.
    for response, completion in zip(
        ["[Score: 9]", *record["rejected"]], [out["chosen_completion_ids"], *out["rejected_completion_ids"]]
    ):
        full = tokenizer.apply_chat_template(record["prompt"] + [{"role": "assistant", "content": response}])
        assert out["prompt_ids"] + completion == full["input_ids"][:-1]  # the last token is the trailing "\n"
        assert completion[-1] == tokenizer.eos_token_id


def test_completion_matches_the_template_assistant_mask(tokenizer):
    # Independent reference: the template's own {% generation %} mask marks the same tokens as our completion.
    record = group()
    out = tokenize_preference_record(record, tokenizer)
    full = tokenizer.apply_chat_template(
        record["prompt"] + [{"role": "assistant", "content": record["chosen"]}],
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    masked = [t for t, m in zip(full["input_ids"], full["assistant_masks"]) if m]
    assert masked == out["chosen_completion_ids"]


def test_standard_string_group(tokenizer):
    out = tokenize_preference_record({"prompt": "The sky is", "chosen": " blue.", "rejected": [" green."]}, tokenizer)
    assert out["prompt_ids"] == tokenizer("The sky is")["input_ids"]
    assert out["chosen_completion_ids"] == tokenizer(" blue.", add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    assert tokenizer.decode(out["rejected_completion_ids"][0]) == " green." + EOS_TOKEN


def test_template_without_eos_gets_one_appended():
    tokenizer = build_chat_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ':\\n' + m['content'] + '\\n\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\\n' }}{% endif %}"
    )
    out = tokenize_preference_record({"prompt": [USER], "chosen": "yes", "rejected": ["no"]}, tokenizer)
    assert tokenizer.decode(out["chosen_completion_ids"]) == "yes\n\n" + EOS_TOKEN
    assert tokenizer.decode(out["rejected_completion_ids"][0]) == "no\n\n" + EOS_TOKEN


def test_token_merge_across_the_prompt_boundary_is_detected():
    tokenizer = build_chat_tokenizer()
    # The generation prompt ends with a space that BPE merges with the response's first word (" no").
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    record = {"prompt": [USER], "chosen": "yes", "rejected": ["no"]}
    with pytest.raises(DataFormatError, match=r"row 4, key 'rejected\[0\]': the chat template is not prefix-stable"):
        tokenize_preference_record(record, tokenizer, index=4, source="s")


def test_prefix_unstable_template_is_an_error_naming_the_row():
    tokenizer = build_chat_tokenizer()
    # Renders the final user turn differently from one followed by an assistant turn (a "last turn" marker).
    tokenizer.chat_template = (
        "{% for m in messages %}"
        "{% if m['role'] == 'user' and loop.last %}{{ '<|im_start|>user (final)\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    with pytest.raises(DataFormatError, match="not prefix-stable") as info:
        tokenize_preference_record(group(), tokenizer, index=7, source="groups.jsonl")
    assert (info.value.source, info.value.index, info.value.key) == ("groups.jsonl", 7, "chosen")


def test_sft_template_rewriting_earlier_turns_is_an_error_naming_the_row():
    tokenizer = build_chat_tokenizer()
    # Like templates that strip earlier assistant turns (e.g. reasoning): fine for one turn, not for two.
    tokenizer.chat_template = (
        "{% for m in messages %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\\n(omitted)<|im_end|>\\n' }}"
        "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    one_turn = {"messages": [USER, {"role": "assistant", "content": "a"}]}
    two_turns = {
        "messages": [USER, {"role": "assistant", "content": "a"}, USER, {"role": "assistant", "content": "b"}]
    }
    assert tokenize_sft_record(one_turn, tokenizer)["completion_mask"].count(1) == 2  # "a" + EOS
    with pytest.raises(DataFormatError, match=r"^sft.jsonl, row 2, key 'messages\[2\]'.*not prefix-stable"):
        tokenize_sft_dataset(Dataset.from_list([one_turn, one_turn, two_turns]), tokenizer, source_name="sft.jsonl")


def test_template_failure_names_the_row(tokenizer):
    # "tool" is a role we accept, but the tiny template raises on it.
    record = group(prompt=[SYSTEM, {"role": "tool", "content": "result"}])
    with pytest.raises(DataFormatError, match=r"^src, row 3, key 'prompt': the chat template failed.*Unknown role"):
        tokenize_preference_record(record, tokenizer, index=3, source="src")


@pytest.mark.slow
def test_dataset_tokenisation_matches_records_and_num_proc(tokenizer, caplog):
    records = [group(chosen=f"[Score: {i}]", margin=float(i)) for i in range(4)]
    dataset = Dataset.from_list(records)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tokenized, report = tokenize_preference_dataset(dataset, tokenizer, source_name="four")
    assert tokenized.column_names == ["prompt_ids", "chosen_completion_ids", "rejected_completion_ids", "margin"]
    assert tokenized.to_list() == [tokenize_preference_record(r, tokenizer) for r in records]
    assert (report.num_rows, report.num_kept, report.num_dropped, report.num_truncated) == (4, 4, 0, 0)
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "four: tokenised 4 rows with max_length=None, truncation='drop': 0 dropped as too long, 0 truncated "
        "(middle of the prompt's longest message cut), 4 kept."
    ]
    parallel, _ = tokenize_preference_dataset(dataset, tokenizer, num_proc=2)
    assert parallel.to_list() == tokenized.to_list()


# ---------------------------------------------------------------------------------------------- long inputs
def test_cut_middle_keeps_head_and_tail_tokens(tokenizer):
    text = long_context(200)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cut = cut_middle(text, tokenizer, keep_tokens=20)
    assert cut == tokenizer.decode(ids[:10]) + tokenizer.decode(ids[-10:])
    assert cut_middle(text, tokenizer, keep_tokens=len(ids)) == text


def test_truncate_prompt_keeps_head_and_tail_and_reports_once(tokenizer, caplog):
    content = long_context(600)
    records = [
        group(prompt=[SYSTEM, {"role": "user", "content": content}]),  # too long: truncated
        group(),  # short: kept as is
        group(prompt=[SYSTEM, {"role": "user", "content": content}], chosen="very long answer " * 200),  # cannot fit
    ]
    max_length = 256
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tokenized, report = tokenize_preference_dataset(
            Dataset.from_list(records),
            tokenizer,
            max_length=max_length,
            truncation="truncate_prompt",
            source_name="lg",
        )
    assert (report.num_rows, report.num_kept, report.num_truncated, report.num_dropped) == (3, 2, 1, 1)
    messages = [r for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 1 and messages[0].levelno == logging.WARNING
    assert "lg: tokenised 3 rows with max_length=256" in messages[0].getMessage()
    assert "1 dropped as too long, 1 truncated" in messages[0].getMessage()

    first = tokenized[0]
    longest = max(len(c) for c in [first["chosen_completion_ids"], *first["rejected_completion_ids"]])
    assert len(first["prompt_ids"]) + longest <= max_length
    assert len(first["prompt_ids"]) + longest >= max_length - 4  # cut no deeper than needed
    text = tokenizer.decode(first["prompt_ids"])
    head, tail = render(tokenizer, [SYSTEM, {"role": "user", "content": content}], add_generation_prompt=True).split(
        content
    )
    assert text.startswith(head + "HEADSTART alpha beta") and text.endswith("TAILEND" + tail)
    assert tokenizer.decode(first["chosen_completion_ids"]) == "[Score: 9]" + EOS_TOKEN
    # The short group is untouched.
    assert tokenized[1] == tokenize_preference_record(records[1], tokenizer)


def test_drop_policy_counts_and_keeps_the_rest(tokenizer, caplog):
    records = [group(prompt=[SYSTEM, {"role": "user", "content": long_context(300)}]), group(), group()]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tokenized, report = tokenize_preference_dataset(
            Dataset.from_list(records), tokenizer, max_length=128, truncation="drop", source_name="d"
        )
    assert (report.num_dropped, report.num_kept, report.num_truncated) == (1, 2, 0)
    assert tokenized.to_list() == [tokenize_preference_record(r, tokenizer) for r in records[1:]]
    assert sum("1 dropped as too long" in r.getMessage() for r in caplog.records) == 1
    assert tokenize_preference_record(records[0], tokenizer, max_length=128) is None


def test_truncate_standard_string_prompt(tokenizer):
    prompt = long_context(300)
    out = tokenize_preference_record(
        {"prompt": prompt, "chosen": " yes", "rejected": [" no"]},
        tokenizer,
        max_length=64,
        truncation="truncate_prompt",
    )
    assert len(out["prompt_ids"]) + 3 <= 64
    text = tokenizer.decode(out["prompt_ids"])
    assert text.startswith("HEADSTART alpha") and text.endswith("TAILEND") and len(text) < len(prompt)


def test_truncate_middle_to_fit_never_cuts_assistant_and_returns_none_when_impossible(tokenizer):
    messages = [{"role": "user", "content": "short"}, {"role": "assistant", "content": long_context(300)}]

    def count(m):
        return len(tokenizer.apply_chat_template(m)["input_ids"])

    assert truncate_middle_to_fit(messages, tokenizer, count, max_tokens=50) is None
    assert truncate_middle_to_fit(messages, tokenizer, count, max_tokens=10_000) is messages


def test_invalid_policy_and_missing_canonical_key(tokenizer):
    with pytest.raises(ValueError, match="unknown truncation policy 'middle'"):
        tokenize_preference_record(group(), tokenizer, max_length=10, truncation="middle")
    with pytest.raises(DataFormatError, match=r"^x, row 2, key 'rejected': missing key in a canonical record"):
        tokenize_preference_record({"prompt": "p", "chosen": "c", "rejects": ["r"]}, tokenizer, index=2, source="x")


# --------------------------------------------------------------------------------------------------------- SFT
def test_sft_mask_matches_template_generation_mask(tokenizer):
    messages = [
        SYSTEM,
        USER,
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "and again?"},
        {"role": "assistant", "content": "second answer"},
    ]
    out = tokenize_sft_record({"messages": messages}, tokenizer)
    reference = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    # Same tokens; the mask is the template's generation mask (assistant content + EOS, not the trailing "\n").
    assert out["input_ids"] == reference["input_ids"]
    assert out["completion_mask"] == reference["assistant_masks"]
    masked = [t for t, m in zip(out["input_ids"], out["completion_mask"]) if m]
    assert tokenizer.decode(masked) == "first answer" + EOS_TOKEN + "second answer" + EOS_TOKEN


def test_sft_without_generation_tags_and_standard_form():
    tokenizer = build_chat_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    messages = [USER, {"role": "assistant", "content": "an answer"}]
    out = tokenize_sft_record({"messages": messages}, tokenizer)
    assert out["input_ids"] == tokenizer.apply_chat_template(messages)["input_ids"]
    assert (
        tokenizer.decode([t for t, m in zip(out["input_ids"], out["completion_mask"]) if m]) == "an answer" + EOS_TOKEN
    )
    assert sum(out["completion_mask"]) == len(tokenizer("an answer", add_special_tokens=False)["input_ids"]) + 1

    out = tokenize_sft_record({"prompt": "2+2=", "completion": " 4"}, tokenizer)
    prompt_ids = tokenizer("2+2=")["input_ids"]
    assert out["input_ids"][: len(prompt_ids)] == prompt_ids
    assert out["completion_mask"] == [0] * len(prompt_ids) + [1] * (len(out["input_ids"]) - len(prompt_ids))
    assert tokenizer.decode(out["input_ids"][len(prompt_ids) :]) == " 4" + EOS_TOKEN


def test_sft_dataset_truncation_and_drop(tokenizer, caplog):
    answer = {"role": "assistant", "content": "the answer is the river"}
    rows = [
        {"messages": [SYSTEM, {"role": "user", "content": long_context(400)}, answer]},
        {"messages": [USER, answer]},
    ]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tokenized, report = tokenize_sft_dataset(
            Dataset.from_list(rows), tokenizer, max_length=200, truncation="truncate_prompt", source_name="sft"
        )
    assert (report.num_truncated, report.num_dropped, report.num_kept) == (1, 0, 2)
    first = tokenized[0]
    assert 190 <= len(first["input_ids"]) <= 200
    text = tokenizer.decode(first["input_ids"])
    assert "HEADSTART alpha" in text and "TAILEND" in text and text.endswith(answer["content"] + EOS_TOKEN + "\n")
    masked = [t for t, m in zip(first["input_ids"], first["completion_mask"]) if m]
    assert tokenizer.decode(masked) == answer["content"] + EOS_TOKEN
    assert sum("sft: tokenised 2 rows" in r.getMessage() for r in caplog.records) == 1

    dropped, report = tokenize_sft_dataset(Dataset.from_list(rows), tokenizer, max_length=200, truncation="drop")
    assert (report.num_dropped, len(dropped)) == (1, 1)
    assert dropped[0] == tokenize_sft_record(rows[1], tokenizer)


# ------------------------------------------------------------------------------------------ real LongRM sample
def test_shared_sample_truncated_to_4096(shared_sample_path, tokenizer, caplog):
    groups = load_preference_dataset(shared_sample_path, split="train")
    raw_prompts = groups["prompt"]
    # A rejected judgment in the sample runs to ~3K tokens with the tiny tokenizer, so 4096 leaves room for all.
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tokenized, report = tokenize_preference_dataset(
            groups, tokenizer, max_length=4096, truncation="truncate_prompt", source_name="longrm-sample"
        )
    assert (report.num_rows, report.num_truncated, report.num_dropped, report.num_kept) == (16, 16, 0, 16)
    assert sum("longrm-sample: tokenised 16 rows" in r.getMessage() for r in caplog.records) == 1
    for row, record, prompt in zip(tokenized, groups, raw_prompts):
        completions = [row["chosen_completion_ids"], *row["rejected_completion_ids"]]
        assert len(completions) == 5
        assert len(row["prompt_ids"]) + max(map(len, completions)) <= 4096
        assert tokenizer.decode(row["chosen_completion_ids"]) == record["chosen"] + EOS_TOKEN
        text = tokenizer.decode(row["prompt_ids"])
        user = prompt[1]["content"]
        # The system rubric is intact; the user message keeps its head (context start) and tail (question, response).
        assert text.startswith(render(tokenizer, prompt[:1]) + "<|im_start|>user\n" + user[:100])
        assert text.endswith(user[-100:] + "<|im_end|>\n<|im_start|>assistant\n")


def test_shared_sample_drop_policy_reports_16(shared_sample_path, tokenizer, caplog):
    groups = load_preference_dataset(shared_sample_path, split="train")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tokenized, report = tokenize_preference_dataset(
            groups, tokenizer, max_length=1024, truncation="drop", source_name="longrm-sample"
        )
    assert len(tokenized) == 0 and (report.num_dropped, report.num_kept) == (16, 0)
    assert sum("16 dropped as too long" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("kind", ["preference", "sft"])
def test_the_last_truncation_round_is_measured_too(tokenizer, monkeypatch, kind):
    """A prompt that fits only after the 4th (last allowed) cut is kept, not dropped as unsettled."""
    import trl_longrm.data.tokenization as tokenization

    real = tokenization.truncate_middle_to_fit
    # Each cut lands above the first target by this many tokens, whatever it is asked: only the 4th one fits.
    slack = [30, 20, 10, -5]
    calls = []

    def slow_cut(prompt, tokenizer, count_tokens, max_tokens, **kwargs):
        calls.append(max_tokens)
        return real(prompt, tokenizer, count_tokens, max_tokens=calls[0] + slack[len(calls) - 1], **kwargs)

    monkeypatch.setattr(tokenization, "truncate_middle_to_fit", slow_cut)
    prompt = [SYSTEM, {"role": "user", "content": long_context(400)}]
    if kind == "preference":
        out = tokenize_preference_record(group(prompt=prompt), tokenizer, max_length=120, truncation="truncate_prompt")
        length = len(out["prompt_ids"]) + max(map(len, [out["chosen_completion_ids"], *out["rejected_completion_ids"]]))
    else:
        record = {"messages": [*prompt, {"role": "assistant", "content": "[Analysis] fine. [Score: 7]"}]}
        out = tokenize_sft_record(record, tokenizer, max_length=120, truncation="truncate_prompt")
        length = len(out["input_ids"])
    assert len(calls) == tokenization.MAX_TRUNCATION_ROUNDS == 4
    assert length <= 120
