"""Worker of tests/test_judge_reward_processes.py: one real GRPO (or RLOO) step per case on every process of a
distributed run (gloo, CPU), rewarded by `JudgeReward` on a real vLLM server; rank 0 writes, per case, the step's rows
as the trainer gathered them (prompts, completions, rewards), its logged metrics and the number of processes.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml --num_processes 2 tests/judge_reward_worker.py \
        --base-url http://127.0.0.1:8000/v1 --judge JUDGE --policy POLICY --out out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

# (name, trainer, protocol, per_device_train_batch_size, num_generations): every case splits groups over the processes.
CASES = [
    ("grpo_pairwise_4x8", "grpo", "pairwise", 4, 8),  # one group of 8, four rows on each process
    ("grpo_pairwise_3x2", "grpo", "pairwise", 3, 2),  # three groups of 2, the middle one on both processes
    ("grpo_pairwise_1x2", "grpo", "pairwise", 1, 2),  # one row per process: each process alone would compare nothing
    ("grpo_ranking_3x6", "grpo", "ranking", 3, 6),  # one group of 6 ranked at once, three rows on each process
    ("rloo_pairwise_2x4", "rloo", "pairwise", 2, 4),
]
PROMPTS = [
    [{"role": "user", "content": f"Question {i}: name a river, a city and a colour in one short answer."}] for i in range(8)
]


def trainer_for(kind, protocol, per_device, generations, paths, base_url, output_dir):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from trl_longrm import JudgeReward
    from trl_longrm.serving import OpenAIGenerator

    tokenizer = AutoTokenizer.from_pretrained(paths["judge"])
    reward = JudgeReward(OpenAIGenerator(base_url, "judge", tokenizer=tokenizer), tokenizer, protocol=protocol,
                         max_length=2048, max_new_tokens=16)  # fmt: skip
    config, trainer = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    args = config(output_dir=output_dir, use_cpu=True, bf16=False, report_to=[], logging_steps=1, max_steps=1,
                  per_device_train_batch_size=per_device, num_generations=generations, max_completion_length=6,
                  learning_rate=0.0, seed=7, save_strategy="no")  # fmt: skip
    return trainer(model=paths["policy"], reward_funcs=[reward], args=args,
                   train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))  # fmt: skip


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--judge", required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="*", default=[case[0] for case in CASES])
    args = parser.parse_args()
    paths = {"judge": args.judge, "policy": args.policy}
    results = {}
    for name, kind, protocol, per_device, generations in CASES:
        if name not in args.cases:
            continue
        trainer = trainer_for(kind, protocol, per_device, generations, paths, args.base_url,
                              str(Path(args.out).parent / name))  # fmt: skip
        trainer.train()
        logs = trainer._logs
        rewards = list(logs["rewards"]["JudgeReward"])
        results[name] = {
            "num_processes": trainer.accelerator.num_processes,
            "prompts": list(logs["prompt"]),
            "completions": list(logs["completion"]),
            "rewards": [None if math.isnan(r) else r for r in rewards],
            "metrics": {k: v for h in trainer.state.log_history for k, v in h.items() if k.startswith(("judge/", "reward"))},
        }
    if trainer.accelerator.is_main_process:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
