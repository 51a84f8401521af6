"""Run from vLLM's venv by tests/test_generation_config_backends.py: a pointwise `GenerativeJudge` on an in-process
`VLLMGenerator` (argv[1]: the checkpoint), its judgments and expected scores for argv[2] (a JSON list of [task,
response] pairs) printed as one `RESULT {...}` line. vLLM starts its engine's workers by spawn: `__main__` guard."""

import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's trl_longrm, before the venv's

if __name__ == "__main__":
    from transformers import AutoTokenizer

    from trl_longrm.evaluation.judges import GenerativeJudge, JudgeRequest
    from trl_longrm.serving.vllm_engine import VLLMGenerator

    engine = VLLMGenerator(sys.argv[1], max_model_len=4096, gpu_memory_utilization=0.08, dtype="float32")
    judge = GenerativeJudge(engine, AutoTokenizer.from_pretrained(sys.argv[1]), max_length=4096, max_new_tokens=24,
                            protocol="pointwise")  # fmt: skip
    pairs = json.loads(sys.argv[2])
    outputs = judge.judge([JudgeRequest(str(i), [], task, [response], False) for i, (task, response) in enumerate(pairs)])
    print("RESULT " + json.dumps({"judgments": [o.judgments[0] for o in outputs], "scores": [o.scores[0] for o in outputs],
                                  "greedy": engine.greedy}), flush=True)  # fmt: skip
