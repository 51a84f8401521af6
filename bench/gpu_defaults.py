"""GPU check (needs one CUDA device): each trainer as a TRL user constructs it (model given by path, config with only
`output_dir` and quiet logging set, so TRL's defaults apply: bf16 autocast, gradient checkpointing, and ours:
packing, `shared_prefix`), for float32 and bfloat16 checkpoints of a Qwen3-shaped model, two steps each; and ours vs
stock TRL on the same batch (k = 1, TRL's defaults on both). Records the first-step loss, whether it is finite, the
attention kernels our attention resolved to, and every warning (a fallback warning is a failure to fix).

    python bench/gpu_defaults.py --out bench/results/gpu/defaults.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import warnings
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402


SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=65536)  # fmt: skip


def record_kernels():
    """Wrap the attention's kernel choice so that every kernel it resolves to is recorded by name."""
    from trl_longrm.sequence_parallel import attention

    seen: set[str] = set()
    resolve, shared = attention.resolve_kernel, attention._shared_prefix_kernel

    def resolve_recorded(*args, **kwargs):
        kernel = resolve(*args, **kwargs)
        seen.add(f"{kernel.name} (ops: {getattr(getattr(kernel, 'ops', None), 'name', None)})")
        return kernel

    def shared_recorded(*args, **kwargs):
        kernel = shared(*args, **kwargs)
        seen.add(f"shared rows: {kernel.name}")
        return kernel

    attention.resolve_kernel, attention._shared_prefix_kernel = resolve_recorded, shared_recorded
    return seen


class FirstLoss(common.TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def groups(tokenizer, num_groups, prompt_length, num_rejected, seed=0):
    import random

    rng = random.Random(seed)
    vocab = list(range(3, len(tokenizer)))

    def ids(n):
        return [rng.choice(vocab) for _ in range(n)]

    return [
        {
            "prompt_ids": ids(prompt_length + rng.randint(0, 64)),
            "chosen_completion_ids": ids(rng.randint(8, 40)) + [tokenizer.eos_token_id],
            "rejected_completion_ids": [ids(rng.randint(8, 40)) + [tokenizer.eos_token_id] for _ in range(num_rejected)],
        }
        for _ in range(num_groups)
    ]


USE_CPU = {}  # `--use-cpu` (a dry run of this script on a machine without a GPU) sets {"use_cpu": True}


def quiet(output_dir, **extra):
    return dict(output_dir=output_dir, **USE_CPU, max_steps=2, logging_steps=1, report_to=[], save_strategy="no",
                disable_tqdm=True, per_device_train_batch_size=2, seed=0, **extra)  # fmt: skip


def run_case(trainer, impl, dtype_name, prompt_length, num_rejected, tokenizer, workdir):
    import torch
    from datasets import Dataset

    from trl_longrm.testing_utils import build_tiny_model

    task = {"grm": "causal-lm", "sft": "causal-lm", "disrm": "seq-cls"}[trainer]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    path = Path(workdir) / f"{task}-{dtype_name}"
    if not path.exists():
        model = build_tiny_model("qwen3", task, tokenizer, seed=0, dtype=dtype, vocab_size=len(tokenizer), **SHAPE)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    rows = groups(tokenizer, 4, prompt_length, num_rejected)
    output_dir = tempfile.mkdtemp(dir=workdir)
    callback = FirstLoss()
    kwargs = dict(model=str(path), processing_class=tokenizer, callbacks=[callback])
    if (trainer, impl) == ("grm", "ours"):
        from trl_longrm import SimPOGRMConfig, SimPOGRMTrainer

        instance = SimPOGRMTrainer(args=SimPOGRMConfig(**quiet(output_dir)), train_dataset=Dataset.from_list(rows),
                                   **kwargs)  # fmt: skip
    elif (trainer, impl) == ("grm", "stock"):
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        class PretokenisedCPOTrainer(CPOTrainer):
            def tokenize_row(self, feature, model=None):
                return feature

        args = CPOConfig(**quiet(output_dir, loss_type="simpo", cpo_alpha=0.05, beta=2.5, simpo_gamma=0.5,
                                 learning_rate=2e-6, remove_unused_columns=False))  # fmt: skip
        instance = PretokenisedCPOTrainer(args=args, train_dataset=Dataset.from_list(common.stock_cpo_rows(rows)),
                                          **kwargs)  # fmt: skip
    elif (trainer, impl) == ("disrm", "ours"):
        from trl_longrm import SimPODisRMConfig, SimPODisRMTrainer

        instance = SimPODisRMTrainer(args=SimPODisRMConfig(**quiet(output_dir)), train_dataset=Dataset.from_list(rows),
                                     **kwargs)  # fmt: skip
    elif (trainer, impl) == ("disrm", "stock"):
        from trl import RewardConfig, RewardTrainer

        # TRL's max_length (1024) drops every longer group before training: the long rows this compares are kept.
        instance = RewardTrainer(args=RewardConfig(**quiet(output_dir, max_length=None)),
                                 train_dataset=Dataset.from_list(common.stock_reward_rows(rows)), **kwargs)
    elif trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        from trl_longrm import LongSFTConfig, LongSFTTrainer

        sft_rows = [{"input_ids": r["prompt_ids"] + r["chosen_completion_ids"],
                     "completion_mask": [0] * len(r["prompt_ids"]) + [1] * len(r["chosen_completion_ids"])}
                    for r in rows]  # fmt: skip
        config, cls = (LongSFTConfig, LongSFTTrainer) if impl == "ours" else (SFTConfig, SFTTrainer)
        extra = {} if impl == "ours" else {"completion_only_loss": True, "max_length": None}
        instance = cls(args=config(**quiet(output_dir, **extra)), train_dataset=Dataset.from_list(sft_rows), **kwargs)
    else:
        raise ValueError((trainer, impl))
    args = instance.args
    instance.train()
    return {
        "losses": callback.losses,
        "finite": bool(callback.losses) and all(math.isfinite(x) for x in callback.losses),
        "bf16": args.bf16,
        "gradient_checkpointing": args.gradient_checkpointing,
        "shared_prefix": getattr(args, "shared_prefix", None),
        "padding_free": getattr(args, "padding_free", None),
        "packing": getattr(args, "packing", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-length", type=int, default=2048)
    parser.add_argument("--out", required=True)
    parser.add_argument("--use-cpu", action="store_true", help="Dry run on CPU (use_cpu=True).")
    cli = parser.parse_args()
    if cli.use_cpu:
        USE_CPU["use_cpu"] = True

    import torch

    from trl_longrm.testing_utils import build_chat_tokenizer

    kernels = record_kernels()
    tokenizer = build_chat_tokenizer()
    report = {"versions": common.software_versions(), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "shape": SHAPE,
              "cases": []}  # fmt: skip
    cases = [(t, "ours", d, k) for t in ("grm", "disrm") for d in ("bf16", "fp32") for k in (1, 3)]
    cases += [("sft", "ours", d, 0) for d in ("bf16", "fp32")]
    cases += [(t, "stock", d, 1) for t in ("grm", "disrm") for d in ("bf16", "fp32")]
    cases += [("sft", "stock", d, 0) for d in ("bf16", "fp32")]
    with tempfile.TemporaryDirectory() as workdir:
        for trainer, impl, dtype_name, k in cases:
            kernels.clear()
            record = {"trainer": trainer, "impl": impl, "checkpoint_dtype": dtype_name, "num_rejected": k}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    record.update(run_case(trainer, impl, dtype_name, cli.prompt_length, k, tokenizer, workdir))
                except Exception as error:  # noqa: BLE001 - recorded, the next case runs
                    record["error"] = f"{type(error).__name__}: {error}"[:2000]
            record["kernels"] = sorted(kernels)
            record["warnings"] = sorted({f"{w.category.__name__}: {w.message}"[:300] for w in caught})
            report["cases"].append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "warnings"}), flush=True)
            Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
            Path(cli.out).write_text(json.dumps(report, indent=1))
    for trainer in ("grm", "disrm", "sft"):
        for dtype_name in ("bf16", "fp32"):
            pick = {c["impl"]: c for c in report["cases"] if c["trainer"] == trainer
                    and c["checkpoint_dtype"] == dtype_name and c["num_rejected"] in (0, 1) and c.get("losses")}
            if {"ours", "stock"} <= set(pick):
                a, b = pick["ours"]["losses"][0], pick["stock"]["losses"][0]
                print(f"first-step loss {trainer} {dtype_name}: ours {a:.6f} stock {b:.6f} "
                      f"rel diff {abs(a - b) / max(abs(b), 1e-12):.2e}")
    failed = [f"{c['trainer']} {c['impl']} {c['checkpoint_dtype']}" for c in report["cases"] if c.get("error")]
    if failed:
        raise SystemExit(f"gpu_defaults.py: {len(failed)} case(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
