"""A huge row is cut by characters before it is tokenised (cost bounded by `max_length`, not by the row's size), and
the result equals tokenising the whole row and then truncating it by tokens."""

import random

import pytest

from trl_longrm.data.tokenization import DROPPED, _tokenize_preference, _tokenize_sft
from trl_longrm.data.truncation import PRECUT_MARGIN_TOKENS, precut_middle


MAX_LENGTH = 200
_WORDS = "the city river number name year colour animal planet capital author book price height".split()


class CountingTokenizer:
    """The tokenizer, recording the length of every text it tokenises."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.lengths = []

    def __call__(self, text, *args, **kwargs):
        self.lengths.append(len(text))
        return self._tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def huge_text(num_chars, seed):
    """Words, punctuation, non-Latin script and long runs without a space (the hard cases for a cut by characters)."""
    rng = random.Random(seed)
    parts, size = ["HEADSTART. "], 0
    while size < num_chars:
        kind = rng.random()
        if kind < 0.8:
            part = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) + rng.choice([". ", ", ", "\n"])
        elif kind < 0.9:
            part = "".join(chr(rng.randint(0x4E00, 0x4E80)) for _ in range(rng.randint(5, 40))) + " "
        else:
            part = "".join(rng.choice("abcdef0123456789") for _ in range(rng.randint(50, 400))) + " "
        parts.append(part)
        size += len(part)
    return "".join(parts) + " question: which city? TAILEND"


def rows(seed):
    context = huge_text(120_000, seed)
    second = huge_text(150, seed + 1)  # a second message, never the one cut (and short enough to fit)
    yield (
        "preference",
        {
            "prompt": [{"role": "system", "content": second}, {"role": "user", "content": context}],
            "chosen": "[Score: 9] consistent",
            "rejected": ["[Score: 2] the river is not there", "[Score: 4]"],
        },
    )
    yield "preference", {"prompt": context, "chosen": "yes", "rejected": ["no"]}
    yield (
        "sft",
        {
            "messages": [
                {"role": "user", "content": context},
                {"role": "assistant", "content": "[Analysis] consistent. [Score: 9]"},
            ]
        },
    )
    yield "sft", {"prompt": context, "completion": " [Score: 9]"}


@pytest.mark.parametrize("truncation", ["truncate_prompt", "drop"])
@pytest.mark.parametrize("seed", [0, 1])
def test_cut_by_characters_then_tokens_equals_tokenise_then_truncate(tokenizer, truncation, seed):
    for kind, record in rows(seed):
        tokenize = _tokenize_preference if kind == "preference" else _tokenize_sft
        whole = CountingTokenizer(tokenizer)
        reference = tokenize(record, whole, MAX_LENGTH, truncation, 0, "x", None, precut=False)
        bounded = CountingTokenizer(tokenizer)
        result = tokenize(record, bounded, MAX_LENGTH, truncation, 0, "x", None)
        assert result == reference, (kind, sorted(record))
        assert reference[1] == (DROPPED if truncation == "drop" else "truncated")
        # The reference tokenised the whole 120K-character context; the cut row never more than a bounded piece
        # (the doubling search reads up to 8 characters per token of max_length + margin, from each end).
        assert max(whole.lengths) > 120_000
        bound = 2 * 8 * (MAX_LENGTH + PRECUT_MARGIN_TOKENS) + 1_000  # + the other message and the template
        assert max(bounded.lengths) < bound, (kind, max(bounded.lengths))


def test_short_prompts_and_unsplittable_ones_are_left_alone(tokenizer):
    short = [{"role": "user", "content": "a short question"}]
    assert precut_middle(short, tokenizer, MAX_LENGTH) is short
    # Two equally long messages: cutting one would make the other the longest, which truncation would pick instead.
    text = huge_text(20_000, 3)
    twins = [{"role": "system", "content": text}, {"role": "user", "content": text}]
    assert precut_middle(twins, tokenizer, MAX_LENGTH) is twins
    # Only assistant turns: nothing may be cut.
    answers = [{"role": "assistant", "content": text}]
    assert precut_middle(answers, tokenizer, MAX_LENGTH) is answers
    cut = precut_middle(text, tokenizer, MAX_LENGTH)
    assert len(cut) < len(text) and cut.startswith(text[:1000]) and cut.endswith(text[-1000:])


@pytest.mark.parametrize("max_length", [4096, 16384])
def test_real_sample_rows_are_the_same_with_the_cut_by_characters(shared_sample_path, tokenizer, max_length):
    from trl_longrm.data import load_preference_dataset

    groups = load_preference_dataset(shared_sample_path, split="train")
    for index, record in enumerate(groups):
        reference = _tokenize_preference(
            record, tokenizer, max_length, "truncate_prompt", index, "s", None, precut=False
        )
        assert _tokenize_preference(record, tokenizer, max_length, "truncate_prompt", index, "s", None) == reference


@pytest.fixture
def transformers_warnings():
    """transformers' warnings shown, whatever an earlier test of this process left its verbosity at."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    yield
    transformers.logging.set_verbosity(verbosity)


def test_no_warning_about_the_row_length_before_truncation(caplog, transformers_warnings):
    from trl_longrm.testing_utils import build_chat_tokenizer

    record = {"prompt": [{"role": "user", "content": huge_text(20_000, 5)}], "chosen": "yes", "rejected": ["no"]}
    tokenizer = build_chat_tokenizer()
    tokenizer.model_max_length = 1024  # the row is longer, the truncated row is not
    with caplog.at_level("WARNING"):
        out, status = _tokenize_preference(record, tokenizer, 512, "truncate_prompt", 0, "x", None)
    assert status == "truncated" and len(out["prompt_ids"]) + 2 <= 512
    assert "longer than the specified maximum sequence length" not in caplog.text
    with caplog.at_level("WARNING"):  # the warning silenced: the whole row does produce it
        tokenizer(record["prompt"][0]["content"])
    assert "longer than the specified maximum sequence length" in caplog.text
