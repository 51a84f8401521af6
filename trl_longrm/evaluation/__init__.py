"""Long-RewardBench evaluation of generative and discriminative reward models.

Example:
```python
>>> from trl_longrm.evaluation import EvalConfig, evaluate_reward_model
>>> results = evaluate_reward_model(EvalConfig(model_path="./LongReward_Qwen3-8B", data_path="./LongReward-Bench"))
```
"""

from trl_longrm.evaluation.benchmark import BenchmarkRecord, load_benchmark
from trl_longrm.evaluation.cli import add_eval_arguments, run_eval
from trl_longrm.evaluation.config import FORMATS, LENGTH_BUCKETS, TASKS, EvalConfig
from trl_longrm.evaluation.fixtures import make_toy_benchmark
from trl_longrm.evaluation.judges import (
    DiscriminativeJudge,
    GenerativeJudge,
    Judge,
    JudgeOutput,
    JudgeRequest,
    load_judge,
    truncate_head_tail,
)
from trl_longrm.evaluation.metrics import compute_auc, compute_metrics, score_ranking
from trl_longrm.evaluation.runner import PredictionStore, evaluate_reward_model


__all__ = [
    "FORMATS",
    "LENGTH_BUCKETS",
    "TASKS",
    "BenchmarkRecord",
    "DiscriminativeJudge",
    "EvalConfig",
    "GenerativeJudge",
    "Judge",
    "JudgeOutput",
    "JudgeRequest",
    "PredictionStore",
    "add_eval_arguments",
    "compute_auc",
    "compute_metrics",
    "evaluate_reward_model",
    "load_benchmark",
    "load_judge",
    "make_toy_benchmark",
    "run_eval",
    "score_ranking",
    "truncate_head_tail",
]
