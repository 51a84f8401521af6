"""Configuration of a Long-RewardBench evaluation run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


TASKS = ("LongQA", "Summ", "Safety", "ICL", "Cite", "Code", "Math")
FORMATS = ("PairWise", "BestOfN")
LENGTH_BUCKETS = ("4k", "8k", "16k", "32k", "64k", "128k")
RANK_SUBTYPES = ("2", "3", "4")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_judging_settings(config) -> None:
    """The settings `EvalConfig` and `ScoreConfig` share (`batch_size`, `max_length`, `max_new_tokens`, `dtype`),
    checked once for both."""
    if config.batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {config.batch_size}.")
    if config.max_length < 16:
        raise ValueError(f"`max_length` must be >= 16 tokens, got {config.max_length}.")
    if config.max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be >= 1, got {config.max_new_tokens}.")
    if config.dtype not in DTYPES:
        raise ValueError(f"`dtype` must be one of {list(DTYPES)}, got {config.dtype!r}.")
DATA_FORMATS = ("auto", "long_rewardbench", "preference")
JUDGE_PROTOCOLS = ("pairwise", "pointwise")
PROTOCOLS = ("default", "longrm")


@dataclass
class EvalConfig:
    """Settings of `evaluate_reward_model` and of `trl-longrm eval` (each field is a `--kebab-case` flag).

    Example:
    ```python
    >>> from trl_longrm.evaluation import EvalConfig, evaluate_reward_model
    >>> config = EvalConfig(model_path="./LongReward_Qwen3-8B", data_path="./LongReward-Bench", batch_size=4)
    >>> results = evaluate_reward_model(config)
    >>> results["pairwise_avg"], results["rank_avg"], results["average"]
    ```
    """

    model_path: str = field(
        metadata={"help": "Local directory of the reward model (a causal LM judge, or a 1-label sequence classifier)."}
    )
    data_path: str = field(
        metadata={
            "help": "Directory holding one `{Task}.jsonl` file per Long-RewardBench task, or (with `data_format` "
            "`preference`) any preference dataset that `trl_longrm.data.load_preference_dataset` reads."
        },
    )
    data_format: str = field(
        default="auto",
        metadata={
            "help": "`long_rewardbench`, `preference` (pairwise only: chosen vs each rejected), or `auto`: "
            "long_rewardbench when `data_path` is a directory with a `{Task}.jsonl` of a selected task. Default auto."
        },
    )
    split: str | None = field(
        default=None,
        metadata={"help": "Split of a `preference` dataset with several splits; default None (its `train` split)."},
    )
    is_disrm: bool = field(
        default=False,
        metadata={
            "help": "Treat the model as a discriminative RM (AutoModelForSequenceClassification, 1 label) that scores "
            "each candidate; default False: a generative RM that writes a verdict."
        },
    )
    save_path: str | None = field(
        default=None,
        metadata={
            "help": "Directory for predictions.jsonl, results.json/.csv/.md and the length plot; re-running with the "
            "same directory resumes. Default None: `eval_results/<model directory name>`."
        },
    )
    tasks: list[str] = field(
        default_factory=lambda: list(TASKS),
        metadata={"help": f"Tasks to evaluate; default all of {', '.join(TASKS)}."},
    )
    formats: list[str] = field(
        default_factory=lambda: list(FORMATS),
        metadata={"help": "Record formats to evaluate: PairWise and/or BestOfN; default both."},
    )
    batch_size: int = field(
        default=1,
        metadata={
            "help": "Records judged per forward pass (a DisRM scores this many candidate sequences at once); default 1. "
            "Results do not depend on it."
        },
    )
    shared_prefix: bool = field(
        default=True,
        metadata={
            "help": "For a DisRM, score a record's candidates in one packed row that holds their common token prefix "
            "(the long prompt) once, each candidate attending to it and to itself only (the training layout of "
            "`shared_prefix`): the same scores as scoring each candidate on its own, with the prompt encoded once. "
            "`--no-shared-prefix` scores right-padded candidate sequences. Ignored for a generative RM. Default True."
        },
    )
    max_length: int = field(
        default=131072,
        metadata={
            "help": "Longest model input in tokens; a longer input keeps its first max_length//2 tokens and its last "
            "max_length - max_length//2 - 5 tokens, as LongRM does. Default 131072."
        },
    )
    max_new_tokens: int = field(
        default=2048,
        metadata={"help": "Most tokens a generative judge may write (greedy decoding); default 2048."},
    )
    seed: int = field(
        default=42,
        metadata={
            "help": "Seed of the candidate shuffling; each record's order comes from a hash of (seed, record id), so it "
            "does not depend on batching or on which records are evaluated. Default 42."
        },
    )
    device: str | None = field(
        default=None,
        metadata={
            "help": "Torch device for the model, e.g. `cuda:0` or `cpu`; default None: cuda if available, else cpu."
        },
    )
    dtype: str = field(
        default="auto",
        metadata={"help": f"Model weight dtype, one of {', '.join(DTYPES)}; default `auto` (the checkpoint's dtype)."},
    )
    verdict_probs: bool = field(
        default=True,
        metadata={
            "help": "For a generative RM, also run one forced-decoding pass per pairwise record (judge output up to its "
            "verdict, then `[[`) to read P(A) and P(B), from which the AUC is computed. Default True."
        },
    )

    judge_protocol: str = field(
        default="pairwise",
        metadata={
            "help": "How a generative RM judges: `pairwise` (LongRM's protocol: all candidates in one prompt, a "
            "`[[A]]` verdict or a `[[C>A>B]]` ranking) or `pointwise` (one prompt per candidate, a `[[0]]`..`[[9]]` "
            "score each; candidates ranked by score). Ignored for a DisRM. Default pairwise."
        },
    )

    protocol: str = field(
        default="default",
        metadata={
            "help": "Evaluation protocol: `default` (each record's candidate order from a hash of the seed and its id, "
            "the last verdict of a judgment counts, only complete rankings score) or `longrm` (reproduces LongRM's "
            "evaluator from the same judge outputs: its seeded candidate order per task file, its verdict parsing, "
            "partial rankings, empty groups reported as 0, and its truncation of inputs of at least max_length "
            "tokens). Default `default`."
        },
    )
    prompt_template: str | None = field(
        default=None,
        metadata={
            "help": "YAML file with the generative judge's system and user templates for pairwise, ranking (BestOfN) "
            "and pointwise judging, and the verdict format each expects (e.g. LongRM's pointwise `[Score: N]` on "
            "0..10); sections it leaves out keep the built-in prompts. Default None: the built-in prompts "
            "(`trl_longrm/evaluation/templates/default.yaml`, a file of that shape)."
        },
    )

    def resolved_data_format(self) -> str:
        """`long_rewardbench` or `preference`: `data_format`, with `auto` decided by the files under `data_path`."""
        if self.data_format != "auto":
            return self.data_format
        path = Path(self.data_path)
        names = {p.stem.lower() for p in path.glob("*.jsonl")} if path.is_dir() else set()
        return "long_rewardbench" if any(task.lower() in names for task in self.tasks) else "preference"

    def __post_init__(self):
        self.tasks = list(self.tasks)
        self.formats = list(self.formats)
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown:
            raise ValueError(f"Unknown format(s) {unknown}; expected a subset of {list(FORMATS)}.")
        if not self.tasks:
            raise ValueError("`tasks` is empty; name at least one task.")
        check_judging_settings(self)
        if self.data_format not in DATA_FORMATS:
            raise ValueError(f"`data_format` must be one of {list(DATA_FORMATS)}, got {self.data_format!r}.")
        if self.judge_protocol not in JUDGE_PROTOCOLS:
            raise ValueError(f"`judge_protocol` must be one of {list(JUDGE_PROTOCOLS)}, got {self.judge_protocol!r}.")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"`protocol` must be one of {list(PROTOCOLS)}, got {self.protocol!r}.")
        if self.protocol == "longrm" and self.judge_protocol == "pointwise" and not self.is_disrm:
            raise ValueError(
                "`protocol` longrm reproduces LongRM's evaluator, which judges pairwise and by ranking only; "
                "`judge_protocol` pointwise cannot be combined with it."
            )
        if not self.is_disrm and self.protocol == "default" and self.max_new_tokens >= self.max_length:
            raise ValueError(
                f"`max_new_tokens` ({self.max_new_tokens}) must be below `max_length` ({self.max_length}): the prompt "
                "and the judgment share the context."
            )
        if self.save_path is None:
            self.save_path = os.path.join("eval_results", os.path.basename(os.path.normpath(self.model_path)))


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

    def __post_init__(self):
        check_judging_settings(self)
