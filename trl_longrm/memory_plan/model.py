"""The model a plan traces: a stage's model class built from a config (fake weights under `HybridFakeMode`, or a
skeleton on the meta device)."""

from __future__ import annotations

import copy

import torch


def build_model(stage: str, model_config, dtype: torch.dtype | None):
    """The stage's model (causal LM, or a 1-label sequence classifier) built from `model_config` with fake weights
    (call under `HybridFakeMode`), in `dtype` (None: the config's `dtype`, else float32)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = copy.deepcopy(model_config)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    previous = torch.get_default_dtype()
    # Built in its dtype: `.to(dtype)` on fake weights cannot swap the parameters (platform notes, 2026-11-26).
    torch.set_default_dtype(dtype)
    try:
        if stage == "simpo_disrm":
            config.num_labels = 1
            return AutoModelForSequenceClassification.from_config(config, dtype=dtype)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
