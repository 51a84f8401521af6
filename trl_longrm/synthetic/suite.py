"""Writing a synthetic long-context judging suite: judge SFT data, SimPO-GRM and DisRM preference data, and a held-out
mini Long-RewardBench, all built on the fact sheets of `trl_longrm.synthetic.world`.

The judge prompts are the evaluator's own (the built-in `PromptTemplate`, or the file `prompt_template` names, applied
to the task prompt a `BenchmarkRecord` shows the judge), so a judge trained here is evaluated on exactly the inputs it
learnt.
Training data uses the `train` keys of `world.key_split` and the benchmark the `eval` keys, with their own seeds.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trl_longrm.evaluation.benchmark import BenchmarkRecord
from trl_longrm.evaluation.config import JUDGE_PROTOCOLS, TASKS
from trl_longrm.evaluation.prompts import (
    PAIRWISE_SYSTEM_PROMPT,
    POINTWISE_SCALE,
    RANKING_SYSTEM_PROMPT,
    label,
)
from trl_longrm.evaluation.templates import PromptTemplate
from trl_longrm.synthetic.world import (
    SURFACES,
    VALUES,
    FactSheet,
    all_keys,
    filler_sentence,
    make_fact_sheet,
    make_responses,
    split_keys,
)


logger = logging.getLogger(__name__)

SFT_FILE = "sft/train.jsonl"
GRM_FILE = "grm/train.jsonl"
DISRM_FILE = "disrm/train.jsonl"
BENCHMARK_DIR = "bench"
MANIFEST_FILE = "manifest.json"
# Some values must stay unstated in every document, for `absent` distractors.
MAX_FACTS = len(VALUES) - 8


@dataclass
class SyntheticConfig:
    """Settings of `generate_synthetic_suite` (each field is a `--kebab-case` flag of `python -m trl_longrm.synthetic`).

    Example:
    ```python
    >>> config = SyntheticConfig(seed=1, num_train=200, lengths={"4k": 300, "8k": 600})
    ```
    """

    seed: int = field(default=0, metadata={"help": "Seed of every random choice; same seed, same files. Default 0."})
    num_train: int = field(
        default=400,
        metadata={"help": "Examples in each training set (judge SFT, SimPO-GRM, DisRM). Default 400."},
    )
    num_train_disrm: int | None = field(
        default=None,
        metadata={"help": "Examples in the DisRM training set, if not `num_train`. Default None (`num_train`)."},
    )
    train_tokens: tuple[int, int] = field(
        default=(150, 600),
        metadata={
            "help": "Range (min, max) of the document length in tokens of a training example, drawn log-uniformly "
            "(short documents are common, long ones still appear). Default (150, 600)."
        },
    )
    num_rejected: int = field(
        default=3, metadata={"help": "Rejected responses (DisRM) or judgments (SimPO-GRM) per example. Default 3."}
    )
    ranking_fraction: float = field(
        default=0.3,
        metadata={
            "help": "Fraction of judge training examples (SFT, SimPO-GRM) that use the ranking protocol with 3 or 4 "
            "responses; the rest are pairwise. Default 0.3."
        },
    )
    lengths: dict[str, int] = field(
        default_factory=lambda: {"4k": 300, "8k": 700, "16k": 1500},
        metadata={
            "help": "Benchmark length buckets: bucket name (`ctx_length_for_length`) -> document length in tokens. "
            "Default {'4k': 300, '8k': 700, '16k': 1500}."
        },
    )
    pairwise_per_bucket: int = field(
        default=4, metadata={"help": "PairWise benchmark records per task and length bucket. Default 4."}
    )
    bestofn_per_bucket: int = field(
        default=3,
        metadata={
            "help": "BestOfN benchmark records per task and length bucket, cycling through 2, 3 and 4 candidates. "
            "Default 3."
        },
    )
    tasks: list[str] = field(
        default_factory=lambda: list(TASKS), metadata={"help": f"Tasks to write; default all of {', '.join(TASKS)}."}
    )
    tokens_per_fact: int = field(
        default=60,
        metadata={
            "help": "Document tokens per fact: a document of T tokens states about T / tokens_per_fact facts (at "
            "least `min_facts`, at most 26). Default 60."
        },
    )
    min_facts: int = field(
        default=4, metadata={"help": "Fewest facts a document states, however short it is. Default 4."}
    )
    swap_probability: float = field(
        default=1.0,
        metadata={
            "help": "Probability that a wrong value is another key's value from the same document (`swap`) rather "
            "than a value the document never states (`absent`). Default 1.0 (always swap)."
        },
    )
    keys_per_question: int = field(
        default=1,
        metadata={
            "help": "Keys a pairwise question (DisRM rows, pairwise judge rows, PairWise benchmark records) asks about; "
            "its rejected responses state a wrong value for every one of them. Default 1."
        },
    )
    judgment_evidence: bool = field(
        default=True,
        metadata={
            "help": "Start each judgment of the judge data (SFT, SimPO-GRM) with an `Evidence:` line quoting the "
            "document's facts for the asked keys, before the per-response counts and the verdict. Default True."
        },
    )
    judge_protocol: str = field(
        default="pairwise",
        metadata={
            "help": "Judging protocol of the judge data (SFT, SimPO-GRM): `pairwise` (all responses of an example in "
            "one prompt, as LongRM; a pairwise verdict or a ranking) or `pointwise` (one row per response of each "
            "example, the rows of one example next to each other, judged with the pointwise prompt: its "
            "correct count and a score `[[0]]`..`[[9]]`). Evaluate a judge trained on pointwise rows with "
            "`judge_protocol=pointwise`. Default pairwise."
        },
    )
    length_curriculum: bool = field(
        default=False,
        metadata={
            "help": "Write each training file shortest document first (a curriculum: a small model learns to find a "
            "fact in a short document before a long one). Train with `train_sampling_strategy: sequential` to keep "
            "the order; the default random sampler shuffles it away. Default False (rows in generation order)."
        },
    )
    prompt_template: str | None = field(
        default=None,
        metadata={
            "help": "YAML file of judge prompts (as `trl-longrm eval --prompt-template`) for the judge data (SFT, "
            "SimPO-GRM); evaluate the trained judge with the same file. Default None: the built-in prompts."
        },
    )
    key_digits: int = field(default=2, metadata={"help": "Digits of a key after its letter (`P27`). Default 2."})
    eval_key_fraction: float = field(
        default=0.25, metadata={"help": "Fraction of keys reserved for the benchmark. Default 0.25."}
    )

    def __post_init__(self):
        self.train_tokens = tuple(self.train_tokens)
        self.tasks = list(self.tasks)
        unknown = [task for task in self.tasks if task not in SURFACES]
        if unknown:
            raise ValueError(f"Unknown task(s) {unknown}; expected a subset of {list(SURFACES)}.")
        if len(self.train_tokens) != 2 or not 0 < self.train_tokens[0] <= self.train_tokens[1]:
            raise ValueError(f"train_tokens must be (min, max) with 0 < min <= max, got {self.train_tokens}.")
        if self.num_train_disrm is not None and self.num_train_disrm < 1:
            raise ValueError(f"num_train_disrm must be >= 1 or None, got {self.num_train_disrm}.")
        if self.num_rejected < 1:
            raise ValueError(f"num_rejected must be >= 1, got {self.num_rejected}.")
        if not 0 <= self.ranking_fraction <= 1 or not 0 <= self.swap_probability <= 1:
            raise ValueError("ranking_fraction and swap_probability must lie in [0, 1].")
        if not 2 <= self.min_facts <= MAX_FACTS:
            raise ValueError(f"min_facts must be between 2 and {MAX_FACTS}, got {self.min_facts}.")
        if not 1 <= self.keys_per_question <= self.min_facts:
            raise ValueError(
                f"keys_per_question must be between 1 and min_facts={self.min_facts}, got {self.keys_per_question}."
            )
        if self.judge_protocol not in JUDGE_PROTOCOLS:
            raise ValueError(f"judge_protocol must be one of {list(JUDGE_PROTOCOLS)}, got {self.judge_protocol!r}.")
        if not self.lengths or any(tokens <= 0 for tokens in self.lengths.values()):
            raise ValueError(f"lengths must map bucket names to positive token counts, got {self.lengths}.")


@dataclass
class JudgingExample:
    """One generated item: a fact sheet, the prompt messages built on it, and responses best first.

    `errors[i]` is the number of wrong values in `responses[i]` (0 for the first, rising); gold ranks follow it.
    """

    sheet: FactSheet
    asked: list[str]
    prompt_messages: list[dict[str, str]]
    responses: list[str]
    errors: list[int]
    tokens: int

    @property
    def task_prompt(self) -> str:
        """The task text a generative judge sees (as the evaluator builds it from a `BenchmarkRecord`)."""
        return BenchmarkRecord(
            id="", task="", tasktype="", subtype=None, length=None, prompt_messages=self.prompt_messages, candidates=[]
        ).task_prompt


class _TokenCounter:
    """Token counts of sentences with the suite's tokenizer, cached (filler sentences repeat)."""

    def __init__(self, tokenizer):
        self.cache: dict[str, int] = {}
        # A fast tokenizer's own encoder gives the same ids without transformers' per-call Python (~8x faster: the
        # suite's documents are measured sentence by sentence, ~70K calls for the demo's data).
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self.encode = (
            (lambda text: backend.encode(text, add_special_tokens=False).ids)
            if backend is not None
            else (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
        )

    def __call__(self, text: str) -> int:
        if text in self.cache:
            return self.cache[text]
        count = len(self.encode(text))
        if len(text) < 300:  # sentences repeat, whole documents do not
            self.cache[text] = count
        return count


def _num_facts(tokens: int, config: SyntheticConfig) -> int:
    return max(config.min_facts, min(MAX_FACTS, tokens // config.tokens_per_fact))


def make_example(
    rng: random.Random, task: str, keys: list[str], tokens: int, errors: list[int], config: SyntheticConfig, counter
) -> JudgingExample:
    """A fact sheet of about `tokens` tokens, a question about `max(errors)` (at least 1) of its keys, and responses."""
    num_asked = max(1, max(errors))
    sheet = make_fact_sheet(rng, task, keys, max(num_asked, _num_facts(tokens, config)), tokens, counter)
    asked = rng.sample(sheet.keys, num_asked)
    surface = sheet.surface
    question = surface.question.format(keys=", ".join(asked))
    messages = [
        {"role": "system", "content": surface.system},
        {"role": "user", "content": f"# {surface.title}\n{sheet.context}\n\n# Question\n{question}"},
    ]
    responses = make_responses(rng, sheet, asked, errors, config.swap_probability)
    return JudgingExample(sheet, asked, messages, responses, list(errors), counter(sheet.context))


def judgment(
    example: JudgingExample, order: list[int], ranking: bool, claimed: list[int] | None = None, evidence: bool = True
) -> str:
    """A judge's answer for the responses shown in `order` (`order[p]`: index of the response at position p).

    The answer quotes the facts the question needs (unless `evidence=False`), counts each displayed response's correct
    values and ends with the verdict. `claimed[p]` (default: the true ranks) is the rank the judgment gives position
    p; a wrong `claimed` gives a fluent judgment with wrong counts and verdict (a rejected judgment for SimPO).
    """
    surface = example.sheet.surface
    num_asked = len(example.asked)
    true_ranks = list(order)
    claimed = true_ranks if claimed is None else claimed
    # Correct counts, sorted best first, handed out by claimed rank: the counts agree with the verdict.
    counts_best_first = sorted(num_asked - example.errors[i] for i in order)[::-1]
    quoted = " ".join(surface.fact_sentence(key, example.sheet.facts[key]) for key in example.asked)
    lines = [f"Evidence: {quoted}"] if evidence else []
    for position in range(len(order)):
        lines.append(f"Response {label(position)}: {counts_best_first[claimed[position]]}/{num_asked} correct.")
    if ranking:
        best_first = sorted(range(len(order)), key=lambda p: claimed[p])
        verdict = "[[" + ">".join(label(p) for p in best_first) + "]]"
    else:
        verdict = f"[[{label(claimed.index(0))}]]"
    return "\n".join(lines + [verdict])


def pointwise_score(correct: int, asked: int) -> int:
    """The pointwise score of a response with `correct` of `asked` values right: the fraction, on the 0..9 scale."""
    low, high = POINTWISE_SCALE
    return low + round((high - low) * correct / asked)


def pointwise_judgment(example: JudgingExample, index: int, claimed: int | None = None, evidence: bool = True) -> str:
    """A pointwise judge's answer for `example.responses[index]` alone: the facts it needs (unless `evidence=False`),
    its count of correct values and the score. `claimed` (default: the true count) gives a fluent judgment with a
    wrong count and score (a rejected judgment for SimPO)."""
    num_asked = len(example.asked)
    correct = num_asked - example.errors[index] if claimed is None else claimed
    lines = []
    if evidence:
        surface = example.sheet.surface
        lines.append("Evidence: " + " ".join(surface.fact_sentence(k, example.sheet.facts[k]) for k in example.asked))
    return "\n".join(lines + pointwise_verdict_lines(correct, num_asked))


def pointwise_verdict_lines(correct: int, asked: int) -> list[str]:
    """The end of a pointwise judgment of a response with `correct` of `asked` values right: its count and score."""
    return [f"Response: {correct}/{asked} correct.", f"[[{pointwise_score(correct, asked)}]]"]


def _wrong_rankings(rng: random.Random, n: int, true_ranks: list[int], k: int) -> list[list[int]]:
    """`k` rank assignments different from `true_ranks` (repeating when fewer than k exist, as with n = 2)."""
    import itertools

    wrong = [list(p) for p in itertools.permutations(range(n)) if list(p) != true_ranks]
    rng.shuffle(wrong)
    return [wrong[i % len(wrong)] for i in range(k)]


def _train_errors(rng: random.Random, ranking: bool, config: SyntheticConfig) -> list[int]:
    if not ranking:
        return [0, config.keys_per_question]
    n = rng.choice([3, 4])
    return list(range(n))


def tokenizer_corpus(seed: int = 0, num_lines: int = 3000) -> list[str]:
    """Lines of text in the suite's vocabulary (documents, questions, responses, judge prompts and judgments), for
    training a tokenizer whose tokens are the suite's words (`build_chat_tokenizer(corpus=tokenizer_corpus())`).

    The tiny test tokenizer splits words it was not trained on into characters, so a suite document costs about three
    tokens per word; with this corpus it costs about one, and a small model sees the same text in shorter sequences.
    """
    rng = random.Random(seed)
    keys = all_keys()
    fixed = [
        PAIRWISE_SYSTEM_PROMPT,
        RANKING_SYSTEM_PROMPT,
        "Which response is better? End with [[A]] or [[B]].",
        "Rank the responses, best first.",
    ]
    for surface in SURFACES.values():
        fixed += [surface.system, f"# {surface.title}", "# Question", "# Task"]
    lines = []
    for i in range(num_lines):
        surface = SURFACES[list(SURFACES)[i % len(SURFACES)]]
        facts = [surface.fact_sentence(rng.choice(keys), rng.choice(VALUES)) for _ in range(3)]
        letter = label(rng.randrange(4))
        lines += [
            " ".join(facts + [filler_sentence(rng)]),
            surface.question.format(keys=", ".join(rng.sample(keys, 2))),
            f"# Response {letter}\n{facts[0]}\n# End of Response {letter}",
            f"Evidence: {facts[1]}\nResponse {letter}: {rng.randint(0, 3)}/{rng.randint(1, 3)} correct.\n[[{letter}]]",
            fixed[i % len(fixed)],
        ]
    return lines


class SuiteBuilder:
    """Builds the rows of each file of the suite; `generate_synthetic_suite` writes them.

    Each row comes from its own random stream (seeded by the suite seed, the dataset and the row index), so a row
    does not depend on how many rows come before it.
    """

    def __init__(self, config: SyntheticConfig, tokenizer=None):
        if tokenizer is None:
            from trl_longrm.testing_utils import build_chat_tokenizer

            tokenizer = build_chat_tokenizer()
        self.config = config
        self.counter = _TokenCounter(tokenizer)
        self.train_keys = split_keys("train", config.key_digits, config.eval_key_fraction)
        self.eval_keys = split_keys("eval", config.key_digits, config.eval_key_fraction)
        self.template = (
            PromptTemplate.from_yaml(config.prompt_template) if config.prompt_template else PromptTemplate.default()
        )
        if config.judge_protocol == "pointwise" and self.template.pointwise.verdict != "[[N]]":
            raise ValueError(
                f"{config.prompt_template}: key `pointwise.verdict` is {self.template.pointwise.verdict!r}, but the "
                "synthetic judgments end with `[[N]]` scores; use a template with `verdict: \"[[N]]\"`."
            )

    def _rng(self, *parts) -> random.Random:
        return random.Random(":".join(str(p) for p in (self.config.seed, *parts)))

    def _train_example(self, dataset: str, index: int, errors_fn) -> tuple[random.Random, JudgingExample]:
        rng = self._rng(dataset, index)
        task = self.config.tasks[index % len(self.config.tasks)]
        # Log-uniform: as many examples between 50 and 100 tokens as between 500 and 1000, so that short examples,
        # where a small model first finds the facts, are common while long ones still appear.
        low, high = self.config.train_tokens
        tokens = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        return rng, make_example(rng, task, self.train_keys, tokens, errors_fn(rng), self.config, self.counter)

    def disrm_rows(self) -> list[dict]:
        """DisRM preference rows: prompt messages, the consistent response, `num_rejected` inconsistent ones."""
        rows = []
        errors = [0] + [self.config.keys_per_question] * self.config.num_rejected
        num_train = self.config.num_train if self.config.num_train_disrm is None else self.config.num_train_disrm
        for index in range(num_train):
            _, example = self._train_example("disrm", index, lambda rng: errors)
            rows.append(
                {
                    "chat_template": example.prompt_messages,
                    "chosen": example.responses[0],
                    "rejects": example.responses[1:],
                    "task": example.sheet.task,
                    "ctx_tokens": example.tokens,
                }
            )
        return rows

    def _judge_prompt(self, example: JudgingExample, order: list[int], ranking: bool) -> list[dict[str, str]]:
        responses = [example.responses[i] for i in order]
        if ranking:
            return self.template.ranking_messages(example.task_prompt, responses)
        return self.template.pairwise_messages(example.task_prompt, responses)

    def _judge_example(self, dataset: str, index: int):
        rng, example = self._train_example(
            dataset, index, lambda r: _train_errors(r, r.random() < self.config.ranking_fraction, self.config)
        )
        ranking = len(example.responses) > 2
        order = list(range(len(example.responses)))
        rng.shuffle(order)
        return rng, example, order, ranking

    def sft_rows(self) -> list[dict]:
        """Judge SFT rows: the evaluator's judge prompt and the correct judgment as `golden`."""
        rows = []
        for index in range(self.config.num_train):
            rng, example, order, ranking = self._judge_example("sft", index)
            meta = {"task": example.sheet.task, "ctx_tokens": example.tokens}
            if self.config.judge_protocol == "pointwise":
                for shown in order:
                    rows.append(
                        {
                            "chat_template": self.template.pointwise_messages(
                                example.task_prompt, example.responses[shown]
                            ),
                            "golden": pointwise_judgment(example, shown, evidence=self.config.judgment_evidence),
                            **meta,
                        }
                    )
            else:
                prompt = self._judge_prompt(example, order, ranking)
                golden = judgment(example, order, ranking, evidence=self.config.judgment_evidence)
                rows.append({"chat_template": prompt, "golden": golden, **meta})
        return rows

    def grm_rows(self) -> list[dict]:
        """SimPO-GRM rows: the judge prompt, the correct judgment, and `num_rejected` wrong judgments."""
        rows = []
        evidence = self.config.judgment_evidence
        for index in range(self.config.num_train):
            rng, example, order, ranking = self._judge_example("grm", index)
            meta = {"task": example.sheet.task, "ctx_tokens": example.tokens}
            if self.config.judge_protocol == "pointwise":
                num_asked = len(example.asked)
                for shown in order:
                    true_count = num_asked - example.errors[shown]
                    wrong = [count for count in range(num_asked + 1) if count != true_count]
                    rng.shuffle(wrong)
                    claims = [wrong[i % len(wrong)] for i in range(self.config.num_rejected)]
                    rows.append(
                        {
                            "chat_template": self.template.pointwise_messages(
                                example.task_prompt, example.responses[shown]
                            ),
                            "chosen": pointwise_judgment(example, shown, evidence=evidence),
                            "rejects": list(
                                dict.fromkeys(pointwise_judgment(example, shown, c, evidence) for c in claims)
                            ),
                            **meta,
                        }
                    )
            else:
                prompt = self._judge_prompt(example, order, ranking)
                chosen = judgment(example, order, ranking, evidence=evidence)
                wrong = _wrong_rankings(rng, len(order), list(order), self.config.num_rejected)
                rejects = list(dict.fromkeys(judgment(example, order, ranking, claim, evidence) for claim in wrong))
                rows.append({"chat_template": prompt, "chosen": chosen, "rejects": rejects, **meta})
        return rows

    def benchmark_rows(self, task: str) -> list[dict]:
        """Long-RewardBench records of one task: per length bucket, PairWise then BestOfN (2, 3, 4 candidates)."""
        rows = []
        for bucket, tokens in self.config.lengths.items():
            for i in range(self.config.pairwise_per_bucket + self.config.bestofn_per_bucket):
                rng = self._rng("bench", task, bucket, i)
                pairwise = i < self.config.pairwise_per_bucket
                n = 2 if pairwise else 2 + (i - self.config.pairwise_per_bucket) % 3
                errors = [0, self.config.keys_per_question] if pairwise else list(range(n))
                example = make_example(rng, task, self.eval_keys, tokens, errors, self.config, self.counter)
                record = {
                    "id": f"{task.lower()}-{bucket}-{i:03d}",
                    "prompt_template": example.prompt_messages,
                    "tasktype": "PairWise" if pairwise else "BestOfN",
                    "subtype": "same" if pairwise else str(n),
                    "ctx_length_for_length": bucket,
                    "source": f"synthetic_{task.lower()}",
                    "ctx_tokens": example.tokens,
                }
                if pairwise:
                    record.update(chosen=example.responses[0], rejected=example.responses[1])
                else:
                    record["candidates"] = example.responses
                rows.append(record)
        return rows


def _write_jsonl(path: Path, rows: list[dict]):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


@dataclass
class SyntheticSuite:
    """Paths of a written suite. `benchmark` is a directory of `{Task}.jsonl` files (Long-RewardBench layout)."""

    root: Path
    sft: Path
    grm: Path
    disrm: Path
    benchmark: Path
    manifest: Path

    @classmethod
    def at(cls, root: str | Path) -> SyntheticSuite:
        """The paths of the suite written (or to be written) in `root`."""
        root = Path(root)
        return cls(
            root=root,
            sft=root / SFT_FILE,
            grm=root / GRM_FILE,
            disrm=root / DISRM_FILE,
            benchmark=root / BENCHMARK_DIR,
            manifest=root / MANIFEST_FILE,
        )


def _file_of(suite: SyntheticSuite, name: str) -> Path:
    """The file behind a `counts` key of the manifest (`sft`, `grm`, `disrm`, `bench/{Task}`)."""
    if name.startswith("bench/"):
        return suite.benchmark / f"{name.removeprefix('bench/')}.jsonl"
    return {"sft": suite.sft, "grm": suite.grm, "disrm": suite.disrm}[name]


def _clear_earlier_suite(suite: SyntheticSuite, overwrite: bool) -> list[Path]:
    """Delete the files of a suite written earlier into the same folder, as its manifest lists them, so that a re-run
    with other settings (fewer tasks) leaves exactly the files of its own manifest. Where suite files lie there with
    no readable manifest (a foreign folder, an interrupted run), refuse rather than guess which files are ours,
    unless `overwrite` (then all of them go)."""
    try:
        counts = json.loads(suite.manifest.read_text(encoding="utf-8"))["counts"]
        earlier = [_file_of(suite, name) for name in counts]
    except (OSError, ValueError, KeyError, TypeError):
        earlier = None
    if earlier is None:
        found = [path for path in (suite.sft, suite.grm, suite.disrm) if path.exists()]
        found += sorted(suite.benchmark.glob("*.jsonl")) if suite.benchmark.is_dir() else []
        if found and overwrite:
            for path in found:
                path.unlink()
        elif found:
            raise FileExistsError(
                f"{suite.root} already holds suite files ({', '.join(map(str, found[:3]))}"
                f"{', ...' if len(found) > 3 else ''}) but no readable {MANIFEST_FILE} saying which run wrote them; "
                "write into an empty folder, delete them first, or overwrite them (--overwrite, overwrite=True)"
            )
        return found
    suite.manifest.unlink()  # first: an interruption from here on leaves no manifest, so the next run refuses
    for path in earlier:
        path.unlink(missing_ok=True)
    return earlier


def generate_synthetic_suite(
    output_dir: str | Path, config: SyntheticConfig | None = None, tokenizer=None, overwrite: bool = False, **overrides
) -> SyntheticSuite:
    """Write the judge SFT data, SimPO-GRM and DisRM preference data and a held-out mini benchmark into `output_dir`.

    Files: `sft/train.jsonl` (`chat_template` + `golden`), `grm/train.jsonl` and `disrm/train.jsonl`
    (`chat_template` + `chosen` + `rejects`), `bench/{Task}.jsonl` and `manifest.json` (settings and row counts).
    Keyword arguments override fields of `config` (default `SyntheticConfig()`). `tokenizer` measures document
    lengths (default: the tiny test tokenizer of `trl_longrm.testing_utils`). A suite written earlier into
    `output_dir` is replaced (the files its manifest lists are deleted first); suite files there without a manifest
    raise `FileExistsError` unless `overwrite`.

    Example:
    ```python
    >>> from trl_longrm.synthetic import generate_synthetic_suite
    >>> suite = generate_synthetic_suite("/tmp/synthetic", seed=0, num_train=200, lengths={"4k": 300, "8k": 800})
    >>> suite.disrm, suite.benchmark
    ```
    """
    config = SyntheticConfig(**{**asdict(config or SyntheticConfig()), **overrides})
    root = Path(output_dir)
    builder = SuiteBuilder(config, tokenizer)
    suite = SyntheticSuite.at(root)
    if _clear_earlier_suite(suite, overwrite):
        logger.info("Replacing the suite written earlier in %s.", root)
    counts = {}
    for name, path, rows in (
        ("sft", suite.sft, builder.sft_rows()),
        ("grm", suite.grm, builder.grm_rows()),
        ("disrm", suite.disrm, builder.disrm_rows()),
    ):
        if config.length_curriculum:
            rows.sort(key=lambda row: row["ctx_tokens"])  # stable: equal lengths keep generation order
        _write_jsonl(path, rows)
        counts[name] = len(rows)
    for task in config.tasks:
        rows = builder.benchmark_rows(task)
        _write_jsonl(suite.benchmark / f"{task}.jsonl", rows)
        counts[f"bench/{task}"] = len(rows)
    manifest = {"config": asdict(config), "counts": counts}
    suite.manifest.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    logger.info("Wrote the synthetic suite to %s: %s", root, counts)
    return suite
