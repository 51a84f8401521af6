"""Long-RewardBench evaluation of generative and discriminative reward models.

Names are imported on first use (PEP 562), so that `trl-longrm --help` does not pay for importing torch.

Example:
```python
>>> from trl_longrm.evaluation import EvalConfig, evaluate_reward_model
>>> results = evaluate_reward_model(EvalConfig(model_path="./LongReward_Qwen3-8B", data_path="./LongReward-Bench"))
```
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING


_EXPORTS = {
    "benchmark": ["BenchmarkRecord", "load_benchmark", "load_preference_records"],
    "cli": ["add_eval_arguments", "run_eval"],
    "config": ["FORMATS", "LENGTH_BUCKETS", "TASKS", "EvalConfig"],
    "fixtures": ["make_toy_benchmark"],
    "judges": [
        "DiscriminativeJudge",
        "GenerativeJudge",
        "Judge",
        "JudgeOutput",
        "JudgeRequest",
        "ScriptedJudge",
        "load_judge",
        "truncate_head_tail",
    ],
    "metrics": ["compute_auc", "compute_metrics", "score_ranking"],
    "prompts": ["parse_pairwise_verdict", "parse_pointwise_score", "parse_ranking_verdict"],
    "runner": ["PredictionStore", "evaluate_reward_model"],
    "score": ["ScoreConfig", "score"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "BenchmarkRecord",
    "DiscriminativeJudge",
    "EvalConfig",
    "FORMATS",
    "GenerativeJudge",
    "Judge",
    "JudgeOutput",
    "JudgeRequest",
    "LENGTH_BUCKETS",
    "PredictionStore",
    "ScoreConfig",
    "ScriptedJudge",
    "TASKS",
    "add_eval_arguments",
    "compute_auc",
    "compute_metrics",
    "evaluate_reward_model",
    "load_benchmark",
    "load_judge",
    "load_preference_records",
    "make_toy_benchmark",
    "parse_pairwise_verdict",
    "parse_pointwise_score",
    "parse_ranking_verdict",
    "run_eval",
    "score",
    "score_ranking",
    "truncate_head_tail",
]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


def __dir__():
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:
    from trl_longrm.evaluation.benchmark import BenchmarkRecord, load_benchmark, load_preference_records
    from trl_longrm.evaluation.cli import add_eval_arguments, run_eval
    from trl_longrm.evaluation.config import FORMATS, LENGTH_BUCKETS, TASKS, EvalConfig
    from trl_longrm.evaluation.fixtures import make_toy_benchmark
    from trl_longrm.evaluation.judges import (
        DiscriminativeJudge,
        GenerativeJudge,
        Judge,
        JudgeOutput,
        JudgeRequest,
        ScriptedJudge,
        load_judge,
        truncate_head_tail,
    )
    from trl_longrm.evaluation.metrics import compute_auc, compute_metrics, score_ranking
    from trl_longrm.evaluation.prompts import parse_pairwise_verdict, parse_pointwise_score, parse_ranking_verdict
    from trl_longrm.evaluation.runner import PredictionStore, evaluate_reward_model
    from trl_longrm.evaluation.score import ScoreConfig, score
