"""Reading Long-RewardBench: one `{Task}.jsonl` per task, each line a PairWise or BestOfN record."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl_longrm.data.errors import DataFormatError
from trl_longrm.evaluation.config import FORMATS


logger = logging.getLogger(__name__)

_COMMON_KEYS = ("prompt_template", "tasktype", "subtype", "ctx_length_for_length")
_FORMAT_KEYS = {"PairWise": ("chosen", "rejected"), "BestOfN": ("candidates",)}


@dataclass
class BenchmarkRecord:
    """One benchmark item, with its candidates stored best first (`chosen, rejected` for a PairWise record).

    Example:
    ```python
    >>> record = BenchmarkRecord(
    ...     id="LongQA/0", task="LongQA", tasktype="PairWise", subtype="same", length="4k",
    ...     prompt_messages=[{"role": "user", "content": "Q?"}], candidates=["good", "bad"],
    ... )
    >>> record.task_prompt
    'Q?'
    ```
    """

    id: str
    task: str
    tasktype: str | None
    """'PairWise' or 'BestOfN'; None for a record without one (kept under LongRM's protocol only, judged as a pair)."""
    subtype: str | None
    length: str | None
    prompt_messages: list[dict[str, str]]
    candidates: list[str]
    source: str | None = None
    line: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def task_prompt(self) -> str:
        """The task prompt shown to a generative judge: the message contents joined by a blank line (as LongRM)."""
        return task_text(self.prompt_messages)


def task_text(messages: list[dict[str, str]]) -> str:
    """The task text a generative judge is shown for prompt messages: their contents joined by a blank line (as
    LongRM). The one definition, for the evaluation's records and the RL rewards (`trl_longrm.rewards.judge`).

    Example:
    ```python
    >>> task_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"}])
    'Be brief.\\n\\nQ?'
    ```
    """
    return "\n\n".join(message["content"] or "" for message in messages)


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a JSON Lines file with their 1-based numbers (`trl_longrm.data.sources.text_lines`: a
    line that is not UTF-8 text is a `DataFormatError` naming the file and line)."""
    from trl_longrm.data.sources import text_lines

    return ((number, text) for number, text in text_lines(path) if text.strip())


def _fail(path: Path, line: int, key: str, reason: str):
    raise DataFormatError(f"{path}, line {line}: key `{key}` {reason}.")


def parse_record(raw: dict[str, Any], task: str, path: Path, line: int, untyped: bool = False) -> BenchmarkRecord:
    """Validate one decoded JSON line and turn it into a `BenchmarkRecord`; errors name the file, line and key.

    With `untyped` (LongRM's protocol), a record without `tasktype` is kept as LongRM's evaluator keeps it (judged as
    a pair of `chosen` and `rejected`, counted in the overall average only) and a null `subtype` stays None."""
    optional = {"tasktype", "subtype"} if untyped else set()
    for key in _COMMON_KEYS:
        if key not in optional and (key not in raw or raw[key] is None):
            keeps = key in ("tasktype", "subtype")
            _fail(path, line, key, "is missing" + (" (`--protocol longrm` keeps such records, as LongRM does)" * keeps))
    tasktype = raw.get("tasktype") or None
    if tasktype is not None and tasktype not in FORMATS:
        _fail(path, line, "tasktype", f"is {tasktype!r}; expected one of {list(FORMATS)}")
    for key in _FORMAT_KEYS[tasktype or "PairWise"]:
        if key not in raw or raw[key] is None:
            _fail(path, line, key, f"is missing (required for a {tasktype} record)")

    messages = raw["prompt_template"]
    if not isinstance(messages, list) or not messages:
        _fail(path, line, "prompt_template", "must be a non-empty list of {role, content} messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) or "role" not in message:
            _fail(path, line, f"prompt_template[{i}]", "must be a message with string `role` and `content`")

    if tasktype in ("PairWise", None):
        for key in ("chosen", "rejected"):
            if not isinstance(raw[key], str):
                _fail(path, line, key, f"must be a string, got {type(raw[key]).__name__}")
        candidates = [raw["chosen"], raw["rejected"]]
    else:
        candidates = raw["candidates"]
        if not isinstance(candidates, list) or len(candidates) < 2 or not all(isinstance(c, str) for c in candidates):
            _fail(path, line, "candidates", "must be a list of at least 2 strings")
        if len(candidates) > 26:
            _fail(path, line, "candidates", "has more than 26 entries (judge labels run from A to Z)")

    length = raw["ctx_length_for_length"]
    record_id = f"{task}/{raw['id']}" if raw.get("id") is not None else f"{task}/L{line}"
    known = set(_COMMON_KEYS) | {"chosen", "rejected", "candidates", "id", "source"}
    return BenchmarkRecord(
        id=record_id,
        task=task,
        tasktype=tasktype,
        subtype=None if raw.get("subtype") is None else str(raw["subtype"]),
        length=str(length),
        prompt_messages=[{"role": m["role"], "content": m["content"]} for m in messages],
        candidates=list(candidates),
        source=raw.get("source"),
        line=line,
        extra={k: v for k, v in raw.items() if k not in known},
    )


def load_task_file(path: str | Path, task: str, untyped: bool = False) -> list[BenchmarkRecord]:
    """Read every record of one task file (line numbers start at 1); `untyped` as in `parse_record`."""
    path = Path(path)
    records = []
    for line_number, text in jsonl_lines(path):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataFormatError(f"{path}, line {line_number}: not valid JSON ({error}).") from None
        if not isinstance(raw, dict):
            raise DataFormatError(f"{path}, line {line_number}: expected a JSON object, got {type(raw).__name__}.")
        records.append(parse_record(raw, task, path, line_number, untyped))
    return records


def find_task_files(data_path: str | Path, tasks: list[str]) -> list[Path]:
    """The `{Task}.jsonl` file of each task, the name matched case-insensitively (`--tasks longqa` finds
    `LongQA.jsonl`); a task without a file is an error naming the tasks the directory has.

    Example:
    ```python
    >>> [p.name for p in find_task_files("./LongReward-Bench", ["longqa", "MATH"])]
    ['LongQA.jsonl', 'Math.jsonl']
    ```
    """
    data_path = Path(data_path)
    if not data_path.is_dir():
        raise FileNotFoundError(f"Benchmark directory {data_path} not found (resolved from {Path.cwd()}).")
    files = {path.stem.lower(): path for path in sorted(data_path.glob("*.jsonl"))}
    missing = [task for task in tasks if task.lower() not in files]
    if missing:
        available = sorted(path.stem for path in files.values())
        raise FileNotFoundError(
            f"No task file {', '.join(f'{task}.jsonl' for task in missing)} in {data_path} (one `{{Task}}.jsonl` per "
            f"task, names matched ignoring case); the directory has the tasks {available}."
        )
    return [files[task.lower()] for task in dict.fromkeys(tasks)]


def load_benchmark(
    data_path: str | Path, tasks: list[str], formats: list[str], untyped: bool = False
) -> list[BenchmarkRecord]:
    """Records of the given tasks and formats, in task order then file order. With `untyped` (LongRM's protocol),
    records without `tasktype` are kept whatever the formats, as LongRM's evaluator keeps them.

    Example:
    ```python
    >>> records = load_benchmark("./LongReward-Bench", tasks=["LongQA", "Math"], formats=["PairWise"])
    ```
    """
    data_path = Path(data_path)
    records, skipped, seen = [], 0, {}
    for path in find_task_files(data_path, tasks):
        task = path.stem
        for record in load_task_file(path, task, untyped):
            if record.tasktype is not None and record.tasktype not in formats:
                skipped += 1
                continue
            if record.id in seen:
                raise DataFormatError(
                    f"{path}, line {record.line}: key `id` duplicates the record on line {seen[record.id]}."
                )
            seen[record.id] = record.line
            records.append(record)
    if skipped:
        logger.info("Skipped %d records whose tasktype is not among the selected formats %s.", skipped, formats)
    return records


def load_preference_records(source, split: str | None = None, name: str | None = None) -> list[BenchmarkRecord]:
    """PairWise records from any preference dataset the data layer reads (`trl_longrm.data.load_preference_dataset`).

    A row with k rejected responses gives k records (`chosen` vs each rejected), with ids `{name}/{row}-{k}`. The
    task is `name` (default: the source's file or folder name); subtype and length bucket are unknown (None), so
    these records count in the PairWise and overall accuracies and the AUC, not in Same/Diff or the length buckets.

    Example:
    ```python
    >>> records = load_preference_records("/path/to/longrm_simpo_sample", split="test")
    ```
    """
    from trl_longrm.data import load_preference_dataset

    dataset = load_preference_dataset(source, split=split)
    name = name or Path(str(source)).stem
    records = []
    for row_index, row in enumerate(dataset):
        template_kwargs = json.loads(row.get("chat_template_kwargs") or "{}")
        if any(value not in (None, [], {}) for value in template_kwargs.values()):
            # The judges render their own prompts (the benchmark's protocol), so a row's template arguments would
            # be dropped: refused rather than evaluated differently from how the row was trained.
            raise DataFormatError(
                f"{source} row {row_index}: the evaluation renders its own judge prompts and cannot pass the row's "
                "`tools` / `chat_template_kwargs` to them; remove those columns to evaluate this data."
            )
        if row.get("completion_messages"):
            raise DataFormatError(
                f"{source} row {row_index}: a response of several messages or with tool calls cannot be placed in the "
                "evaluation's judge prompts, which take one response text; evaluate rows with plain responses."
            )
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        for k, rejected in enumerate(row["rejected"]):
            records.append(
                BenchmarkRecord(
                    id=f"{name}/{row_index}-{k}",
                    task=name,
                    tasktype="PairWise",
                    subtype=None,
                    length=None,
                    prompt_messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                    candidates=[row["chosen"], rejected],
                    source=str(source),
                    line=row_index,
                )
            )
    return records
