"""Scripted stand-ins for the models of the data steps on the synthetic world (`trl_longrm.datagen`, the data demo):
short records and a distractor corpus, a responder that reads the facts it is shown, and judges of different care.

They are the `python` backend's functions (`function(messages, n=..., seed=...) -> n texts`): a pipeline names them
as `trl_longrm.synthetic.scripted:exact_judge`. The judges write the demo judge's pointwise judgment
(`Response: c/n correct.` then `[[score]]`, `trl_longrm.synthetic.suite.pointwise_verdict_lines`), reading the
record's clues (the short context) and the response; each judge errs in its own way, so that they disagree as real
judges do and consensus voting has something to vote on.

Example:
```python
>>> from trl_longrm.synthetic.scripted import exact_judge, short_records
>>> records = short_records(seed=0, num_records=2)
>>> records[0]["chunks"][:1], records[0]["answer"]
```
"""

from __future__ import annotations

import hashlib
import random
import re

from trl_longrm.synthetic.suite import pointwise_verdict_lines
from trl_longrm.synthetic.world import SURFACES, VALUES, filler_sentence, split_keys


KEYS_PER_QUESTION = 3


def short_records(
    seed: int, num_records: int, num_facts: int = 4, keys_per_question: int = KEYS_PER_QUESTION
) -> list[dict]:
    """Short records of `expand`: a fact sheet's facts as the critical chunks (`num_facts`, of which
    `keys_per_question` are asked), the correct response as the answer, and the surface's system line and title as
    columns the prompts use (`instruction`, `title`). Keys of the training side of the world's split only."""
    keys = split_keys("train")
    rng = random.Random(f"records:{seed}")
    records = []
    for index in range(num_records):
        task = list(SURFACES)[index % len(SURFACES)]
        surface = SURFACES[task]
        facts = dict(zip(rng.sample(keys, num_facts), rng.sample(VALUES, num_facts), strict=True))
        asked = rng.sample(list(facts), keys_per_question)
        records.append(
            {
                "id": f"r{index}",
                "task": task,
                "question": surface.question.format(keys=", ".join(asked)),
                "chunks": [surface.fact_sentence(key, value) for key, value in facts.items()],
                "answer": " ".join(surface.fact_sentence(key, facts[key]) for key in asked),
                "instruction": surface.system,
                "title": surface.title,
                "perspective": "faithfulness",
            }
        )
    return records


def filler_corpus(seed: int, num_documents: int) -> list[dict]:
    """Distractor documents: one to three filler sentences each (no fact, no value, no key)."""
    rng = random.Random(f"corpus:{seed}")
    return [{"text": " ".join(filler_sentence(rng) for _ in range(rng.randint(1, 3)))} for _ in range(num_documents)]


def _rng(seed, *parts) -> random.Random:
    digest = hashlib.sha256("\x00".join(map(str, (seed, *parts))).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _task_and_facts(text: str) -> tuple[str | None, dict[str, str]]:
    """The surface whose facts `text` states, and those facts."""
    for task, surface in SURFACES.items():
        found = dict(surface.pattern().findall(text))
        if found:
            return task, found
    return None, {}


def _task_of_question(question: str) -> str | None:
    """The surface whose question `question` is (the text before its keys), or None."""
    question = question.strip()
    for task, surface in SURFACES.items():
        if question.startswith(surface.question.split("{keys}")[0]):
            return task
    return None


def _asked_keys(question: str) -> list[str]:
    return re.findall(r"\b[A-Z][0-9]{2}\b", question)


def reader(messages, n: int = 1, seed: int | None = None) -> list[str]:
    """A responder that states, for each asked key, the value the context it was shown gives (a clue dropped from its
    context: a value it makes up), and misreads one with probability 0.05."""
    prompt = messages[-1]["content"]
    context, _, question = prompt.rpartition("# Question")
    facts = _task_and_facts(context)[1]
    task = _task_of_question(question)
    asked = _asked_keys(question)
    if task is None or not asked:
        return ["I cannot tell from the question."] * n
    surface = SURFACES[task]
    answers = []
    for sample in range(n):
        rng = _rng(seed, sample, prompt)
        sentences = []
        for key in asked:
            value = facts.get(key)
            if value is None or rng.random() < 0.05:
                value = rng.choice([v for v in VALUES if v not in facts.values()])
            sentences.append(surface.fact_sentence(key, value))
        answers.append(" ".join(sentences))
    return answers


def _count(messages) -> tuple[int, int, dict, dict, list[str]] | None:
    """(correct values, asked keys, the clues' facts, the response's facts, the asked keys) of a judge's prompt."""
    prompt = messages[-1]["content"]
    clues = prompt.split("# Clues", 1)[-1].split("# Question", 1)[0]
    question = prompt.split("# Question", 1)[-1].split("# Reference", 1)[0]
    response = prompt.split("# Response", 1)[-1]
    task, facts = _task_and_facts(clues)
    asked = _asked_keys(question)
    if task is None or not asked:
        return None
    stated = dict(SURFACES[task].pattern().findall(response))
    correct = sum(1 for key in asked if stated.get(key) == facts.get(key))
    return correct, len(asked), facts, stated, asked


def _judgment(correct: int, asked: int) -> str:
    return "\n".join(pointwise_verdict_lines(correct, asked))


def exact_judge(messages, n: int = 1, seed: int | None = None) -> list[str]:
    """Counts the response's correct values exactly."""
    counted = _count(messages)
    return [_judgment(*counted[:2]) if counted else "No facts to check.\n[[0]]"] * n


def noisy_judge(messages, n: int = 1, seed: int | None = None) -> list[str]:
    """Miscounts by one, a quarter of the time."""
    counted = _count(messages)
    if counted is None:
        return ["No facts to check.\n[[0]]"] * n
    correct, asked = counted[:2]
    rng = _rng(seed, "noisy", messages[-1]["content"])
    if rng.random() < 0.25:
        correct = min(asked, max(0, correct + rng.choice([-1, 1])))
    return [_judgment(correct, asked)] * n


def lenient_judge(messages, n: int = 1, seed: int | None = None) -> list[str]:
    """Takes a value as correct when the response states it for the key at all, half the time (a judge that checks
    the format more than the facts)."""
    counted = _count(messages)
    if counted is None:
        return ["No facts to check.\n[[0]]"] * n
    correct, asked, _, stated, keys = counted
    rng = _rng(seed, "lenient", messages[-1]["content"])
    if rng.random() < 0.5:
        correct = sum(1 for key in keys if key in stated)
    return [_judgment(correct, asked)] * n


def sloppy_judge(messages, n: int = 1, seed: int | None = None) -> list[str]:
    """Counts exactly, but a fifth of its answers end without a score (they vote -1)."""
    counted = _count(messages)
    rng = _rng(seed, "sloppy", messages[-1]["content"])
    if counted is None or rng.random() < 0.2:
        return ["The response looks plausible."] * n
    return [_judgment(*counted[:2])] * n


def harsh_judge(messages, n: int = 1, seed: int | None = None) -> list[str]:
    """Finds no value correct, half the time (a judge that finds fault where there is none: the mirror of
    `lenient_judge`, so that the judges' mistakes do not all lean one way)."""
    counted = _count(messages)
    if counted is None:
        return ["No facts to check.\n[[0]]"] * n
    correct, asked = counted[:2]
    rng = _rng(seed, "harsh", messages[-1]["content"])
    if rng.random() < 0.5:
        correct = 0
    return [_judgment(correct, asked)] * n
