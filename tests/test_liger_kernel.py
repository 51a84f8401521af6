"""`use_liger_kernel=True` (a TrainingArguments field) with our trainers' sparse heads.

`Trainer.train()` calls `liger_kernel.transformers._apply_liger_kernel_to_instance(model, **liger_kernel_config)`.
Liger's fused linear cross-entropy, on by default, then sets `model.forward` to its own forward (for any model
instance: `model.forward = MethodType(lce_forward, model)`), which would remove our sparse LM head and last-token
score head. liger-kernel needs Triton and a GPU, so a stand-in with that behaviour replaces it here: the trainers
must keep their heads (Liger's layer kernels only, as TRL's SFTTrainer does) and refuse the fused cross-entropy by
name.
"""

from __future__ import annotations

import sys
import types

import pytest
import transformers.integrations.liger
from datasets import Dataset
from trainer_helpers import cpu_args
from transformers.modeling_outputs import CausalLMOutputWithPast

from trl_longrm import (
    LongSFTConfig,
    LongSFTTrainer,
    SimPODisRMConfig,
    SimPODisRMTrainer,
    SimPOGRMConfig,
    SimPOGRMTrainer,
)
from trl_longrm.testing_utils import build_tiny_model


@pytest.fixture
def liger(monkeypatch):
    """A stand-in for liger-kernel: records each configuration applied and, with the fused linear cross-entropy
    (Liger's default), replaces the instance's forward by one computing the full logits, as Liger does."""
    applied = []

    def apply_to_instance(model, **config):
        applied.append(config)
        if config.get("fused_linear_cross_entropy", True):

            def lce_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
                backbone = getattr(self, self.base_model_prefix)
                hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
                return CausalLMOutputWithPast(logits=self.lm_head(hidden.last_hidden_state))

            model.forward = types.MethodType(lce_forward, model)

    package = types.ModuleType("liger_kernel")
    package.transformers = types.ModuleType("liger_kernel.transformers")
    package.transformers._apply_liger_kernel_to_instance = apply_to_instance
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", package.transformers)
    monkeypatch.setattr(transformers.integrations.liger, "is_liger_kernel_available", lambda: True)
    return applied


def preference_rows():
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"question {i} about the river"}],
                "chosen": f"the answer is {i}",
                "rejected": ["no idea", "the city"],
            }
            for i in range(4)
        ]
    )


def sft_rows():
    return Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": f"question {i}"},
                    {"role": "assistant", "content": f"answer {i}"},
                ]
            }
            for i in range(4)
        ]
    )


def build(kind, tokenizer, tmp_path, **overrides):
    args = cpu_args(tmp_path, max_length=256, max_steps=1, use_liger_kernel=True, **overrides)
    if kind == "grm":
        model = build_tiny_model("qwen3", "causal-lm", tokenizer, seed=1)
        return SimPOGRMTrainer(
            model=model, args=SimPOGRMConfig(**args), train_dataset=preference_rows(), processing_class=tokenizer
        )
    if kind == "disrm":
        model = build_tiny_model("qwen3", "seq-cls", tokenizer, seed=1)
        return SimPODisRMTrainer(
            model=model, args=SimPODisRMConfig(**args), train_dataset=preference_rows(), processing_class=tokenizer
        )
    model = build_tiny_model("qwen3", "causal-lm", tokenizer, seed=1)
    with pytest.warns(FutureWarning, match="use_liger_kernel"):  # stock SFTTrainer's deprecation warning
        return LongSFTTrainer(
            model=model, args=LongSFTConfig(**args), train_dataset=sft_rows(), processing_class=tokenizer
        )


@pytest.mark.parametrize("kind", ["grm", "disrm", "sft"])
def test_liger_kernels_applied_without_replacing_the_sparse_heads(tmp_path, tokenizer, liger, kind):
    """Training applies Liger's kernels without its fused cross-entropy (TRL's SFTTrainer's choice), so our heads
    stay and the step trains; the user's other Liger settings pass through."""
    trainer = build(kind, tokenizer, tmp_path, liger_kernel_config={"rms_norm": False})
    forward = trainer.model.forward
    trainer.train()
    assert liger == [{"rms_norm": False, "fused_linear_cross_entropy": False}]
    assert trainer.model.forward == forward  # our head's forward, not Liger's
    assert trainer.state.log_history[-1]["train_loss"] > 0


@pytest.mark.parametrize("kind", ["grm", "disrm", "sft"])
def test_liger_fused_cross_entropy_refused_by_name(tmp_path, tokenizer, liger, kind):
    """Asking for Liger's fused cross-entropy is an error at construction, naming the field (SFTTrainer's own error
    for LongSFTTrainer)."""
    with pytest.raises(ValueError, match=r'liger_kernel_config=\{"fused_linear_cross_entropy": True\}'):
        build(kind, tokenizer, tmp_path, liger_kernel_config={"fused_linear_cross_entropy": True})
    assert liger == []
