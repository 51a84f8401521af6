"""Worker of tests/test_sequence_parallel_trainers.py: the three LongRM trainers with sequence parallelism on gloo.

The test process computes single-process references with the same builders; the workers (forked by
`run_on_gloo_ranks`, or started by `accelerate launch` when run as a script) write their results to a directory,
rank 0 only, with `torch.save`.

    accelerate launch --config_file accelerate_configs/cpu_zero2.yaml --num_processes 4 tests/sp_trainer_worker.py \
        --out_dir /tmp/out --task train --sequence_parallel_size 2
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from datasets import Dataset


sys.path.insert(0, str(Path(__file__).resolve().parent))  # trainer_helpers, when run as a script

from trainer_helpers import AttentionCallCounter, cpu_args, random_groups  # noqa: E402

from trl_longrm import (  # noqa: E402
    LongSFTConfig,
    LongSFTTrainer,
    SimPODisRMConfig,
    SimPODisRMTrainer,
    SimPOGRMConfig,
    SimPOGRMTrainer,
)
from trl_longrm.sequence_parallel.launch import set_distributed_env  # noqa: E402
from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model  # noqa: E402


KINDS = ("grm", "disrm", "sft")
# One packed row of 3 groups x (chosen + 2 rejected) = 9 documents (~170 tokens) for the one-step checks.
STEP_GROUPS, STEP_BATCH, STEP_SEED = 6, 3, 18
# The training runs: 12 groups, 2 per micro-batch, 3 optimizer steps of 2 micro-batches (one epoch).
TRAIN_GROUPS, TRAIN_BATCH, TRAIN_STEPS, TRAIN_SEED = 12, 2, 3, 21
# After training, `evaluate()` on 8 groups (whole batches: the eval loss of 2 replicas is then one process's) and
# `predict()` on the first 7 (2 replicas of 2 rows: accelerate repeats a row in the last batch, which must be dropped).
EVAL_GROUPS, EVAL_BATCH, PREDICT_GROUPS, EVAL_SEED = 8, 2, 7, 33


def sft_examples(groups: Dataset) -> Dataset:
    """Prompt + chosen completion of each group, trained on the completion only."""
    return Dataset.from_list(
        [
            {
                "input_ids": g["prompt_ids"] + g["chosen_completion_ids"],
                "completion_mask": [0] * len(g["prompt_ids"]) + [1] * len(g["chosen_completion_ids"]),
            }
            for g in groups
        ]
    )


class PredictionRecorder:
    """A `compute_metrics` that keeps what the trainer passes it (as a user's metric would see it) and reports how many
    predictions it received."""

    def __init__(self):
        self.calls = []

    def __call__(self, prediction):
        self.calls.append((np.array(prediction.predictions), np.array(prediction.label_ids)))
        return {"predictions_seen": float(len(prediction.predictions))}


def build_trainer(kind, output_dir, tokenizer, num_groups, data_seed, num_rejected=2, eval_groups=0, **overrides):
    """A trainer of `kind` on a tiny fp32 model (same weights on every process) and random tokenised groups; `kind`
    ending in "+lora" trains a LoRA adapter (seeded, non-zero B) instead of every weight. With `eval_groups`, an eval
    dataset of that many groups and, for the preference trainers, a `PredictionRecorder` as `compute_metrics`."""
    data = random_groups(tokenizer, num_groups, num_rejected, seed=data_seed)
    evals = {}
    if eval_groups:
        eval_data = random_groups(tokenizer, eval_groups, num_rejected, seed=EVAL_SEED)
        evals["eval_dataset"] = sft_examples(eval_data) if kind.startswith("sft") else eval_data
        if not kind.startswith("sft"):  # SFT's predictions are padded logits of packed rows: compared by `predict()`
            evals["compute_metrics"] = PredictionRecorder()
    args = cpu_args(output_dir, **overrides)
    kind, _, adapter = kind.partition("+")
    peft = {}
    if adapter == "lora":
        from peft import LoraConfig

        torch.manual_seed(5)  # init_lora_weights=False draws B at random: the same adapter on every process
        task = {"grm": "CAUSAL_LM", "disrm": "SEQ_CLS", "sft": "CAUSAL_LM"}[kind]
        peft["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type=task,
                                         init_lora_weights=False)  # fmt: skip
    if kind == "grm":
        model = build_tiny_model("llama", "causal-lm", tokenizer, seed=3)
        return SimPOGRMTrainer(
            model=model, args=SimPOGRMConfig(**args), train_dataset=data, processing_class=tokenizer, **peft, **evals
        )
    if kind == "disrm":
        model = build_tiny_model("qwen3", "seq-cls", tokenizer, seed=3)
        return SimPODisRMTrainer(
            model=model, args=SimPODisRMConfig(**args), train_dataset=data, processing_class=tokenizer, **peft, **evals
        )
    if kind == "sft":
        model = build_tiny_model("qwen3", "causal-lm", tokenizer, seed=3)
        return LongSFTTrainer(
            model=model, args=LongSFTConfig(**args), train_dataset=sft_examples(data), processing_class=tokenizer,
            **peft, **evals,
        )  # fmt: skip
    raise ValueError(f"unknown trainer kind {kind!r}")


def step_trainer(kind, output_dir, tokenizer, **overrides):
    return build_trainer(
        kind,
        output_dir,
        tokenizer,
        STEP_GROUPS,
        STEP_SEED,
        per_device_train_batch_size=STEP_BATCH,
        train_sampling_strategy="sequential",
        **overrides,
    )


def train_trainer(kind, output_dir, tokenizer, **overrides):
    settings = dict(
        per_device_train_batch_size=TRAIN_BATCH,
        max_steps=TRAIN_STEPS,
        learning_rate=0.05,
        optim="sgd",
        max_grad_norm=0.0,  # no clipping: it would hide a wrongly scaled gradient
        lr_scheduler_type="constant",
        logging_steps=1,
        include_num_input_tokens_seen=True,  # the counter users read (and the tokens per second derived from it)
        per_device_eval_batch_size=EVAL_BATCH,
    )
    if kind == "grm":
        # The NLL term is a token mean over one micro-batch's chosen responses (as in TRL's CPOTrainer), so two
        # replicas of b groups differ from one process of 2b groups by design; the one-step test covers it.
        settings["nll_loss_weight"] = 0.0
    return build_trainer(
        kind, output_dir, tokenizer, TRAIN_GROUPS, TRAIN_SEED, eval_groups=EVAL_GROUPS, **{**settings, **overrides}
    )


def one_step(trainer) -> dict:
    """Loss and parameter gradients of the first batch of the trainer's dataloader (no optimizer step), the batch,
    and the metrics the loss function records."""
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    model = trainer.model
    model.train()
    model.zero_grad()
    if isinstance(trainer, SimPOGRMTrainer):
        loss, metrics = trainer.get_batch_loss_metrics(model, batch)
    else:
        loss = trainer.compute_loss(model, batch)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    result = {
        "loss": loss.detach(),
        "grads": grads,
        "input_ids": batch["input_ids"].clone(),
        "position_ids": batch["position_ids"].clone(),
        "metrics": metrics,
    }
    for key in ("segment_lengths", "segment_parents"):  # shared-prefix rows
        if key in batch:
            result[key] = batch[key].clone()
    return result


def world_average(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What DDP / DeepSpeed apply: the mean of every rank's gradient."""
    out = {}
    for name, grad in grads.items():
        grad = grad.clone()
        dist.all_reduce(grad)
        out[name] = grad / dist.get_world_size()
    return out


# Logged values that measure time, not the run.
TIMING_KEYS = ("_runtime", "_per_second")


def untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not k.endswith(TIMING_KEYS)}


def final_state(trainer) -> dict:
    """What a user reads after `train()`: the weights, every logged metric and counter, and, when the trainer has an
    eval dataset, `evaluate()`'s metrics, what `compute_metrics` received, and `predict()`'s outputs."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    state = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "logs": [untimed(log) for log in logs],
        # Tokens per second times the seconds they were measured over: the token count behind the logged speed.
        "timed_tokens": [log["train_tokens_per_second"] * log["train_runtime"] for log in logs],
        "total_flos": trainer.state.total_flos,
        "global_step": trainer.state.global_step,
    }
    if trainer.eval_dataset is not None:
        recorder = trainer.compute_metrics
        state["eval"] = untimed(trainer.evaluate())
        if isinstance(recorder, PredictionRecorder):
            state["compute_metrics_inputs"] = [np.concatenate(arrays) for arrays in zip(*recorder.calls)]
            recorder.calls.clear()
        output = trainer.predict(trainer.eval_dataset.select(range(PREDICT_GROUPS)))
        state["predict"] = (np.array(output.predictions), np.array(output.label_ids))
    return state


def run_step_task(out_dir: Path, world_size: int, tokenizer) -> None:
    for kind in KINDS:
        trainer = step_trainer(kind, out_dir / kind, tokenizer, sequence_parallel_size=world_size)
        result = one_step(trainer)
        result["grads"] = world_average(result["grads"])
        if dist.get_rank() == 0:
            torch.save(result, out_dir / f"step_{kind}_world{world_size}.pt")


# Data of the shared-prefix one-step checks: in its first row of 3 groups (113 tokens in the shared layout) documents
# cross the slice boundaries of rings of 2 and 4, and some response lies wholly on another rank than its prompt.
SHARED_STEP_SEED = 3


def shared_step_trainer(kind, output_dir, tokenizer, **overrides):
    return build_trainer(
        kind,
        output_dir,
        tokenizer,
        STEP_GROUPS,
        SHARED_STEP_SEED,
        per_device_train_batch_size=STEP_BATCH,
        train_sampling_strategy="sequential",
        **overrides,
    )


def run_shared_step_task(out_dir: Path, world_size: int, tokenizer) -> None:
    """One step of the GRM and DisRM trainers in the shared-prefix layout on a ring of the whole world."""
    for kind in ("grm", "disrm"):
        trainer = shared_step_trainer(
            kind, out_dir / f"shared_{kind}", tokenizer, sequence_parallel_size=world_size, shared_prefix=True
        )
        result = one_step(trainer)
        result["grads"] = world_average(result["grads"])
        if dist.get_rank() == 0:
            torch.save(result, out_dir / f"shared_step_{kind}_world{world_size}.pt")


def run_bad_config_task(out_dir: Path, world_size: int, tokenizer) -> None:
    """Configurations that must fail in `__init__` on a real world; rank 0 records the messages."""
    cases = {
        "size_not_dividing_world": dict(sequence_parallel_size=world_size + 1),
        "bad_stride": dict(sequence_parallel_size=world_size, ring_head_stride=3),
        "flash_without_flash_attn": dict(sequence_parallel_size=world_size, ring_attn_backend="flash_attn"),
    }
    messages = {}
    for name, overrides in cases.items():
        try:
            step_trainer("grm", out_dir / name, tokenizer, **overrides)
        except Exception as error:  # noqa: BLE001 - the test checks the type and message
            messages[name] = (type(error).__name__, str(error))
        else:
            messages[name] = ("no error", "")
    if dist.get_rank() == 0:
        torch.save(messages, out_dir / f"bad_configs_world{world_size}.pt")


def run_train_task(out_dir: Path, sequence_parallel_size: int, tokenizer, kinds=KINDS, mode: str = "ring") -> None:
    tag = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and "deepspeed" or "ddp"
    tag += "" if mode == "ring" else f"_{mode}"
    for kind in kinds:
        trainer = train_trainer(
            kind, out_dir / f"train_{kind}", tokenizer, sequence_parallel_size=sequence_parallel_size,
            sequence_parallel_mode=mode,
        )  # fmt: skip
        trainer.train()
        state = final_state(trainer)
        state["distributed_type"] = str(trainer.accelerator.distributed_type)
        state["num_processes"] = trainer.accelerator.num_processes
        if dist.get_rank() == 0:
            torch.save(state, out_dir / f"train_{kind}_{tag}.pt")
        del trainer


# Sequence-parallel modes trained against one process: (trainer kind, rejected responses per prompt).
# (k = 1 for the DisRM is the same code path as for the GRM: one rejected response per prompt.)
MODE_RUNS = [("grm", 1), ("grm", 3), ("disrm", 3), ("sft", 1), ("disrm+lora", 3)]


def mode_trainer(kind, output_dir, tokenizer, num_rejected, **overrides):
    """A few SGD steps of `kind` with shared prefixes (the default; the SFT trainer packs), the GRM with its NLL
    term, on a ring of the whole world or one process (the same micro-batches either way)."""
    settings = dict(shared_prefix=True) if kind != "sft" else {}
    if kind.startswith("grm"):
        settings["nll_loss_weight"] = 0.2
    return train_trainer(kind, output_dir, tokenizer, num_rejected=num_rejected, **{**settings, **overrides})


def run_modes_task(out_dir: Path, world_size: int, tokenizer, mode: str, ulysses_size: int | None) -> None:
    for kind, num_rejected in MODE_RUNS:
        trainer = mode_trainer(kind, out_dir / f"{mode}_{kind}", tokenizer, num_rejected,
                               sequence_parallel_size=world_size, sequence_parallel_mode=mode,
                               ulysses_size=ulysses_size)  # fmt: skip
        assert trainer.sp_groups.ulysses_size == (ulysses_size or world_size)
        trainer.train()
        state = final_state(trainer)  # on every rank: `evaluate()` and `predict()` are collective
        if dist.get_rank() == 0:
            torch.save(state, out_dir / f"mode_{mode}{ulysses_size or ''}_{kind}{num_rejected}_world{world_size}.pt")
        del trainer


# Tiled MLPs (`mlp_tile_tokens`) on a group of the whole world: (trainer kind, rejected responses per prompt); the
# slices are smaller than a rank's share of a row, so every MLP is tiled.
TILED_RUNS, TILE_TOKENS = [("grm", 3), ("disrm", 3), ("sft", 1)], 16


def tiled_trainer(kind, output_dir, tokenizer, num_rejected, **overrides):
    """Two SGD steps of `kind` with shared prefixes (the SFT trainer packs), no evaluation."""
    settings = dict(per_device_train_batch_size=TRAIN_BATCH, max_steps=2, learning_rate=0.05, optim="sgd",
                    max_grad_norm=0.0, lr_scheduler_type="constant", logging_steps=1)  # fmt: skip
    settings.update(dict(shared_prefix=True) if not kind.startswith("sft") else {})
    return build_trainer(kind, output_dir, tokenizer, TRAIN_GROUPS, TRAIN_SEED, num_rejected, **{**settings, **overrides})


# Activation offload (tests/test_activation_offload.py): the same two steps with every saved activation offloaded,
# under gradient checkpointing.
OFFLOAD_SETTINGS = dict(gradient_checkpointing=True, activation_offloading=True)
# Selective checkpointing (tests/test_selective_checkpointing.py): the attention kernels' outputs kept, on a ring
# (the ring attention's head-chunk calls) and a Ulysses group.
SELECTIVE_SETTINGS = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": True})


def run_tiled_task(out_dir: Path, world_size: int, tokenizer, mode: str, tag: str = "tiled") -> None:
    """`TILED_RUNS` on a group of the whole world, tiled (`tag="tiled"`), offloaded (`tag="offload"`) or selectively
    checkpointed (`tag="selective"`)."""
    settings = {"tiled": dict(mlp_tile_tokens=TILE_TOKENS), "offload": OFFLOAD_SETTINGS,
                "selective": SELECTIVE_SETTINGS}[tag]  # fmt: skip
    for kind, num_rejected in TILED_RUNS:
        trainer = tiled_trainer(kind, out_dir / f"{tag}_{mode}_{kind}", tokenizer, num_rejected,
                                sequence_parallel_size=world_size, sequence_parallel_mode=mode, **settings)  # fmt: skip
        with AttentionCallCounter() as calls:
            trainer.train()
        if tag == "selective":  # each attention call's forward ran once: none was recomputed
            assert calls.forward == calls.backward > 0, (kind, mode, calls.forward, calls.backward, calls.ops)
        if tag == "offload":  # each rank moved its saved activations to host memory, all released after the step
            store = trainer.activation_offload_store
            assert store.moved_bytes > 0 and store.current_bytes == 0, (store.moved_bytes, store.current_bytes)
        if dist.get_rank() == 0:
            model = trainer.accelerator.unwrap_model(trainer.model)
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            torch.save(params, out_dir / f"{tag}_{mode}_{kind}_world{world_size}.pt")
        del trainer


# accelerate's parallelism_config read as our Ulysses: (trainer kind, rejected per prompt, config overrides); the SFT
# run keeps TRL's padded batches (padding_free=False), which stock SFTTrainer trains under accelerate's Ulysses.
ACCELERATE_RUNS = [("grm", 3, {}), ("disrm", 3, {}), ("sft", 1, {"padding_free": False})]


def run_accelerate_task(out_dir: Path, tokenizer, route: str) -> None:
    """Trainers given no sequence-parallel field of ours: accelerate's `sp_size` (an object in the config, or the
    accelerate YAML's variables) asks for Ulysses over the world. The config route trains the SFT run only (the
    other trainers read the object the same way: `SequenceParallelConfig.__post_init__`)."""
    world_size = int(os.environ["WORLD_SIZE"])  # (under `accelerate launch` the group starts with the trainer)
    runs = ACCELERATE_RUNS if route == "yaml" else [run for run in ACCELERATE_RUNS if run[0] == "sft"]
    for kind, num_rejected, overrides in runs:
        if route == "config":
            from accelerate import ParallelismConfig

            overrides = {**overrides, "parallelism_config": ParallelismConfig(sp_size=world_size, sp_backend="deepspeed")}
        trainer = mode_trainer(kind, out_dir / f"accelerate_{kind}", tokenizer, num_rejected, **overrides)
        groups = trainer.sp_groups
        assert groups is not None and groups.mode == "ulysses" and groups.ulysses_size == world_size, kind
        assert trainer.accelerator.parallelism_config is None or not trainer.accelerator.parallelism_config.sp_enabled
        trainer.train()
        state = final_state(trainer)  # on every rank: `evaluate()` and `predict()` are collective
        if dist.get_rank() == 0:
            state["distributed_type"] = str(trainer.accelerator.distributed_type)
            torch.save(state, out_dir / f"accelerate_{route}_{kind}.pt")
        del trainer


def gloo_worker(rank: int, world_size: int, out_dir: str, tasks: list[str]) -> None:
    """Entry point for `run_on_gloo_ranks`: tell accelerate about the already initialised world, run the tasks."""
    set_distributed_env(rank, world_size)
    out = Path(out_dir)
    tokenizer = build_chat_tokenizer()
    for task in tasks:
        if task == "step":
            run_step_task(out, world_size, tokenizer)
        elif task == "shared_step":
            run_shared_step_task(out, world_size, tokenizer)
        elif task.startswith("mode:"):  # "mode:ulysses" or "mode:hybrid:2"
            _, mode, *ulysses = task.split(":")
            run_modes_task(out, world_size, tokenizer, mode, int(ulysses[0]) if ulysses else None)
        elif task.startswith(("tiled:", "offload:", "selective:")):  # "tiled:ring", "offload:ulysses", ...
            tag, _, mode = task.partition(":")
            run_tiled_task(out, world_size, tokenizer, mode, tag)
        elif task == "accelerate_config":
            run_accelerate_task(out, tokenizer, "config")
        elif task == "bad_configs":
            run_bad_config_task(out, world_size, tokenizer)
        elif task.startswith("train"):  # "train", "train:grm,sft" or "train@ulysses:disrm"
            head, _, kinds = task.partition(":")
            mode = head.partition("@")[2] or "ring"
            run_train_task(out, 2, tokenizer, kinds.split(",") if kinds else KINDS, mode)
        else:
            raise ValueError(f"unknown task {task!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--task", choices=["step", "train", "accelerate_yaml"], required=True)
    parser.add_argument("--sequence_parallel_size", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    cli = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(cli.out_dir)
    tokenizer = build_chat_tokenizer()
    try:
        if cli.task == "train":
            run_train_task(out, cli.sequence_parallel_size, tokenizer, cli.kinds)
        elif cli.task == "accelerate_yaml":
            run_accelerate_task(out, tokenizer, "yaml")
        else:
            run_step_task(out, int(os.environ["WORLD_SIZE"]), tokenizer)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        # As `trl_longrm.train` does: a gloo group left to static destructors can abort a rank at exit.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
