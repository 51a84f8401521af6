"""`trainer.train()` end to end for each trainer: learning, checkpoints, resume, LoRA."""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from trainer_helpers import cpu_args, learnable_groups
from transformers.trainer_utils import get_last_checkpoint

from trl_longrm import (
    LongSFTConfig,
    LongSFTTrainer,
    SimPODisRMConfig,
    SimPODisRMTrainer,
    SimPOGRMConfig,
    SimPOGRMTrainer,
)
from trl_longrm.memory.lora_input_cast import HOOKED_MARK
from trl_longrm.testing_utils import save_tiny_model


KINDS = {
    "grm": (SimPOGRMTrainer, SimPOGRMConfig, "causal-lm", "CAUSAL_LM"),
    "disrm": (SimPODisRMTrainer, SimPODisRMConfig, "seq-cls", "SEQ_CLS"),
    "sft": (LongSFTTrainer, LongSFTConfig, "causal-lm", "CAUSAL_LM"),
}


def dataset_for(kind, tokenizer):
    groups = learnable_groups(tokenizer, 8, 2, seed=5)
    if kind != "sft":
        return groups
    return Dataset.from_list(
        [
            {
                "input_ids": g["prompt_ids"] + g["chosen_completion_ids"],
                "completion_mask": [0] * len(g["prompt_ids"]) + [1] * len(g["chosen_completion_ids"]),
            }
            for g in groups
        ]
    )


def make_trainer(kind, model_path, output_dir, tokenizer, peft_config=None, **overrides):
    trainer_cls, config_cls, _, _ = KINDS[kind]
    settings = dict(
        per_device_train_batch_size=2, learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, max_steps=8
    )
    args = config_cls(**cpu_args(output_dir, **{**settings, **overrides}))
    return trainer_cls(
        model=model_path,
        args=args,
        train_dataset=dataset_for(kind, tokenizer),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "causal-lm": save_tiny_model(root / "lm", arch="qwen3", task="causal-lm", seed=7),
        "seq-cls": save_tiny_model(root / "cls", arch="llama", task="seq-cls", seed=7),
    }


@pytest.mark.parametrize("kind", list(KINDS))
def test_train_learns_saves_and_resumes_exactly(tmp_path, tokenizer, model_paths, kind):
    path = model_paths[KINDS[kind][2]]
    full = make_trainer(kind, path, tmp_path / "full", tokenizer, save_strategy="steps", save_steps=4)
    full.train()
    losses = [log["loss"] for log in full.state.log_history if "loss" in log]
    assert len(losses) == 8
    assert sum(losses[-2:]) / 2 < 0.7 * sum(losses[:2]) / 2, losses
    assert get_last_checkpoint(str(tmp_path / "full")).endswith("checkpoint-8")
    logged = full.state.log_history[0]
    assert logged["num_tokens"] > 0
    if kind == "grm":
        assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "nll_loss"} <= set(
            logged
        )

    resumed = make_trainer(kind, path, tmp_path / "resumed", tokenizer, save_strategy="steps", save_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))
    final = dict(full.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, final[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("kind", list(KINDS))
def test_lora_trains_adapters_and_score_head(tmp_path, tokenizer, model_paths, kind):
    task_type = KINDS[kind][3]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type=task_type)
    trainer = make_trainer(kind, model_paths[KINDS[kind][2]], tmp_path, tokenizer, peft_config=lora, max_steps=3)
    # Every LoRA projection skips PEFT's input copy under autocast (tests/test_lora_input_cast.py: exact).
    lora_linears = [m for m in trainer.model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]
    assert lora_linears and all(getattr(m, HOOKED_MARK, False) for m in lora_linears)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert any("lora_B" in n for n in changed)
    assert all("lora_" in n or "modules_to_save" in n for n in changed), sorted(changed)
    if kind == "disrm":
        assert any("score" in n and "modules_to_save" in n for n in changed), "the score head must train"


def test_lora_with_checkpointing_frees_each_micro_batchs_input_embeddings(tmp_path, tokenizer, model_paths):
    """PEFT with gradient checkpointing makes the input embeddings' output a leaf that requires grad
    (`enable_input_require_grads`): it and its `.grad` are freed after each micro-batch's backward, as the memory plan
    assumes (tests/test_memory_plan.py::test_the_trace_frees_each_micro_batchs_input_embeddings)."""
    import weakref

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="SEQ_CLS")
    trainer = make_trainer("disrm", model_paths["seq-cls"], tmp_path, tokenizer, peft_config=lora, max_steps=2,
                           gradient_accumulation_steps=2, gradient_checkpointing=True,
                           gradient_checkpointing_kwargs={"use_reentrant": False})  # fmt: skip
    outputs, seen = [], []

    def record(module, args, output):
        seen.append((output.is_leaf and output.requires_grad, sum(ref() is not None for ref in outputs)))
        outputs.append(weakref.ref(output))

    trainer.model.get_input_embeddings().register_forward_hook(record)  # after enable_input_require_grads' hook
    trainer.train()
    assert seen == [(True, 0)] * 4


@pytest.mark.parametrize("kind", list(KINDS))
def test_ddp_keeps_gradients_in_its_buckets(tmp_path, tokenizer, model_paths, kind):
    # Under DDP (every multi-process run, sequence parallelism included) the gradients are views of the all-reduce
    # buckets rather than a second model-sized copy on every rank.
    trainer = make_trainer(kind, model_paths[KINDS[kind][2]], tmp_path, tokenizer, max_steps=1)
    assert trainer.accelerator.ddp_handler.to_kwargs().get("gradient_as_bucket_view") is True


@pytest.mark.parametrize("kind", ["grm", "disrm", "sft"])
def test_a_packed_dataset_passed_again_is_not_packed_twice(tmp_path, tokenizer, model_paths, kind):
    """A trainer's prepared (packed) train and eval sets, passed to a new trainer, train the same as the raw data."""
    path = model_paths[KINDS[kind][2]]
    packing = {"max_tokens_per_row": 400} if kind != "sft" else {"max_tokens_per_row": 400, "packing": True}
    settings = dict(per_device_train_batch_size=1, max_steps=3, eval_strategy="no", **packing)
    first = make_trainer(kind, path, tmp_path / "a", tokenizer, **settings)
    packed = first.train_dataset
    assert "num_tokens" in packed.column_names and len(packed) < len(dataset_for(kind, tokenizer))
    trainer_cls, config_cls, _, _ = KINDS[kind]
    args = config_cls(**cpu_args(tmp_path / "b", learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, **settings))
    second = trainer_cls(model=path, args=args, train_dataset=packed, eval_dataset=packed, processing_class=tokenizer)
    assert second.train_dataset.to_list() == packed.to_list() and second.eval_dataset.to_list() == packed.to_list()
    first.train()
    second.train()
    for (name, a), b in zip(first.model.named_parameters(), second.model.parameters()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("kind", ["grm", "disrm"])
def test_eval_dataset_dict_and_compute_metrics(tmp_path, tokenizer, model_paths, kind):
    """A dict of eval sets is evaluated set by set, and `compute_metrics` / `predict()` get per-group predictions."""
    from datasets import DatasetDict

    data = dataset_for(kind, tokenizer)
    evals = DatasetDict({"first": data.select(range(3)), "second": data.select(range(3, 8))})
    seen = {}

    def compute_metrics(prediction):
        seen["shape"] = tuple(prediction.predictions.shape)
        return {"groups": float(prediction.predictions.shape[0])}

    trainer_cls, config_cls, task, _ = KINDS[kind]
    # One eval batch per set: logged eval metrics are means over batches, as in TRL.
    args = config_cls(**cpu_args(tmp_path, max_steps=1, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8))
    trainer = trainer_cls(
        model=model_paths[task],
        args=args,
        train_dataset=data,
        eval_dataset=evals,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    trainer.train()
    logged = {k for h in trainer.state.log_history for k in h}
    assert {"eval_first_loss", "eval_second_loss", "eval_first_groups", "eval_second_groups"} <= logged
    output = trainer.predict(evals["second"])
    assert output.metrics["test_groups"] == 5.0 and output.predictions.shape[0] == 5
    # Predictions are each group's (chosen, mean rejected) reward or score: they give the logged metrics.
    metrics = trainer.evaluate(evals["second"])
    assert seen["shape"] == (5, 2)
    chosen, rejected = output.predictions[:, 0], output.predictions[:, 1]
    if kind == "grm":
        assert metrics["eval_rewards/chosen"] == pytest.approx(float(chosen.mean()), rel=1e-5)
        assert metrics["eval_rewards/rejected"] == pytest.approx(float(rejected.mean()), rel=1e-5)
    else:
        assert metrics["eval_accuracy"] == pytest.approx(float((chosen > rejected).mean()), rel=1e-5)
        assert metrics["eval_margin"] == pytest.approx(float((chosen - rejected).mean()), rel=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_row_metadata_built_once_per_step_in_the_users_settings(tmp_path, tokenizer, model_paths, kind,
                                                                       monkeypatch):  # fmt: skip
    """On one process a packed row's attention metadata is built once per forward by the trainer (not in every layer
    and every recompute of gradient checkpointing, with a host sync each), in the user's ring settings."""
    from trl_longrm.sequence_parallel import attention
    from trl_longrm.trainers import parallel

    built = []
    build = parallel.packed_row_metadata

    def counted(position_ids, config=None):
        built.append(build(position_ids, config))
        return built[-1]

    def per_layer(*args, **kwargs):
        raise AssertionError("the attention derived a packed row's documents from position_ids itself")

    monkeypatch.setattr(parallel, "packed_row_metadata", counted)
    monkeypatch.setattr(attention, "packed_row_metadata", per_layer)
    layout = {} if kind == "sft" else {"shared_prefix": False}  # plain packed rows (shared ones have their own)
    trainer = make_trainer(kind, model_paths[KINDS[kind][2]], tmp_path, tokenizer, max_steps=2, gradient_checkpointing=True,
                           ring_attn_backend="torch", ring_head_stride=1, **layout)  # fmt: skip
    trainer.train()
    assert len(built) == 2  # one forward per step
    assert {(meta.backend, meta.ring_head_stride) for meta in built} == {("torch", 1)}
