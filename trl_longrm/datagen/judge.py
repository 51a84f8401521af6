"""`judge`: every response judged pointwise by each of U judges (LongRM section 4.3), on the short context.

A judge sees the record's rubric for its `perspective`, the short context (the critical chunks: never the
distractors), the question, the golden answer and the response (`DataPrompts.judge_messages`), and writes
`[Analysis] ... [Score: N]`; a judgment without a readable score scores -1. Output: each record with `judgments`,
one list per response (in `responses` order) of `{judge, text, score}` in the order of `judges`.

Every answer is cached as it arrives (`<output>.cache.jsonl`, keyed by the judge, its prompt and its sampling), so a
rerun, after a crash or a killed server, asks no judge again for what it has answered. A judge whose first
`max_unparsable` answers all lack a score stops the step with one message naming it (its answers stay cached).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trl_longrm.data.errors import RunConfigError
from trl_longrm.datagen.consensus import UNPARSABLE
from trl_longrm.datagen.models import Answer, build_chat_model
from trl_longrm.datagen.prompts import DataPrompts
from trl_longrm.datagen.records import RecordSource, ResumableWriter
from trl_longrm.datagen.steps import model_specs, request_seed, rounds
from trl_longrm.datagen.summary import StepStats
from trl_longrm.serving.sampling import Sampling


logger = logging.getLogger(__name__)

CACHE_SUFFIX = ".cache.jsonl"


@dataclass
class JudgeConfig:
    """Settings of `judge` (each field is a `--kebab-case` flag of `trl-longrm data judge`; `judges` takes one YAML
    mapping per judge).

    Example:
    ```python
    >>> config = JudgeConfig(input="responses.jsonl", output="judged.jsonl", judges=[
    ...     {"name": "judge-a", "backend": "chat", "base_url": "https://api.a.example/v1", "api_key_env": "A_KEY"},
    ...     {"name": "judge-b", "backend": "vllm", "model": "./Qwen2.5-72B-Instruct"}])
    >>> summary = judge(config)
    ```
    """

    input: str = field(metadata={"help": "Records of `respond` (`responses`, `short_context`, `question`, `answer`)."})
    output: str = field(metadata={"help": "Output JSON Lines file (resumable)."})
    judges: list = field(
        default_factory=list,
        metadata={
            "help": "The judges, in their priority order for `vote`: mappings of `ModelSpec` (name, backend, ...)."
        },
    )
    max_new_tokens: int = field(default=1024, metadata={"help": "Most tokens of a judgment. Default 1024."})
    temperature: float = field(default=0.0, metadata={"help": "Sampling temperature (0: greedy). Default 0."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling's mass. Default 1.0."})
    seed: int = field(default=0, metadata={"help": "Seed of sampled judgments (temperature > 0). Default 0."})
    prompts: str | None = field(default=None, metadata={"help": "Prompts file (default: templates/longrm.yaml)."})
    cache: str | None = field(default=None, metadata={"help": "Answer cache. Default `<output>.cache.jsonl`."})
    max_unparsable: int = field(
        default=20,
        metadata={"help": "Stop when a judge's first this many answers all lack a `[Score: N]`. Default 20."},
    )
    batch_size: int = field(
        default=8,
        metadata={"help": "Records whose requests go out together (then their rows are written). Default 8."},
    )

    def __post_init__(self):
        self.judges = model_specs(self.judges, "judge: judges")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.max_unparsable < 1:
            raise RunConfigError("judge: `max_new_tokens`, `batch_size` and `max_unparsable` must be >= 1")
        Sampling(temperature=self.temperature, top_p=self.top_p)
        if self.cache is None:
            self.cache = self.output + CACHE_SUFFIX


class AnswerCache:
    """Answers keyed by what was asked, read from and appended to a JSON Lines file (a torn last line dropped)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.answers: dict[str, Answer] = {}
        if self.path.exists():
            data = self.path.read_bytes()
            complete, torn = data.rsplit(b"\n", 1) if b"\n" in data else (b"", data)
            if torn.strip():
                with self.path.open("r+b") as handle:
                    handle.truncate(len(data) - len(torn))
            for line in complete.split(b"\n"):
                if line.strip():
                    entry = json.loads(line)
                    self.answers[entry["key"]] = Answer(
                        entry["text"], entry.get("prompt_tokens"), entry.get("generated_tokens")
                    )
        self._handle = self.path.open("a", encoding="utf-8")
        self.lock = threading.Lock()  # judges on servers answer in threads of their own

    @staticmethod
    def key(*parts) -> str:
        return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    def add(self, key: str, answer: Answer) -> None:
        entry = {"key": key, "text": answer.text, "prompt_tokens": answer.prompt_tokens,
                 "generated_tokens": answer.generated_tokens}  # fmt: skip
        with self.lock:
            self._handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
            self._handle.flush()
            self.answers[key] = answer

    def close(self) -> None:
        self._handle.close()


class ScoreWatch:
    """Stops a step whose judge writes no score: the first `limit` answers of each judge are watched."""

    def __init__(self, limit: int, cache: Path, max_new_tokens: int, score_format):
        self.limit, self.cache, self.max_new_tokens = limit, cache, max_new_tokens
        self.score_format = score_format
        self.seen: dict[str, int] = {}
        self.parsed: dict[str, int] = {}

    def check(self, judge: str, text: str, score: int) -> None:
        self.seen[judge] = self.seen.get(judge, 0) + 1
        self.parsed[judge] = self.parsed.get(judge, 0) + (score != UNPARSABLE)
        if self.seen[judge] == self.limit and self.parsed[judge] == 0:
            raise RunConfigError(
                f"judge {judge!r} wrote no `{self.score_format.name}` (N from {self.score_format.scale[0]} to "
                f"{self.score_format.scale[1]}) in its first {self.limit} answers; the last "
                f"one was {text[-300:]!r}. Check its prompts (`prompts`) and `max_new_tokens` ({self.max_new_tokens}); "
                f"its answers are kept in {self.cache}, so a rerun asks again only what changed."
            )


def judge(config: JudgeConfig) -> dict:
    """Run `judge` on every record of `config.input` not in `config.output` yet; returns the summary."""
    source = RecordSource(config.input, required=("id", "responses", "short_context", "question", "answer"))
    total = source.check()
    prompts = DataPrompts.from_yaml(config.prompts)
    for where, record in source:  # every perspective has its rubric, before any judge is asked
        perspective = record.get("perspective") or "faithfulness"
        if perspective not in prompts.perspectives:
            raise where.error(
                f"perspective {perspective!r} has no rubric in {prompts.source} ({prompts.perspectives})",
                key="perspective",
            )
        prompts.check_record("judge", where, record)
        responses = record["responses"]
        if not isinstance(responses, list) or not all(
            isinstance(r, dict) and isinstance(r.get("text"), str) for r in responses
        ):
            raise where.error("must be a list of responses, each a mapping with its `text`", key="responses")
    # Not what only paces or watches the step: the batch size, the cache, `max_unparsable`.
    identity = {
        key: value
        for key, value in asdict(config).items()
        if key not in ("output", "batch_size", "cache", "max_unparsable")
    }
    identity["judges"] = [spec.identity() for spec in config.judges]
    cache = AnswerCache(config.cache)
    watch = ScoreWatch(config.max_unparsable, cache.path, config.max_new_tokens, prompts.score_format)
    try:
        with (
            ResumableWriter(config.output, identity) as writer,
            StepStats("judge", config.output, total, resumed=len(writer.done)) as stats,
        ):
            judges = None
            for batch in rounds(source, writer.done, config.batch_size):
                judges = judges or [build_chat_model(spec) for spec in config.judges]
                results = _judge_round(batch, judges, config, prompts, cache, stats, watch)
                for _, rid, record in batch:
                    writer.write({**record, "judgments": results[rid]})
                    stats.written += 1
                    stats.advance()
            stats.extra["judgments_without_score"] = {
                name: watch.seen.get(name, 0) - watch.parsed.get(name, 0) for name in (s.name for s in config.judges)
            }
            return stats.finish()
    finally:
        cache.close()


def _judge_round(batch, judges, config, prompts, cache, stats, watch) -> dict[str, list[list[dict]]]:
    """The judgments of a round's records: each judge asked what the cache lacks (remote judges at the same time)."""
    # Requests of one record share its prompt's prefix (rubric, short context, question, answer): asked together.
    asks = []  # (rid, response index, messages)
    for _, rid, record in batch:
        perspective = record.get("perspective") or "faithfulness"
        for index, response in enumerate(record["responses"]):
            messages = prompts.judge_messages(
                perspective, record["short_context"], record["question"], record["answer"], response["text"], record
            )
            asks.append((rid, index, response.get("id", index), messages))

    def run(model) -> list[Answer]:
        keys, samplings = [], []
        for rid, _, response_id, messages in asks:
            sampling = Sampling(temperature=config.temperature, top_p=config.top_p,
                                seed=request_seed(config.seed, rid, response_id, model.name))  # fmt: skip
            keys.append(cache.key(model.spec.identity(), messages, config.max_new_tokens, sampling.temperature,
                                  sampling.top_p, sampling.seed if not sampling.greedy else None))  # fmt: skip
            samplings.append(sampling)
        todo = [i for i, key in enumerate(keys) if key not in cache.answers]

        def keep(i, group):
            cache.add(keys[i], group[0])
            with cache.lock:
                stats.count_answers(group[:1])

        if todo and model.spec.backend in ("transformers", "vllm"):
            # One batch: the engine's own batching (vLLM's continuous batching, its prefix cache) is the speed.
            fresh = model.answer([asks[i][3] for i in todo], config.max_new_tokens, [samplings[i] for i in todo])
            for i, group in zip(todo, fresh, strict=True):
                keep(i, group)
        elif todo:
            # A server's (or a function's) answers one by one, each cached as it arrives: a crash or a killed server
            # loses none of those already given. At most `max_concurrency` in flight.
            def one(i):
                keep(i, model.answer([asks[i][3]], config.max_new_tokens, [samplings[i]])[0])

            workers = model.spec.max_concurrency if model.remote else 1
            with ThreadPoolExecutor(max_workers=min(workers, len(todo))) as pool:
                list(pool.map(one, todo))
        with cache.lock:
            stats.cached += len(keys) - len(todo)
        return [cache.answers[key] for key in keys]

    remote = [model for model in judges if model.remote]
    answers = {}
    if len(remote) > 1:
        with ThreadPoolExecutor(max_workers=len(remote)) as pool:
            answers.update(zip((m.name for m in remote), pool.map(run, remote)))
    for model in judges:
        if model.name not in answers:
            answers[model.name] = run(model)
    results = {rid: [[] for _ in record["responses"]] for _, rid, record in batch}
    for position, (rid, index, _, _) in enumerate(asks):
        for model in judges:
            text = answers[model.name][position].text
            score = prompts.parse_score(text)
            watch.check(model.name, text, score)
            results[rid][index].append({"judge": model.name, "text": text, "score": score})
    return results
