"""`trl-longrm score`: score the completions of each row of a JSONL file with a trained reward model.

In: rows with a `prompt` (text, or a list of chat messages) and `completions` (a list of texts, or of message lists);
other keys are kept. Out: the same rows, in input order, with `scores` (one per completion; higher is better) and, for
a generative judge, `judgments` (its text for each completion). A DisRM scores each completion as the DisRM trainers
and `trl-longrm eval` do (`trl_longrm.data.scoring_ids`: the conversation as the chat template renders it, read at its
last token); a generative judge judges each completion pointwise (`[[N]]`; the expected score under the score-token
probabilities).

Resumable: finished rows are appended to `<output>.parts/rank<N>.jsonl` as they are scored (kept afterwards, with the
run's settings and the input's hash); the same command skips them, and the output file is written (whole,
atomically) once every row is scored. Under `--num-processes N` the rows
still to score are dealt out over the processes. Every bad row is reported by file, line and key before any model
loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch


logger = logging.getLogger(__name__)

PARTS_SUFFIX = ".parts"
RUN_FILE = "run.json"


class ScoreInputError(ValueError):
    """Bad rows in the input file: every problem, each with its file, line and key."""


@dataclass
class ScoreConfig:
    """Settings of `score` (and of `trl-longrm score`).

    Example:
    ```python
    >>> rows = score(ScoreConfig(model_path="./my_disrm", data_path="in.jsonl", output="out.jsonl"))
    >>> rows[0]["scores"]
    ```
    """

    model_path: str = field(metadata={"help": "The reward model: a DisRM (sequence classifier) or a generative judge."})
    data_path: str = field(metadata={"help": "JSONL file of rows with `prompt` and `completions`."})
    output: str = field(metadata={"help": "JSONL file to write: the rows with `scores` (and `judgments`)."})
    is_disrm: bool | None = field(
        default=None,
        metadata={"help": "Whether the model is a DisRM; None reads it from the checkpoint's architecture."},
    )
    batch_size: int = field(default=4, metadata={"help": "Rows scored per call of the model."})
    max_length: int = field(
        default=131072, metadata={"help": "Longer inputs keep their head and tail (as `trl-longrm eval`)."}
    )
    max_new_tokens: int = field(default=1024, metadata={"help": "Generative judge: tokens of each judgment."})
    device: str | None = field(default=None, metadata={"help": "Device; default: the process's accelerator."})
    dtype: str = field(default="auto", metadata={"help": "Weights dtype ('auto': as saved)."})
    shared_prefix: bool = field(
        default=True, metadata={"help": "DisRM: encode each prompt once for all of its completions."}
    )
    prompt_template: str | None = field(
        default=None, metadata={"help": "Generative judge: YAML prompt template (default: the built-in one)."}
    )


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a scoring input file, checked: raises `ScoreInputError` listing every bad row (file, line, key)."""
    path = Path(path)
    if not path.is_file():
        raise ScoreInputError(f"{path}: no such file.")
    rows, problems = [], []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                problems.append(f"{where}: not valid JSON ({error.msg}).")
                continue
            if not isinstance(row, dict):
                problems.append(f"{where}: a row must be a JSON object, got {type(row).__name__}.")
                continue
            prompt, completions = row.get("prompt"), row.get("completions")
            if "prompt" not in row:
                problems.append(f"{where}: key `prompt` is missing.")
            elif not (isinstance(prompt, str) or (_is_messages(prompt) and prompt)):
                problems.append(f"{where}: key `prompt` must be a text or a list of {{role, content}} messages.")
            if "completions" not in row:
                problems.append(f"{where}: key `completions` is missing.")
            elif not isinstance(completions, list) or not completions:
                problems.append(f"{where}: key `completions` must be a non-empty list.")
            elif not all(isinstance(c, str) or (_is_messages(c) and c) for c in completions):
                problems.append(f"{where}: key `completions` must hold texts or lists of {{role, content}} messages.")
            elif isinstance(prompt, str) and not all(isinstance(c, str) for c in completions):
                problems.append(f"{where}: key `completions`: message completions need a `prompt` of messages.")
            if "scores" in row or "judgments" in row:
                problems.append(f"{where}: key `scores` / `judgments` is written by `score`; remove it from the input.")
            rows.append({**row, "_line": number})
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more."] if len(problems) > 20 else [])
        raise ScoreInputError("bad rows in the scoring input:\n  " + "\n  ".join(shown))
    if not rows:
        raise ScoreInputError(f"{path}: no rows.")
    return rows


def _text(value) -> str:
    """A prompt or completion as plain text for a generative judge's template (messages' contents, in order)."""
    return value if isinstance(value, str) else "\n\n".join(message["content"] for message in value)


def _detect_disrm(model_path: str) -> bool:
    from transformers import AutoConfig

    architectures = AutoConfig.from_pretrained(model_path).architectures or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)


def _request(row: dict, is_disrm: bool):
    from trl_longrm.evaluation.judges import JudgeRequest

    prompt, completions = row["prompt"], row["completions"]
    if is_disrm:
        # The DisRM scores the conversation: a message completion is rendered whole, a text one as the reply.
        return JudgeRequest(str(row["_line"]), prompt, _text(prompt), completions, ranking=False)
    return JudgeRequest(str(row["_line"]), [], _text(prompt), [_text(c) for c in completions], ranking=False)


def _load_done(parts: Path) -> dict[int, dict]:
    done = {}
    for shard in sorted(parts.glob("rank*.jsonl")):
        data = shard.read_bytes()
        complete, torn = data.rsplit(b"\n", 1) if b"\n" in data else (b"", data)
        if torn:  # a line being written when the run stopped
            with shard.open("r+b") as handle:
                handle.truncate(len(data) - len(torn))
        for line in complete.split(b"\n"):
            if line.strip():
                result = json.loads(line)
                done[result["line"]] = result
    return done


def score(config: ScoreConfig, judge=None) -> list[dict]:
    """Score every row of `config.data_path` not scored yet, write `config.output`, and return the scored rows.

    `judge` defaults to the model at `config.model_path` (`DiscriminativeJudge` or a pointwise `GenerativeJudge`).
    """
    from accelerate import PartialState
    from tqdm.auto import tqdm

    from trl_longrm.evaluation.judges import load_judge
    from trl_longrm.evaluation.templates import PromptTemplate

    rows = read_rows(config.data_path)  # before any model loads
    on_cpu = config.device == "cpu" or (config.device is None and not torch.cuda.is_available())
    state = PartialState(cpu=on_cpu)
    output = Path(config.output)
    parts = output.with_name(output.name + PARTS_SUFFIX)
    digest = hashlib.sha256(Path(config.data_path).read_bytes()).hexdigest()
    identity = {"model_path": str(config.model_path), "data_sha256": digest, "rows": len(rows),
                "is_disrm": config.is_disrm, "max_length": config.max_length,
                "prompt_template": config.prompt_template}  # fmt: skip
    run_file = parts / RUN_FILE
    if run_file.exists():
        earlier = json.loads(run_file.read_text())
        if earlier != identity:
            changed = sorted(k for k in identity if identity[k] != earlier.get(k))
            raise ScoreInputError(
                f"{parts} holds a scoring run with other settings ({', '.join(changed)}); delete it to start afresh, "
                "or run the same command to resume it."
            )
    state.wait_for_everyone()
    if state.is_main_process:
        parts.mkdir(parents=True, exist_ok=True)
        tmp = run_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(identity))
        os.replace(tmp, run_file)
    state.wait_for_everyone()
    done = _load_done(parts)
    todo = [row for row in rows if row["_line"] not in done]
    if done and state.is_main_process:
        logger.info("Resuming: %d of %d rows already scored in %s.", len(rows) - len(todo), len(rows), parts)
    mine = todo[state.process_index :: state.num_processes]
    is_disrm = config.is_disrm if config.is_disrm is not None else _detect_disrm(config.model_path)
    if judge is None and mine:
        device = config.device if config.device is not None or state.num_processes == 1 else str(state.device)
        template = PromptTemplate.from_yaml(config.prompt_template) if config.prompt_template else None
        judge = load_judge(
            config.model_path, is_disrm=is_disrm, max_length=config.max_length,
            max_new_tokens=config.max_new_tokens, batch_size=config.batch_size, device=device, dtype=config.dtype,
            judge_protocol="pointwise", shared_prefix=config.shared_prefix,
            **({"template": template} if template is not None else {}),
        )  # fmt: skip
    shard = parts / f"rank{state.process_index}.jsonl"
    with tqdm(total=len(mine), desc="Scoring", unit="row", disable=not state.is_main_process) as bar:
        for start in range(0, len(mine), config.batch_size):
            batch = mine[start : start + config.batch_size]
            outputs = judge.judge([_request(row, is_disrm) for row in batch])
            with shard.open("a", encoding="utf-8") as handle:
                for row, out in zip(batch, outputs, strict=True):
                    result = {"line": row["_line"], "scores": out.scores, "truncated": out.truncated}
                    if out.judgments is not None:
                        result["judgments"] = out.judgments
                    handle.write(json.dumps(result, ensure_ascii=False) + "\n")
                    handle.flush()
            bar.update(len(batch))
    state.wait_for_everyone()
    done = _load_done(parts)
    scored = []
    for row in rows:
        result = done[row["_line"]]
        out = {key: value for key, value in row.items() if key != "_line"}
        out["scores"] = result["scores"]
        if "judgments" in result:
            out["judgments"] = result["judgments"]
        scored.append(out)
    if state.is_main_process:
        tmp = output.with_name(output.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as handle:
            for row in scored:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, output)
        truncated = sum(bool(done[row["_line"]].get("truncated")) for row in rows)
        if truncated:
            logger.warning("%d rows had inputs cut to head + tail (over %d tokens).", truncated, config.max_length)
    state.wait_for_everyone()
    return scored

