"""A small synthetic Long-RewardBench in the real on-disk layout, for tests and the demo.

Every task file mixes PairWise records (subtype `same` or a cross-model pair) and BestOfN records (2, 3 and 4
candidates, best first) over several context-length buckets. The texts are short: the bucket only scales how many
filler sentences the context has, so that longer buckets really are longer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from trl_longrm.evaluation.config import TASKS


_FILLER = (
    "The river passes the old city before it reaches the sea.",
    "A reference document lists the capital, the language and the price of each item.",
    "The author wrote the book in the year the planet was first observed.",
    "Each passage records one fact about a country and its largest city.",
    "The report compares the height and the weight of two animals.",
)
_BUCKET_SCALE = {"4k": 1, "8k": 2, "16k": 3, "32k": 4, "64k": 5, "128k": 6}
_CROSS_MODEL = "Qwen2.5-7B-Instruct|Llama-3.1-8B-Instruct"


def _context(rng: random.Random, bucket: str, fact: str) -> str:
    sentences = [rng.choice(_FILLER) for _ in range(2 * _BUCKET_SCALE.get(bucket, 1))]
    sentences.insert(rng.randint(0, len(sentences)), fact)
    return " ".join(sentences)


def _prompt(rng: random.Random, task: str, bucket: str, index: int) -> tuple[list[dict], str]:
    value = rng.randint(10, 99)
    fact = f"The key number of item {index} is {value}."
    messages = [
        {"role": "system", "content": f"You solve {task} problems over long documents."},
        {
            "role": "user",
            "content": f"{_context(rng, bucket, fact)}\n\nQuestion: what is the key number of item {index}?",
        },
    ]
    return messages, str(value)


def _answers(answer: str, n: int) -> list[str]:
    """`n` responses, best first: the correct one, then increasingly wrong or unhelpful ones."""
    pool = [
        f"The key number is {answer}, as the document states.",
        f"The key number is {int(answer) + 1}.",
        "The document does not say.",
        "I refuse to answer.",
    ]
    return pool[:n]


def make_toy_benchmark(
    path: str | Path,
    tasks: tuple[str, ...] | list[str] = TASKS,
    pairwise_per_task: int = 4,
    bestofn_per_task: int = 3,
    lengths: tuple[str, ...] | list[str] = ("4k", "8k", "16k", "32k"),
    seed: int = 0,
    with_ids: bool = True,
) -> Path:
    """Write `{Task}.jsonl` files of a small synthetic benchmark into `path` and return the directory.

    PairWise records alternate subtype `same` and a cross-model pair; BestOfN records cycle through 2, 3 and 4
    candidates. Lengths cycle through `lengths`. With `with_ids=False` records carry no `id` (the loader then derives
    one from the task and line number).

    Example:
    ```python
    >>> from trl_longrm.evaluation.fixtures import make_toy_benchmark
    >>> data_path = make_toy_benchmark("/tmp/toy_bench", tasks=["LongQA", "Math"])
    >>> sorted(p.name for p in data_path.iterdir())
    ['LongQA.jsonl', 'Math.jsonl']
    ```
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for task_index, task in enumerate(tasks):
        rng = random.Random(f"{seed}:{task}")
        lines = []
        for i in range(pairwise_per_task + bestofn_per_task):
            bucket = lengths[(i + task_index) % len(lengths)]
            messages, answer = _prompt(rng, task, bucket, i)
            record = {
                "prompt_template": messages,
                "ctx_length_for_length": bucket,
                "source": f"toy_{task.lower()}",
            }
            if i < pairwise_per_task:
                chosen, rejected = _answers(answer, 2)
                record.update(
                    tasktype="PairWise",
                    subtype="same" if i % 2 == 0 else _CROSS_MODEL,
                    chosen=chosen,
                    rejected=rejected,
                )
            else:
                n = 2 + (i - pairwise_per_task) % 3
                record.update(tasktype="BestOfN", subtype=n, candidates=_answers(answer, n))
            if with_ids:
                record = {"id": f"{task.lower()}-{i:04d}", **record}
            lines.append(json.dumps(record, ensure_ascii=False))
        (path / f"{task}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
