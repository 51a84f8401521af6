"""Synthetic long documents of key-value facts, questions about some keys, and responses graded against the facts.

A *fact sheet* is a document of filler sentences with facts such as `Record P27 holds the word planet.` scattered
through it. A question names one or more keys of the sheet; a response restates a value for each key, in the same
sentence form. A response is consistent with the context when every value it gives is the value the document gives
for that key; a wrong value is either the value of another key of the same document (`swap`: fluent and present in
the context, so only reading the right fact exposes it) or a value the document never mentions (`absent`).

Each of the seven Long-RewardBench tasks gets its own surface (`Record ... holds the word ...`, `Variable ... is set
to ...`, ...) over the same structure, so that `parse_facts` can read the facts back from any text.

Example:
```python
>>> import random
>>> from trl_longrm.synthetic.world import make_fact_sheet, make_responses, parse_facts
>>> sheet = make_fact_sheet(random.Random(0), "LongQA", keys=["P27", "K05", "B11"], num_facts=3, target_tokens=120)
>>> responses = make_responses(random.Random(1), sheet, sheet.keys[:1], errors=[0, 1])
>>> parse_facts("LongQA", responses[0])[sheet.keys[0]] == sheet.facts[sheet.keys[0]]
True
```
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field


# Values are words that the tiny test tokenizer (`build_chat_tokenizer`) encodes as ONE token after a space, so that a
# value is a single unit to look up; a test checks this. None of them occurs in a surface's texts, in the judge's
# prompts of `trl_longrm.evaluation.prompts` or in the filler.
VALUES = (
    "year over relevant correct book short had when time also author worse harmless name between some supports out "
    "passage than score such planet been have claim fact"
).split()

# Filler vocabulary: words that are neither values nor key-like, so filler never states or mimics a fact.
FILLER_WORDS = (
    "the of and to in was on that as by at it an be this which or are not but were one all there would can will "
    "more who what about up into them could other its only after first two new these may like any well most where "
    "city river number color animal country capital language price height weight distance"
).split()

KEY_LETTERS = "BCDFGHJKLMNPRSTVWXZ"


@dataclass(frozen=True)
class Surface:
    """How one task phrases facts and questions: `{key}` and `{value}` fill `fact`; `{keys}` fills `question`."""

    title: str
    fact: str
    question: str
    system: str

    def fact_sentence(self, key: str, value: str) -> str:
        return self.fact.format(key=key, value=value)

    def pattern(self) -> re.Pattern:
        """Regex reading `(key, value)` pairs of this surface back from any text."""
        before, after = self.fact.split("{key}")
        middle, end = after.split("{value}")
        return re.compile(re.escape(before) + r"([A-Z][0-9]+)" + re.escape(middle) + r"([a-z]+)" + re.escape(end))


SURFACES = {
    "LongQA": Surface(
        "Archive notes",
        "Record {key} holds the word {value}.",
        "Which word does each of these records hold: {keys}?",
        "Answer the question using only the notes.",
    ),
    "Summ": Surface(
        "Chapter outline",
        "Chapter {key} is mainly about {value}.",
        "Summarise what each of these chapters is mainly about: {keys}.",
        "Summarise faithfully; state only what the outline says.",
    ),
    "Safety": Surface(
        "Access policy",
        "Badge {key} is cleared for the {value} wing.",
        "For security, tell me which wing each of these badges is cleared for: {keys}.",
        "Follow the access policy exactly; never grant access it does not state.",
    ),
    "ICL": Surface(
        "Worked examples",
        "Example input {key} gives output {value}.",
        "Following the examples, give the output of each of these inputs: {keys}.",
        "Learn the mapping in the examples and apply it.",
    ),
    "Cite": Surface(
        "Source list",
        "Source {key} backs the point about {value}.",
        "Cite the point each of these sources backs: {keys}.",
        "Cite only what the source list backs.",
    ),
    "Code": Surface(
        "Configuration file",
        "Variable {key} is set to {value}.",
        "What is each of these variables set to: {keys}?",
        "Read the configuration and report the settings.",
    ),
    "Math": Surface(
        "Substitution table",
        "Symbol {key} stands for {value}.",
        "Which word does each of these symbols stand for: {keys}?",
        "Use the substitution table to answer.",
    ),
}


def all_keys(key_digits: int = 2) -> list[str]:
    """Every key: a capital letter and `key_digits` digits (`P27`)."""
    return [f"{letter}{n:0{key_digits}d}" for letter in KEY_LETTERS for n in range(10**key_digits)]


def key_split(key: str, eval_fraction: float = 0.25) -> str:
    """`"eval"` or `"train"`: a fixed partition of the keys by hash, so a benchmark never asks about a training key."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") / 2**32
    return "eval" if bucket < eval_fraction else "train"


def split_keys(split: str, key_digits: int = 2, eval_fraction: float = 0.25) -> list[str]:
    """The keys of one side (`"train"` or `"eval"`) of the partition of `key_split`."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    return [key for key in all_keys(key_digits) if key_split(key, eval_fraction) == split]


@dataclass
class FactSheet:
    """A document (`context`) stating `facts` (key -> value) among filler, for one task surface.

    `keys` lists the facts in document order.
    """

    task: str
    facts: dict[str, str]
    keys: list[str]
    context: str
    sentences: list[str] = field(repr=False, default_factory=list)

    @property
    def surface(self) -> Surface:
        return SURFACES[self.task]


def filler_sentence(rng: random.Random) -> str:
    words = [rng.choice(FILLER_WORDS) for _ in range(rng.randint(6, 14))]
    return " ".join(words).capitalize() + "."


def make_fact_sheet(
    rng: random.Random,
    task: str,
    keys: list[str],
    num_facts: int,
    target_tokens: int,
    count_tokens=None,
) -> FactSheet:
    """A document of `num_facts` facts about keys drawn from `keys`, padded with filler to about `target_tokens`.

    Values within one document are distinct (so a `swap` distractor is always wrong). `count_tokens(text)` measures
    length (default: 4 characters per token); filler is added until the document has at least `target_tokens`.
    """
    if task not in SURFACES:
        raise ValueError(f"Unknown task {task!r}; expected one of {list(SURFACES)}.")
    if not 1 <= num_facts <= len(VALUES):
        raise ValueError(f"num_facts must be between 1 and {len(VALUES)} (distinct values), got {num_facts}.")
    if num_facts > len(keys):
        raise ValueError(f"num_facts={num_facts} exceeds the {len(keys)} available keys.")
    count_tokens = count_tokens or (lambda text: len(text) // 4)
    surface = SURFACES[task]
    chosen_keys = rng.sample(keys, num_facts)
    values = rng.sample(VALUES, num_facts)
    facts = dict(zip(chosen_keys, values))
    fact_sentences = [surface.fact_sentence(k, v) for k, v in facts.items()]
    budget = target_tokens - sum(count_tokens(" " + s) for s in fact_sentences)
    fillers = []
    while budget > 0:
        sentence = filler_sentence(rng)
        fillers.append(sentence)
        budget -= count_tokens(" " + sentence)
    # Facts go to random slots among the filler, in random order.
    sentences = list(fillers)
    for sentence in fact_sentences:
        sentences.insert(rng.randint(0, len(sentences)), sentence)
    # Sentence counts add up to about the document's count; top up until the document itself reaches the target.
    while count_tokens(" ".join(sentences)) < target_tokens:
        sentences.insert(rng.randint(0, len(sentences)), filler_sentence(rng))
    order = [k for s in sentences for k, _ in surface.pattern().findall(s)]
    return FactSheet(task, facts, order, " ".join(sentences), sentences)


def wrong_value(rng: random.Random, sheet: FactSheet, key: str, kind: str, avoid: set[str]) -> str:
    """A value that contradicts the document for `key`: another key's value (`swap`) or an unmentioned one (`absent`).

    `avoid` holds values already used at this position by other responses, so that responses stay distinct; when the
    requested kind has no value left, the other kind is used.
    """
    stated = set(sheet.facts.values())
    swap = sorted(v for v in stated - {sheet.facts[key]} - avoid)
    absent = sorted(v for v in set(VALUES) - stated - avoid)
    pools = (swap, absent) if kind == "swap" else (absent, swap)
    for pool in pools:
        if pool:
            return rng.choice(pool)
    raise ValueError(f"No wrong value left for key {key!r}: the document states too many values.")


def make_responses(
    rng: random.Random,
    sheet: FactSheet,
    asked: list[str],
    errors: list[int],
    swap_probability: float = 1.0,
) -> list[str]:
    """One response per entry of `errors`, restating a value for each asked key; `errors[i]` of them are wrong.

    Wrong values are `swap` distractors with probability `swap_probability`, else `absent` ones. Responses with the
    same number of errors differ in which keys or values are wrong.
    """
    surface = sheet.surface
    used: dict[str, set[str]] = {key: set() for key in asked}
    responses = []
    for num_errors in errors:
        if not 0 <= num_errors <= len(asked):
            raise ValueError(f"A response about {len(asked)} keys cannot have {num_errors} errors.")
        wrong_keys = set(rng.sample(asked, num_errors))
        sentences = []
        for key in asked:
            if key in wrong_keys:
                kind = "swap" if rng.random() < swap_probability else "absent"
                value = wrong_value(rng, sheet, key, kind, used[key])
                used[key].add(value)
            else:
                value = sheet.facts[key]
            sentences.append(surface.fact_sentence(key, value))
        responses.append(" ".join(sentences))
    return responses


def parse_facts(task: str, text: str) -> dict[str, str]:
    """Every `(key, value)` a text states in the surface of `task`; a key stated twice with two values raises."""
    facts: dict[str, str] = {}
    for key, value in SURFACES[task].pattern().findall(text):
        if facts.get(key, value) != value:
            raise ValueError(f"{task} text states two values for key {key!r}: {facts[key]!r} and {value!r}.")
        facts[key] = value
    return facts


def count_errors(task: str, context: str, response: str) -> int:
    """How many values of `response` differ from the values `context` states for the same keys.

    A key that the context does not state counts as an error too.

    Example:
    ```python
    >>> count_errors("Code", "Variable B01 is set to book. Variable C02 is set to fact.",
    ...              "Variable B01 is set to fact.")
    1
    ```
    """
    facts = parse_facts(task, context)
    return sum(1 for key, value in parse_facts(task, response).items() if facts.get(key) != value)
