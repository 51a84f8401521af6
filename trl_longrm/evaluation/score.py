"""`trl-longrm score`: score the completions of each row of a JSONL file with a trained reward model.

In: rows with a `prompt` (text, or a list of chat messages) and `completions` (a list of texts, or of message lists);
other keys are kept. Out: the same rows, in input order, with `scores` (one per completion; higher is better) and, for
a generative judge, `judgments` (its text for each completion). A DisRM scores each completion as the DisRM trainers
and `trl-longrm eval` do (`trl_longrm.data.scoring_ids`: the conversation as the chat template renders it, read at its
last token); a generative judge judges each completion pointwise (`[[N]]`; the expected score under the score-token
probabilities).

Resumable: finished rows are appended to `<output>.parts/rank<N>.jsonl` as they are scored (kept afterwards, with the
run's settings and the input's hash); the same command skips them, and the output file is written (whole,
atomically) once every row is scored. A command whose settings would score differently (another model, input,
`max_length`, `dtype`, `shared_prefix`, `max_new_tokens` or template) is refused, naming the setting, while the
folder holds scored rows. Under `--num-processes N` the rows still to score are dealt out over the processes. Every
bad row is reported by file, line and key before any model loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from trl_longrm.data.errors import DataFormatError, RunConfigError
from trl_longrm.evaluation.benchmark import jsonl_lines
from trl_longrm.evaluation.config import ScoreConfig  # noqa: F401 - defined beside EvalConfig (no torch: the CLI reads it)


logger = logging.getLogger(__name__)

PARTS_SUFFIX = ".parts"
RUN_FILE = "run.json"


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def read_rows(path: str | Path) -> list[tuple[int, dict]]:
    """The rows of a scoring input file with their 1-based line numbers, checked: raises `DataFormatError` listing
    every bad row (file, line, key). The rows are kept as they are: a line number is no key of its row, so that no
    key of the user's is lost or shadowed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (resolved against {Path.cwd()}).")
    rows, problems = [], []
    for number, line in jsonl_lines(path):
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
        rows.append((number, row))
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more."] if len(problems) > 20 else [])
        raise DataFormatError("bad rows in the scoring input:\n  " + "\n  ".join(shown))
    if not rows:
        raise DataFormatError(f"{path}: no rows.")
    return rows


def _text(value) -> str:
    """A prompt or completion as plain text for a generative judge's template (messages' contents, in order)."""
    return value if isinstance(value, str) else "\n\n".join(message["content"] for message in value)


def _detect_disrm(model_path: str) -> bool:
    from transformers import AutoConfig

    from trl_longrm.evaluation.runner import model_error

    try:
        architectures = AutoConfig.from_pretrained(model_path).architectures or []
    except (OSError, ValueError) as error:
        raise model_error(model_path, error) from None
    return any(name.endswith("ForSequenceClassification") for name in architectures)


def _request(line: int, row: dict, is_disrm: bool):
    from trl_longrm.evaluation.judges import JudgeRequest

    prompt, completions = row["prompt"], row["completions"]
    if is_disrm:
        # The DisRM scores the conversation: a message completion is rendered whole, a text one as the reply.
        return JudgeRequest(str(line), prompt, _text(prompt), completions, ranking=False)
    return JudgeRequest(str(line), [], _text(prompt), [_text(c) for c in completions], ranking=False)


def _shards(parts: Path) -> list[Path]:
    return sorted(parts.glob("rank*.jsonl"))


def _load_done(parts: Path) -> dict[int, dict]:
    done = {}
    for shard in _shards(parts):
        data = shard.read_bytes()
        complete, torn = data.rsplit(b"\n", 1) if b"\n" in data else (b"", data)
        if torn:  # a line being written when the run stopped
            with shard.open("r+b") as handle:
                handle.truncate(len(data) - len(torn))
        for number, line in enumerate(complete.split(b"\n"), start=1):
            if line.strip():
                try:
                    result = json.loads(line)
                    done[result["line"]] = result
                except (ValueError, TypeError, KeyError) as error:  # edited or damaged by hand
                    raise DataFormatError(
                        f"{shard}, line {number}: not a scored row of this tool ({error!r}); delete {parts} to score "
                        "afresh."
                    ) from None
    return done


def _template_digest(template) -> str:
    """Hash of what a pointwise judge is prompted with (the template's pointwise section, as read: a file's own or
    the built-in one it leaves in place), so that an edited template file is a changed setting, a moved one is not."""
    prompt = json.dumps(dataclasses.asdict(template.pointwise), sort_keys=True)
    return hashlib.sha256(prompt.encode()).hexdigest()


def _run_identity(config: ScoreConfig, rows: list, is_disrm: bool, template) -> dict:
    """The settings that change a score: rows scored under other ones must not be mixed into the output.

    Not `batch_size`: every row is scored from its own tokens alone, and the batch size only decides which rows share
    a padded (or, under `shared_prefix`, packed) call of the same computation, which changes nothing but float
    rounding (`test_disrm_scores_rows_in_input_order` compares batched scores with one-at-a-time ones). Which rows
    share a call changes anyway when a run resumes (the rows left are batched afresh) or runs on several processes,
    so pinning the batch size would not pin the rounding; and a run stopped for lack of memory must be able to resume
    with a smaller one. A DisRM does not read the generative settings, nor a generative judge `shared_prefix`: they
    are None where unused.
    """
    return {
        "model_path": os.path.abspath(config.model_path),
        "model_type": "DisRM" if is_disrm else "GRM",
        "data_sha256": hashlib.sha256(Path(config.data_path).read_bytes()).hexdigest(),
        "rows": len(rows),
        "max_length": config.max_length,
        "dtype": config.dtype,
        # The shared-prefix row is attended by another kernel than the padded batch (other float rounding).
        "shared_prefix": config.shared_prefix if is_disrm else None,
        "max_new_tokens": None if is_disrm else config.max_new_tokens,
        "prompt_template": None if is_disrm else _template_digest(template),
    }


def _check_run(parts: Path, identity: dict):
    """Refuse a folder whose scored rows were scored under other settings, naming each changed setting. A folder
    without scored rows binds nothing: a run that stopped before scoring any (a wrong flag, a model that failed to
    load) does not lock its output, and the corrected command starts afresh."""
    run_file = parts / RUN_FILE
    if not run_file.exists() or not any(shard.stat().st_size for shard in _shards(parts)):
        return
    try:
        earlier = json.loads(run_file.read_text(encoding="utf-8"))
    except ValueError as error:
        raise DataFormatError(f"{run_file}: unreadable ({error}); delete {parts} to score afresh.") from None
    changed = [key for key in dict.fromkeys([*identity, *earlier]) if identity.get(key) != earlier.get(key)]
    if changed:
        details = ", ".join(f"{key}: {earlier.get(key)!r} -> {identity.get(key)!r}" for key in changed)
        raise RunConfigError(
            f"{parts} holds rows scored with other settings ({details}); run the command that scored them to "
            "resume, or delete the folder to score afresh."
        )


def score(config: ScoreConfig, judge=None) -> list[dict]:
    """Score every row of `config.data_path` not scored yet, write `config.output`, and return the scored rows.

    `judge` defaults to the model at `config.model_path` (`DiscriminativeJudge` or a pointwise `GenerativeJudge`).
    """
    from accelerate import PartialState
    from tqdm.auto import tqdm

    from trl_longrm.evaluation.runner import load_user_judge
    from trl_longrm.evaluation.templates import PromptTemplate

    # Everything of the user's is read and checked before any model loads: the rows, the model's kind, the template.
    rows = read_rows(config.data_path)
    if judge is not None:
        is_disrm = judge.model_type == "DisRM"
    else:
        is_disrm = config.is_disrm if config.is_disrm is not None else _detect_disrm(config.model_path)
    if is_disrm and config.prompt_template:
        raise RunConfigError(
            f"prompt_template={config.prompt_template!r} is for a generative judge, but {config.model_path} is scored "
            "as a DisRM (which reads no prompt); leave it out, or pass a generative judge."
        )
    if is_disrm:
        template = None
    elif config.prompt_template:
        template = PromptTemplate.from_yaml(config.prompt_template)
    else:
        template = PromptTemplate.default()
    on_cpu = config.device == "cpu" or (config.device is None and not torch.cuda.is_available())
    state = PartialState(cpu=on_cpu)
    output = Path(config.output)
    parts = output.with_name(output.name + PARTS_SUFFIX)
    identity = _run_identity(config, rows, is_disrm, template)
    _check_run(parts, identity)  # by every process: all stop alike, none waits for the others in vain
    state.wait_for_everyone()
    if state.is_main_process:
        parts.mkdir(parents=True, exist_ok=True)
        run_file = parts / RUN_FILE
        tmp = run_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(identity, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, run_file)
    state.wait_for_everyone()
    done = _load_done(parts)
    todo = [(line, row) for line, row in rows if line not in done]
    if done and state.is_main_process:
        logger.info("Resuming: %d of %d rows already scored in %s.", len(rows) - len(todo), len(rows), parts)
    mine = todo[state.process_index :: state.num_processes]
    if judge is None and mine:
        device = config.device if config.device is not None or state.num_processes == 1 else str(state.device)
        judge = load_user_judge(
            config.model_path, is_disrm=is_disrm, max_length=config.max_length,
            max_new_tokens=config.max_new_tokens, batch_size=config.batch_size, device=device, dtype=config.dtype,
            judge_protocol="pointwise", shared_prefix=config.shared_prefix, template=template,
        )  # fmt: skip
    shard = parts / f"rank{state.process_index}.jsonl"
    with tqdm(total=len(mine), desc="Scoring", unit="row", disable=not state.is_main_process) as bar:
        for start in range(0, len(mine), config.batch_size):
            batch = mine[start : start + config.batch_size]
            outputs = judge.judge([_request(line, row, is_disrm) for line, row in batch])
            with shard.open("a", encoding="utf-8") as handle:
                for (line, _), out in zip(batch, outputs, strict=True):
                    result = {"line": line, "scores": out.scores, "truncated": out.truncated}
                    if out.judgments is not None:
                        result["judgments"] = out.judgments
                    handle.write(json.dumps(result, ensure_ascii=False) + "\n")
                    handle.flush()
            bar.update(len(batch))
    state.wait_for_everyone()
    done = _load_done(parts)
    scored = []
    for line, row in rows:
        result = done[line]
        out = dict(row)
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
        truncated = sum(bool(done[line].get("truncated")) for line, _ in rows)
        if truncated:
            logger.warning("%d rows had inputs cut to head + tail (over %d tokens).", truncated, config.max_length)
    state.wait_for_everyone()
    return scored
