"""Running a judge over Long-RewardBench, resumably, and computing the results from `predictions.jsonl`."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from trl_longrm.evaluation.benchmark import BenchmarkRecord, load_benchmark, load_preference_records
from trl_longrm.evaluation.config import EvalConfig
from trl_longrm.evaluation.judges import Judge, JudgeOutput, JudgeRequest, load_judge
from trl_longrm.evaluation.metrics import compute_metrics, score_ranking
from trl_longrm.evaluation.prompts import (
    parse_pairwise_verdict,
    parse_pointwise_score,
    parse_ranking_verdict,
    ranks_from_scores,
    shuffled_order,
)
from trl_longrm.evaluation.report import write_reports


logger = logging.getLogger(__name__)

PREDICTIONS_FILE = "predictions.jsonl"
RUN_FILE = "run_config.json"


class PredictionStore:
    """Append-only `predictions.jsonl`, one JSON object per judged record, flushed line by line.

    `load()` reads the finished records; a torn last line (a run killed mid-write) is cut off the file so that the
    next append starts on a clean line. Any other unreadable line is an error naming the file and line.

    Example:
    ```python
    >>> store = PredictionStore("results/my_model/predictions.jsonl")
    >>> done = store.load()  # {record id: prediction}
    >>> store.append({"id": "LongQA/q-1", ...})
    ```
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self) -> dict[str, dict]:
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        # Everything after the last newline is a line that was still being written.
        complete, torn = lines[:-1], lines[-1]
        if torn:
            logger.warning("%s: dropping a torn last line of %d bytes (an interrupted write).", self.path, len(torn))
            with self.path.open("r+b") as handle:
                handle.truncate(len(data) - len(torn))
        predictions = {}
        for number, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                prediction = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{self.path}, line {number}: not valid JSON ({error}).") from error
            if "id" not in prediction:
                raise ValueError(f"{self.path}, line {number}: key `id` is missing.")
            if prediction["id"] in predictions:
                raise ValueError(f"{self.path}, line {number}: key `id` repeats record {prediction['id']!r}.")
            predictions[prediction["id"]] = prediction
        return predictions

    def append(self, predictions: Sequence[dict]):
        with self.path.open("a", encoding="utf-8") as handle:
            for prediction in predictions:
                handle.write(json.dumps(prediction, ensure_ascii=False) + "\n")
                handle.flush()


def make_request(record: BenchmarkRecord, seed: int) -> tuple[JudgeRequest, list[int]]:
    """The judge request of a record, with its candidates in the record's shuffled order, and that order."""
    order = shuffled_order(seed, record.id, len(record.candidates))
    request = JudgeRequest(
        record_id=record.id,
        prompt_messages=record.prompt_messages,
        task_prompt=record.task_prompt,
        responses=[record.candidates[i] for i in order],
        ranking=record.tasktype == "BestOfN",
    )
    return request, order


def make_prediction(record: BenchmarkRecord, order: list[int], output: JudgeOutput) -> dict:
    """The `predictions.jsonl` line of a judged record: what was shown, what the judge said, and whether it was right."""
    n = len(order)
    scores = output.scores
    if output.judgments is not None:
        # Pointwise judge: unparseable unless every judgment ends with a score; ranked by its scores (expected scores
        # when the judge read them, else the parsed ones).
        if len(output.judgments) != n:
            raise ValueError(
                f"Judge returned {len(output.judgments)} judgments for record {record.id!r} with {n} candidates."
            )
        parsed = [parse_pointwise_score(text) for text in output.judgments]
        if scores is None and None not in parsed:
            scores = parsed
        predicted = None if None in parsed else ranks_from_scores(scores)
    elif output.scores is not None:
        if len(output.scores) != n:
            raise ValueError(
                f"Judge returned {len(output.scores)} scores for record {record.id!r} with {n} candidates."
            )
        predicted = ranks_from_scores(output.scores)
    elif output.text is not None:
        predicted = (
            parse_ranking_verdict(output.text, n)
            if record.tasktype == "BestOfN"
            else parse_pairwise_verdict(output.text)
        )
    else:
        raise ValueError(f"Judge returned neither text nor scores for record {record.id!r}.")
    ratio, exact = score_ranking(order, predicted)
    return {
        "id": record.id,
        "task": record.task,
        "tasktype": record.tasktype,
        "subtype": record.subtype,
        "length": record.length,
        "source": record.source,
        "order": order,
        "output": output.text,
        "scores": scores,
        "verdict_probs": output.verdict_probs,
        "judgments": output.judgments,
        "predicted_ranks": predicted,
        "parsed": predicted is not None,
        "match_ratio": ratio,
        "correct": exact,
        "truncated": output.truncated,
    }


def load_records(config: EvalConfig) -> list[BenchmarkRecord]:
    """The records to evaluate: Long-RewardBench task files, or the PairWise records of a preference dataset."""
    if config.resolved_data_format() == "long_rewardbench":
        records = load_benchmark(config.data_path, config.tasks, config.formats)
    elif "PairWise" not in config.formats:
        raise ValueError(f"A preference dataset only has PairWise records, but formats={config.formats}.")
    else:
        records = load_preference_records(config.data_path, split=config.split)
    if not records:
        raise ValueError(
            f"No records to evaluate in {config.data_path} for tasks {config.tasks}, formats {config.formats}."
        )
    return records


def _run_identity(config: EvalConfig, model_type: str) -> dict:
    """Settings that change predictions: a resumed run must share them with the run that wrote the file."""
    return {
        "model_path": os.path.abspath(config.model_path),
        "model_type": model_type,
        "data_path": os.path.abspath(config.data_path),
        "seed": config.seed,
        "max_length": config.max_length,
        "max_new_tokens": config.max_new_tokens if model_type == "GRM" else None,
        "verdict_probs": config.verdict_probs if model_type == "GRM" else None,
        "dtype": config.dtype,
        # Only when not the default, so that runs written before the option existed still resume.
        **(
            {"judge_protocol": config.judge_protocol}
            if model_type == "GRM" and config.judge_protocol != "pairwise"
            else {}
        ),
    }


def _check_run_identity(save_path: Path, identity: dict):
    path = save_path / RUN_FILE
    if path.exists():
        previous = json.loads(path.read_text(encoding="utf-8"))
        keys = list(identity) + [k for k in previous if k not in identity]
        changed = {k: (previous.get(k), identity.get(k)) for k in keys if previous.get(k) != identity.get(k)}
        if changed:
            details = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise ValueError(
                f"{save_path} holds predictions of a different run ({details}); use another --save-path or delete it."
            )
    else:
        path.write_text(json.dumps(identity, indent=2) + "\n", encoding="utf-8")


def evaluate_reward_model(config: EvalConfig, judge: Judge | None = None) -> dict:
    """Judge every selected record not yet in `predictions.jsonl`, then compute and write the results.

    `judge` defaults to the model at `config.model_path` (`GenerativeJudge`, or `DiscriminativeJudge` with
    `is_disrm`); pass any `Judge` to plug in another one. Metrics are computed from `predictions.jsonl`, so a resumed
    run reports exactly what an uninterrupted one would.

    Example:
    ```python
    >>> from trl_longrm.evaluation import EvalConfig, evaluate_reward_model
    >>> results = evaluate_reward_model(EvalConfig(model_path="./my_disrm", data_path="./bench", is_disrm=True))
    >>> results["tasks"]["LongQA"], results["auc"]
    ```
    """
    records = load_records(config)
    save_path = Path(config.save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    store = PredictionStore(save_path / PREDICTIONS_FILE)
    done = store.load()
    todo = [record for record in records if record.id not in done]
    if done:
        logger.info(
            "Resuming: %d of %d records already judged in %s.", len(records) - len(todo), len(records), store.path
        )

    if judge is None:
        if todo:
            judge = load_judge(
                config.model_path,
                is_disrm=config.is_disrm,
                max_length=config.max_length,
                max_new_tokens=config.max_new_tokens,
                batch_size=config.batch_size,
                device=config.device,
                dtype=config.dtype,
                verdict_probs=config.verdict_probs,
                judge_protocol=config.judge_protocol,
                shared_prefix=config.shared_prefix,
            )
        model_type = "DisRM" if config.is_disrm else "GRM"
    else:
        model_type = judge.model_type
    _check_run_identity(save_path, _run_identity(config, model_type))

    with tqdm(total=len(records), initial=len(records) - len(todo), desc="Long-RewardBench", unit="record") as bar:
        for start in range(0, len(todo), config.batch_size):
            batch = todo[start : start + config.batch_size]
            requests, orders = zip(*(make_request(record, config.seed) for record in batch))
            outputs = judge.judge(list(requests))
            if len(outputs) != len(batch):
                raise ValueError(f"Judge returned {len(outputs)} outputs for a batch of {len(batch)} requests.")
            store.append([make_prediction(r, o, out) for r, o, out in zip(batch, orders, outputs)])
            bar.update(len(batch))

    done = store.load()
    predictions = [done[record.id] for record in records]
    tasks = list(dict.fromkeys(record.task for record in records))
    results = compute_metrics(predictions, tasks)
    results = {"model": config.model_path, "model_type": model_type, **results, "config": asdict(config)}
    if results["unparseable"]["total"]:
        logger.warning(
            "%d of %d verdicts could not be parsed and count as wrong.",
            results["unparseable"]["total"],
            len(predictions),
        )
    if results["truncated"]:
        logger.warning(
            "%d records had inputs over %d tokens, cut to head + tail.", results["truncated"], config.max_length
        )
    write_reports(results, save_path)
    return results
