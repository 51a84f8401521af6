"""Worker of tests/test_data_parallel_metrics.py: two data-parallel replicas (gloo) train 20 steps with packing and
1 to 4 rejected responses per group, then evaluate; rank 0 writes the logs and the packed rows.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml --num_processes 2 tests/dp_metrics_worker.py \
        --out_dir /tmp/out --kind grm disrm
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))  # trainer_helpers, when run as a script

from trainer_helpers import cpu_args, random_groups  # noqa: E402

from trl_longrm import SimPODisRMConfig, SimPODisRMTrainer, SimPOGRMConfig, SimPOGRMTrainer  # noqa: E402
from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model  # noqa: E402


# 40 groups of 1-4 rejected responses packed into rows of at most PACK_TOKENS tokens: an odd number of rows, so the
# last step of every epoch has one real row and one that accelerate repeats to even out the two replicas.
NUM_GROUPS, DATA_SEED, PACK_TOKENS, STEPS = 40, 11, 150, 20


def build(kind: str, output_dir: str):
    tokenizer = build_chat_tokenizer()
    data = random_groups(tokenizer, NUM_GROUPS, (1, 4), seed=DATA_SEED)
    args = cpu_args(
        output_dir,
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        max_tokens_per_row=PACK_TOKENS,
        train_sampling_strategy="sequential",
        learning_rate=0.0,  # the model stays as built: every step's metrics can be recomputed by hand
        lr_scheduler_type="constant",
        max_steps=STEPS,
        logging_steps=1,
    )
    if kind == "grm":
        model = build_tiny_model("llama", "causal-lm", tokenizer, seed=3)
        return SimPOGRMTrainer(
            model=model, args=SimPOGRMConfig(**args), train_dataset=data, eval_dataset=data, processing_class=tokenizer
        )
    model = build_tiny_model("qwen3", "seq-cls", tokenizer, seed=3)
    return SimPODisRMTrainer(
        model=model, args=SimPODisRMConfig(**args), train_dataset=data, eval_dataset=data, processing_class=tokenizer
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--kind", choices=["grm", "disrm"], nargs="+", required=True)
    args = parser.parse_args()
    # One launch for every kind (one trainer after the other in the same processes and process group): a launch is
    # two interpreters' imports, most of such a short run.
    for kind in args.kind:
        trainer = build(kind, str(Path(args.out_dir) / f"run_{kind}"))
        trainer.train()
        eval_metrics = trainer.evaluate()
        if trainer.accelerator.is_main_process:
            result = {
                "log_history": trainer.state.log_history,
                "eval": eval_metrics,
                "packs": trainer.train_dataset.to_list(),
                "num_processes": trainer.accelerator.num_processes,
            }
            (Path(args.out_dir) / f"{kind}.json").write_text(json.dumps(result))
    # As `trl_longrm.train` does: a gloo group left to static destructors can abort a rank at exit ("terminate called
    # without an active exception") after everything was written.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
