"""`use_liger_kernel=True` (a TrainingArguments field) with our trainers' sparse heads.

`Trainer.train()` calls `liger_kernel.transformers._apply_liger_kernel_to_instance(model, **liger_kernel_config)`.
Liger's fused linear cross-entropy, on by default, then sets `model.forward` to its own forward (for any model
instance: `model.forward = MethodType(lce_forward, model)`), which would remove our sparse LM head and last-token
score head. liger-kernel needs Triton and a GPU, so a stand-in with that behaviour replaces it here: the trainers
must keep their heads (Liger's layer kernels only, as TRL's SFTTrainer does) and refuse the fused cross-entropy by
name. Liger's layer kernels are bound to the instance's modules the same way (`_bind_method_to_module`: the decoder
layers' MLPs and RMSNorms get Liger's `forward` in `train()`), which must not undo `mlp_tile_tokens`.
"""

from __future__ import annotations

import collections
import sys
import types

import pytest
import torch
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
from trl_longrm.memory.tiled_mlp import decoder_mlps, decoder_norms, tiled_tokens
from trl_longrm.testing_utils import build_tiny_model


class Applied(list):
    """The configurations the stand-in applied, and how often each of its layer kernels ran (`calls`)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()


def _bind_method_to_module(module, method_name, new_method):
    # liger_kernel.transformers.monkey_patch._bind_method_to_module (0.8.5), as Liger binds its kernels to an instance.
    module.__dict__[method_name] = new_method.__get__(module, module.__class__)


@pytest.fixture
def liger(monkeypatch):
    """A stand-in for liger-kernel: records each configuration applied and, with the fused linear cross-entropy
    (Liger's default), replaces the instance's forward by one computing the full logits, as Liger does; its SwiGLU
    and RMSNorm kernels (on by default) are bound to the decoder layers' modules as Liger binds them, computing what
    the modules compute in PyTorch, and counted in `applied.calls`."""
    applied = Applied()

    def swiglu_forward(self, x):
        applied.calls["swiglu"] += 1
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def rms_norm_forward(self, hidden_states):
        applied.calls["rms_norm"] += 1
        hidden = hidden_states.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden.to(hidden_states.dtype)

    def apply_to_instance(model, **config):
        applied.append(config)
        # apply_liger_kernel_to_qwen3(model=...): the backbone's final norm, and per layer the MLP and the norms.
        base_model = getattr(model, model.base_model_prefix, model)
        if config.get("rms_norm", True):
            _bind_method_to_module(base_model.norm, "forward", rms_norm_forward)
        for layer in base_model.layers:
            if config.get("swiglu", True):
                _bind_method_to_module(layer.mlp, "forward", swiglu_forward)
            if config.get("rms_norm", True):
                for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm,
                             layer.self_attn.k_norm):  # fmt: skip
                    _bind_method_to_module(norm, "forward", rms_norm_forward)
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


@pytest.mark.parametrize("kind", ["grm", "disrm", "sft"])
def test_liger_kernels_run_tiled_with_mlp_tile_tokens(tmp_path, tokenizer, liger, kind):
    """`mlp_tile_tokens` with `use_liger_kernel=True`: Liger binds its kernels to the MLPs and RMSNorms in `train()`,
    after the trainer tiled them; the tiling is applied again around Liger's forwards at the next forward, so Liger's
    kernels run over slices of at most `mlp_tile_tokens` tokens, and a module counts as tiled only while its forward
    is the tiled one."""
    trainer = build(kind, tokenizer, tmp_path, mlp_tile_tokens=8)
    model = trainer.accelerator.unwrap_model(trainer.model)
    modules = [*decoder_mlps(model), *decoder_norms(model)]
    assert all(tiled_tokens(module) == 8 for module in modules)
    sizes, rows = [], []
    for mlp in decoder_mlps(model):
        mlp.gate_proj.register_forward_hook(lambda module, args, output: sizes.append(args[0].shape[-2]))
    model.get_input_embeddings().register_forward_hook(lambda module, args, output: rows.append(args[0].shape[-1]))
    trainer.train()
    assert liger.calls["swiglu"] > 0 and liger.calls["rms_norm"] > 0  # Liger's kernels ran ...
    assert max(sizes) == 8 < max(rows)  # ... over slices
    assert all(tiled_tokens(module) == 8 for module in modules)
    assert trainer.state.log_history[-1]["train_loss"] > 0
    # Liger bound again (a second `train()`): the modules are not tiled until the next forward tiles them again.
    sys.modules["liger_kernel.transformers"]._apply_liger_kernel_to_instance(model, fused_linear_cross_entropy=False)
    assert not any(tiled_tokens(module) for module in modules)
