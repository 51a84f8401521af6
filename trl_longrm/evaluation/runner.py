"""Running a judge over Long-RewardBench, resumably, and computing the results from `predictions.jsonl`."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from trl_longrm.data.errors import DataFormatError, RunConfigError
from trl_longrm.evaluation.benchmark import BenchmarkRecord, find_task_files, load_benchmark, load_preference_records
from trl_longrm.evaluation.config import FORMATS, EvalConfig
from trl_longrm.evaluation.judges import Judge, JudgeOutput, JudgeRequest, load_judge
from trl_longrm.evaluation.metrics import compute_metrics, score_ranking
from trl_longrm.evaluation.prompts import (
    parse_pairwise_verdict,
    parse_ranking_verdict,
    ranks_from_scores,
    shuffled_order,
)
from trl_longrm.evaluation.protocols import (
    longrm_orders,
    parse_pairwise_longrm,
    parse_ranking_longrm,
    score_ranking_longrm,
)
from trl_longrm.evaluation.report import write_reports
from trl_longrm.evaluation.templates import POINTWISE_FORMATS, PointwiseFormat, PromptTemplate


logger = logging.getLogger(__name__)

PREDICTIONS_FILE = "predictions.jsonl"
# Under several processes each writes its own shard; the main process merges them into PREDICTIONS_FILE.
SHARD_NAME = "predictions.rank{}.jsonl"
SHARD_PATTERN = "predictions.rank*.jsonl"
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
            except ValueError as error:  # not JSON, or not UTF-8 (`UnicodeDecodeError`)
                raise DataFormatError(f"{self.path}, line {number}: not valid JSON ({error}).") from None
            if not isinstance(prediction, dict) or "id" not in prediction:
                raise DataFormatError(f"{self.path}, line {number}: key `id` is missing.")
            if prediction["id"] in predictions:
                raise DataFormatError(f"{self.path}, line {number}: key `id` repeats record {prediction['id']!r}.")
            predictions[prediction["id"]] = prediction
        return predictions

    def append(self, predictions: Sequence[dict]):
        with self.path.open("a", encoding="utf-8") as handle:
            for prediction in predictions:
                handle.write(json.dumps(prediction, ensure_ascii=False) + "\n")
                handle.flush()


def display_orders(records: list[BenchmarkRecord], seed: int, protocol: str = "default") -> dict[str, list[int]]:
    """Display order of every record's candidates (`order[p]`: gold rank of the candidate shown at p), by record id.

    The default protocol draws each record's order from a hash of (seed, record id) alone; the `longrm` protocol
    draws them as LongRM's evaluator does, over each task file's selected records (`longrm_orders`).
    """
    if protocol != "longrm":
        return {record.id: shuffled_order(seed, record.id, len(record.candidates)) for record in records}
    orders = {}
    for task in dict.fromkeys(record.task for record in records):
        orders.update(longrm_orders([record for record in records if record.task == task], seed))
    return orders


def make_request(record: BenchmarkRecord, order: list[int]) -> JudgeRequest:
    """The judge request of a record, with its candidates shown in `order`."""
    return JudgeRequest(
        record_id=record.id,
        prompt_messages=record.prompt_messages,
        task_prompt=record.task_prompt,
        responses=[record.candidates[i] for i in order],
        ranking=record.tasktype == "BestOfN",
    )


def make_prediction(
    record: BenchmarkRecord,
    order: list[int],
    output: JudgeOutput,
    protocol: str = "default",
    score_format: PointwiseFormat = POINTWISE_FORMATS["[[N]]"],
) -> dict:
    """The `predictions.jsonl` line of a judged record: what was shown, what the judge said, and whether it was right.

    A verdict text is parsed by the protocol's rules (`parse_pairwise_verdict` / `parse_ranking_verdict`, or
    LongRM's `parse_pairwise_longrm` / `parse_ranking_longrm`), pointwise judgments by `score_format`; scores rank
    the candidates the same way in both protocols.
    """
    n = len(order)
    scores = output.scores
    if output.judgments is not None:
        # Pointwise judge: unparseable unless every judgment ends with a score; ranked by its scores (expected scores
        # when the judge read them, else the parsed ones).
        if len(output.judgments) != n:
            raise ValueError(
                f"Judge returned {len(output.judgments)} judgments for record {record.id!r} with {n} candidates."
            )
        parsed = [score_format.parse(text) for text in output.judgments]
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
        if protocol == "longrm":
            parse = parse_ranking_longrm if record.tasktype == "BestOfN" else parse_pairwise_longrm
            predicted = parse(output.text)
        elif record.tasktype == "BestOfN":
            predicted = parse_ranking_verdict(output.text, n)
        else:
            predicted = parse_pairwise_verdict(output.text)
    else:
        raise ValueError(f"Judge returned neither text nor scores for record {record.id!r}.")
    ratio, exact = (score_ranking_longrm if protocol == "longrm" else score_ranking)(order, predicted)
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
        # Only where some were bounds (a top-k-only server), so that other predictions read as before.
        **({"bounded_verdict_probs": output.bounded_verdict_probs} if output.bounded_verdict_probs else {}),
    }


def load_records(config: EvalConfig) -> list[BenchmarkRecord]:
    """The records to evaluate: Long-RewardBench task files, or the PairWise records of a preference dataset."""
    if config.resolved_data_format() == "long_rewardbench":
        records = load_benchmark(config.data_path, config.tasks, config.formats, untyped=config.protocol == "longrm")
    elif "PairWise" not in config.formats:
        raise RunConfigError(f"A preference dataset only has PairWise records, but formats={config.formats}.")
    else:
        records = load_preference_records(config.data_path, split=config.split)
    if not records:
        where = config.data_path
        if config.resolved_data_format() == "long_rewardbench":
            where = ", ".join(str(path) for path in find_task_files(config.data_path, config.tasks))
        raise DataFormatError(f"No records to evaluate in {where} (tasks {config.tasks}, formats {config.formats}).")
    return records


def _run_identity(config: EvalConfig, model_type: str, engine: dict | None = None) -> dict:
    """Settings that change predictions: a resumed run must share them with the run that wrote the file. `engine` is
    `engine_identity`'s: what runs the model, for the vllm and openai backends (never the API key)."""
    return {
        "model_path": os.path.abspath(config.model_path),
        "model_type": model_type,
        "data_path": os.path.abspath(config.data_path),
        "seed": config.seed,
        "max_length": config.max_length,
        "max_new_tokens": config.max_new_tokens if model_type == "GRM" else None,
        "verdict_probs": config.verdict_probs if model_type == "GRM" else None,
        "dtype": config.dtype,
        # Only when not the default, so that runs written before the options existed still resume.
        **(
            {"judge_protocol": config.judge_protocol}
            if model_type == "GRM" and config.judge_protocol != "pairwise"
            else {}
        ),
        # LongRM's orders depend on which formats of a task file are evaluated, so its predictions hold only for them.
        **({"protocol": config.protocol, "formats": sorted(config.formats)} if config.protocol != "default" else {}),
        **(
            {"prompt_template": os.path.abspath(config.prompt_template)}
            if model_type == "GRM" and config.prompt_template
            else {}
        ),
        # Absent for transformers, so that runs written before backends existed still resume; otherwise a run resumed
        # on another engine (or vLLM version, or tensor-parallel size) would mix two engines' verdicts in one file.
        **(engine or {}),
    }


def _holds_predictions(save_path: Path) -> bool:
    """Whether `save_path` holds any prediction (merged, or in a process's shard)."""
    files = [save_path / PREDICTIONS_FILE, *save_path.glob(SHARD_PATTERN)]
    return any(path.is_file() and path.stat().st_size > 0 for path in files)


def _check_run_identity(save_path: Path, identity: dict, write: bool = True):
    path = save_path / RUN_FILE
    # Only predictions tie the folder to its settings: a run that stopped before judging anything (a wrong flag, a
    # model that failed to load) left nothing to mix with, so the corrected command starts afresh there.
    if path.exists() and _holds_predictions(save_path):
        previous = json.loads(path.read_text(encoding="utf-8"))
        keys = list(identity) + [k for k in previous if k not in identity]
        changed = {k: (previous.get(k), identity.get(k)) for k in keys if previous.get(k) != identity.get(k)}
        if changed:
            details = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise RunConfigError(
                f"{save_path} holds predictions of a different run ({details}); use another --save-path or delete it."
            )
    elif write:
        # Written whole or not at all: another process of the same run may read it at the same time (a partly
        # written file made a late-starting rank fail its check).
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(identity, indent=2) + "\n", encoding="utf-8")
        os.replace(partial, path)


def _merge_shards(save_path: Path, store: PredictionStore):
    """Move the predictions of every per-process shard into the main store (idempotent, so a merge cut short by a
    kill is finished by the next run), then delete the shard."""
    done = store.load()
    for shard_path in sorted(save_path.glob(SHARD_PATTERN)):
        shard = PredictionStore(shard_path).load()
        store.append([prediction for key, prediction in shard.items() if key not in done])
        done.update(shard)
        shard_path.unlink()


def _results_stem(config: EvalConfig) -> str:
    """`results` when every task file of the benchmark directory and both formats are evaluated, else
    `results.<tasks>.<formats>`: evaluating a subset in a directory that holds a full run adds its own results files
    instead of overwriting the full run's."""
    if config.resolved_data_format() != "long_rewardbench":
        return "results"
    present = {path.stem.lower() for path in Path(config.data_path).glob("*.jsonl")}
    if {task.lower() for task in config.tasks} >= present and sorted(config.formats) == sorted(FORMATS):
        return "results"
    return "results." + "+".join(config.tasks) + "." + "+".join(config.formats)


def model_error(model_path: str, error: Exception) -> RunConfigError:
    """`error`, raised reading the model at `model_path`, as the user's mistake: one message naming the path (for a
    path that is no local folder, where it was looked for)."""
    from trl_longrm.data.sources import looks_local, missing_path_message

    reason = str(error)
    if not Path(model_path).expanduser().exists():
        # Transformers' own message for a local path that is not there speaks of the Hub and repo ids.
        reason = missing_path_message(model_path) + ("" if looks_local(model_path) else f"; as a Hub id: {reason}")
    return RunConfigError(reason if str(model_path) in reason else f"model_path={model_path!r}: {reason}")


def load_user_judge(model_path: str, **kwargs) -> Judge:
    """`load_judge`, where a model that cannot be used as asked (a missing or unreadable folder, a checkpoint of the
    other head than `is_disrm` says, an adapter whose base is not there) is the user's mistake (`model_error`)."""
    try:
        return load_judge(model_path, **kwargs)
    except (OSError, ValueError) as error:
        raise model_error(model_path, error) from None


def _user_import_vllm():
    """vLLM, or the user's mistake of `--backend vllm` where it is not installed."""
    from trl_longrm.serving.vllm_engine import _import_vllm

    try:
        return _import_vllm()
    except ImportError as error:
        raise RunConfigError(str(error)) from None


def _openai_engine(config: EvalConfig, tokenizer=None):
    """The OpenAI-compatible server's engine of `config` (a `/classify` scorer for a DisRM); asks the server which
    models it serves, so a server that is down or does not serve `served_model` is an `EngineError` here."""
    from trl_longrm.serving.openai_engine import OpenAIGenerator, OpenAIScorer

    settings = {"max_concurrency": 8, "timeout": 600.0, "max_retries": 3}
    given = {"max_concurrency": config.max_concurrency, "timeout": config.request_timeout,
             "max_retries": config.max_retries}  # fmt: skip
    settings.update({key: value for key, value in given.items() if value is not None})
    if config.is_disrm:
        return OpenAIScorer(config.base_url, config.served_model, api_key=config.api_key, **settings)
    from trl_longrm.serving.base import greedy_settings

    try:
        # The checkpoint's repetition penalty, sent with each request as the other backends apply it.
        greedy = greedy_settings(config.model_path, "openai")
    except ValueError as error:
        raise RunConfigError(str(error)) from None
    return OpenAIGenerator(config.base_url, config.served_model, api_key=config.api_key, tokenizer=tokenizer,
                           **greedy, **settings)  # fmt: skip


def engine_identity(config: EvalConfig, engine=None) -> dict:
    """What of the engine decides the predictions, for `_run_identity`: nothing for transformers (its settings are
    already there); vLLM's version and tensor-parallel size (the sharding changes the sums' order); a server's served
    model, the checkpoint it loaded and its version. Not the server's address: the same server restarted on another
    port resumes the run. Never the API key."""
    if config.backend == "transformers":
        return {}
    if config.backend == "vllm":
        from trl_longrm.serving.vllm_engine import checked_architecture

        # The checkpoint's head first: a mistake the user can fix whether or not vLLM is installed.
        try:
            checked_architecture(config.model_path, "seq-cls" if config.is_disrm else "causal-lm")
        except (OSError, ValueError) as error:
            raise model_error(config.model_path, error) from None
        version = _user_import_vllm().__version__
        return {"backend": "vllm", "vllm": version, "tensor_parallel_size": config.tensor_parallel_size or 1}
    engine = engine or _openai_engine(config)
    server = engine.server
    models = server.request(f"{server.base_url}/models")["data"]
    root = next((model.get("root") for model in models if model["id"] == engine.model), None)
    try:
        version = server.request(f"{server.root}/version").get("version")
    except Exception:  # not every OpenAI-compatible server has vLLM's `/version`
        version = None
    return {"backend": "openai", "served_model": engine.model, "served_checkpoint": root, "server_version": version}


def build_judge(config: EvalConfig, template: PromptTemplate, device: str | None, engine=None) -> Judge:
    """The judge of `config` on its backend: `load_user_judge` for transformers; else the checkpoint's tokenizer (the
    judge renders, cuts and reads everything with it) and a `VLLMGenerator` / `VLLMScorer` built from `model_path`, or
    an `OpenAIGenerator` / `OpenAIScorer` on `base_url` (`engine`, if already made)."""
    from trl_longrm.evaluation.judges import DiscriminativeJudge, GenerativeJudge, load_tokenizer

    if config.backend == "transformers":
        return load_user_judge(
            config.model_path,
            is_disrm=config.is_disrm,
            max_length=config.max_length,
            max_new_tokens=config.max_new_tokens,
            batch_size=config.batch_size,
            device=device,
            dtype=config.dtype,
            verdict_probs=config.verdict_probs,
            judge_protocol=config.judge_protocol,
            protocol=config.protocol,
            template=template,
            shared_prefix=config.shared_prefix,
        )
    try:
        tokenizer = load_tokenizer(config.model_path)
        if config.backend == "vllm":
            _user_import_vllm()
            from trl_longrm.serving.vllm_engine import VLLMGenerator, VLLMScorer

            # vLLM's context is the evaluation's `max_length`: the judge cuts every input to fit it. Under LongRM's
            # protocol, a generative judge's engine is built as LongRM's evaluator builds it, without `max_model_len`
            # (the model's own length): prompts are cut to max_length - 5 tokens and a judgment gets what the model's
            # length leaves (`GenerativeJudge._budgets`); asking for max_length + max_new_tokens was refused by vLLM
            # on a 128K model (133,120 is above its derived 131,072).
            longrm_judge = config.protocol == "longrm" and not config.is_disrm
            engine = (VLLMScorer if config.is_disrm else VLLMGenerator)(
                config.model_path,
                tensor_parallel_size=config.tensor_parallel_size or 1,
                gpu_memory_utilization=config.gpu_memory_utilization,
                max_model_len=None if longrm_judge else config.max_length,
                dtype=config.dtype,
                enable_prefix_caching=config.enable_prefix_caching is not False,
                seed=config.seed,
            )
        else:
            engine = engine or _openai_engine(config, tokenizer)
            if not config.is_disrm:
                engine.tokenizer = tokenizer  # to read a non-vLLM server's text and top-k token strings
    except (OSError, ValueError) as error:  # a missing checkpoint, the other head than --is-disrm says
        raise model_error(config.model_path, error) from None
    if config.is_disrm:
        return DiscriminativeJudge(
            engine, tokenizer, max_length=config.max_length, batch_size=config.batch_size,
            evaluation_protocol=config.protocol,
        )  # fmt: skip
    return GenerativeJudge(
        engine,
        tokenizer,
        max_length=config.max_length,
        max_new_tokens=config.max_new_tokens,
        verdict_probs=config.verdict_probs,
        protocol=config.judge_protocol,
        template=template,
        evaluation_protocol=config.protocol,
    )


def evaluate_reward_model(config: EvalConfig, judge: Judge | None = None) -> dict:
    """Judge every selected record not yet in `predictions.jsonl`, then compute and write the results.

    `judge` defaults to the model at `config.model_path` (`GenerativeJudge`, or `DiscriminativeJudge` with
    `is_disrm`); pass any `Judge` to plug in another one. Metrics are computed from `predictions.jsonl`, so a resumed
    run reports exactly what an uninterrupted one would.

    Under `accelerate launch` (several processes), the records still to judge are dealt out over the processes; each
    writes its own `predictions.rank<N>.jsonl`, and the main process merges them into `predictions.jsonl` and writes
    the results, which equal a single process's. Every process returns the results.

    Example:
    ```python
    >>> from trl_longrm.evaluation import EvalConfig, evaluate_reward_model
    >>> results = evaluate_reward_model(EvalConfig(model_path="./my_disrm", data_path="./bench", is_disrm=True))
    >>> results["tasks"]["LongQA"], results["auc"]
    ```
    """
    from accelerate import PartialState

    # One process unless started by `accelerate launch`; CPU processes (no GPU, or `device: cpu`) talk over gloo.
    on_cpu = config.device == "cpu" or (config.device is None and not torch.cuda.is_available())
    state = PartialState(cpu=on_cpu)
    # Read and checked before any model loads: a bad template file fails at once.
    template = PromptTemplate.from_yaml(config.prompt_template) if config.prompt_template else PromptTemplate.default()
    records = load_records(config)
    orders = display_orders(records, config.seed, config.protocol)
    save_path = Path(config.save_path)
    store = PredictionStore(save_path / PREDICTIONS_FILE)
    model_type = judge.model_type if judge is not None else ("DisRM" if config.is_disrm else "GRM")
    # Before any engine starts: a server that is down or does not serve the model, or vLLM missing, fails here. The
    # server's engine is kept for the judge (it already asked the server for its models).
    server_engine = _openai_engine(config) if judge is None and config.backend == "openai" else None
    identity = _run_identity(config, model_type, engine_identity(config, server_engine) if judge is None else None)
    # Every process checks (all raise alike, none waits for the others in vain); the main one records and repairs.
    _check_run_identity(save_path, identity, write=False)
    if state.is_main_process:
        save_path.mkdir(parents=True, exist_ok=True)
        _check_run_identity(save_path, identity)
        _merge_shards(save_path, store)
    state.wait_for_everyone()

    done = store.load() if store.path.exists() else {}
    todo = [record for record in records if record.id not in done]
    if done and state.is_main_process:
        logger.info(
            "Resuming: %d of %d records already judged in %s.", len(records) - len(todo), len(records), store.path
        )
    mine = todo[state.process_index :: state.num_processes]
    if state.num_processes > 1:
        logger.info("Process %d of %d judges %d records.", state.process_index, state.num_processes, len(mine))
    own_store = store if state.num_processes == 1 else PredictionStore(save_path / SHARD_NAME.format(state.process_index))
    if judge is None and mine:
        device = config.device if config.device is not None or state.num_processes == 1 else str(state.device)
        # Under several processes each builds its own engine (its own vLLM engine, or its own requests to the server).
        judge = build_judge(config, template, device, server_engine)

    # With several processes, the main process's bar shows its own share of the records.
    with tqdm(total=len(mine), desc="Long-RewardBench", unit="record", disable=not state.is_main_process) as bar:
        for start in range(0, len(mine), config.batch_size):
            batch = mine[start : start + config.batch_size]
            outputs = judge.judge([make_request(record, orders[record.id]) for record in batch])
            if len(outputs) != len(batch):
                raise ValueError(f"Judge returned {len(outputs)} outputs for a batch of {len(batch)} requests.")
            own_store.append(
                [
                    make_prediction(r, orders[r.id], out, config.protocol, template.pointwise_format)
                    for r, out in zip(batch, outputs)
                ]
            )
            bar.update(len(batch))

    state.wait_for_everyone()
    if state.is_main_process:
        _merge_shards(save_path, store)
    state.wait_for_everyone()
    done = store.load()
    predictions = [done[record.id] for record in records]
    if config.protocol == "longrm" and config.resolved_data_format() == "long_rewardbench":
        # Every task asked for gets a row (LongRM's table), under its file's name: the names typed match files
        # ignoring case (`--tasks longqa` is LongQA).
        tasks = [path.stem for path in find_task_files(config.data_path, config.tasks)]
    else:
        tasks = list(dict.fromkeys(record.task for record in records))
    results = compute_metrics(predictions, tasks, protocol=config.protocol)
    # The API key is redacted: results files are shared.
    results = {"model": config.model_path, "model_type": model_type, **results, "config": config.redacted()}
    if state.is_main_process:
        if results["unparseable"]["total"]:
            logger.warning(
                "%d of %d verdicts could not be parsed and count as wrong.",
                results["unparseable"]["total"],
                len(predictions),
            )
        if results["truncated"]:
            logger.warning(
                "%d records had inputs cut to head + tail (over the %d-token limit).",
                results["truncated"],
                config.max_length,
            )
        if results["bounded_verdict_probs"]:
            logger.warning(
                "%d verdict probabilities are upper bounds: the server reported only its top-k tokens, without every "
                "verdict token (vLLM's server reports them all); the AUC is read from them.",
                results["bounded_verdict_probs"],
            )
        write_reports(results, save_path, stem=_results_stem(config))
    state.wait_for_everyone()
    return results
