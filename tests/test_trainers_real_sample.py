"""The real LongRM training sample (../shared) through both preference trainers, raw format in."""

import logging

import pytest
import torch
from trainer_helpers import cpu_args

from trl_longrm import SimPODisRMConfig, SimPODisRMTrainer, SimPOGRMConfig, SimPOGRMTrainer
from trl_longrm.data import load_raw_dataset
from trl_longrm.testing_utils import build_tiny_model


@pytest.mark.parametrize(
    "trainer_cls,config_cls,task",
    [(SimPOGRMTrainer, SimPOGRMConfig, "causal-lm"), (SimPODisRMTrainer, SimPODisRMConfig, "seq-cls")],
)
def test_real_sample_trains_one_step(tmp_path, tokenizer, shared_sample_path, caplog, trainer_cls, config_cls, task):
    raw = load_raw_dataset(str(shared_sample_path), split="train").select(range(2))
    assert "chat_template" in raw.column_names and "rejects" in raw.column_names  # the original LongRM format
    model = build_tiny_model("qwen3", task, tokenizer, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = config_cls(**cpu_args(tmp_path, max_length=4096, max_steps=1, per_device_train_batch_size=2))
    with caplog.at_level(logging.WARNING):
        trainer = trainer_cls(model=model, args=args, train_dataset=raw, processing_class=tokenizer)
    # Contexts of ~100K tiny-tokenizer tokens: every prompt is cut in the middle to fit, and that is reported.
    assert "2 truncated" in caplog.text, caplog.text
    group = trainer.train_dataset[0]
    assert len(group["rejected_completion_ids"]) == 4
    longest = max(len(c) for c in [group["chosen_completion_ids"], *group["rejected_completion_ids"]])
    assert len(group["prompt_ids"]) + longest <= 4096
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
