"""Tiny inputs of the data steps' tests: a saved tokenizer, a distractor corpus, short records, scripted judges."""

import json
import random
import re


WORDS = ("the of and to in was on that as by at it an be this which or are not city river number color animal "
         "country capital language price height weight distance").split()  # fmt: skip


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return str(path)


def read_jsonl(path):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_corpus(path, num_documents=300, seed=0, planted=()):
    """Filler documents of 20-200 words; `planted` texts are documents of their own (e.g. one holding an answer)."""
    rng = random.Random(seed)
    documents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))) + "." for _ in range(num_documents)]
    documents += list(planted)
    return write_jsonl(path, [{"text": text} for text in documents])


def short_records(num_records=3):
    """Records whose answers (`zebraN`) are words no filler has; two chunks each."""
    return [
        {
            "id": f"q{i}",
            "question": f"What does code {i} stand for?",
            "chunks": [f"The secret code {i} is zebra{i}.", f"Remember that zebra{i} means planet {i}."],
            "answer": f"zebra{i}",
        }
        for i in range(num_records)
    ]


def _reference_and_response(messages):
    user = messages[-1]["content"]
    reference = re.search(r"<reference_answer>\n(.*?)\n</reference_answer>", user, re.S).group(1)
    response = re.search(r"<response>\n(.*?)\n</response>", user, re.S).group(1)
    return reference, response


def strict_judge(messages, n, seed):
    """9 when the response holds the reference answer, else 2."""
    reference, response = _reference_and_response(messages)
    score = 9 if reference in response else 2
    return [f"[Analysis]\nThe response {'gives' if score > 5 else 'misses'} the answer.\n[Score: {score}]"] * n


def lenient_judge(messages, n, seed):
    """9 when the response holds the reference answer, 5 for a long one, else 2."""
    reference, response = _reference_and_response(messages)
    score = 9 if reference in response else 5 if len(response) > 40 else 2
    return [f"[Analysis]\nA lenient reading.\n[Score: {score}]"] * n


def silent_judge(messages, n, seed):
    """Never writes a score."""
    return ["It reads fine to me."] * n
