"""`evaluate_reward_model` with `backend="vllm"` (an in-process `vllm.LLM`), run from vLLM's venv by
`tests/test_eval_backends.py`: argv[1] is a JSON object of `EvalConfig` fields; the results land in its `save_path`.

vLLM starts its engine's workers by spawn, hence the `__main__` guard.
"""

import json
import sys


if __name__ == "__main__":
    from trl_longrm.evaluation import EvalConfig, evaluate_reward_model

    results = evaluate_reward_model(EvalConfig(**json.loads(sys.argv[1]), backend="vllm"))
    print("RESULTS", json.dumps({"pairwise_avg": results["pairwise_avg"], "auc": results["auc"]}))
