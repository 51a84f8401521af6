"""Partial gradient checkpointing: the first N decoder layers keep their activations, the others are checkpointed.

Gradient checkpointing recomputes each layer's forward in backward: with LoRA on an 8B model at 32K tokens about a
quarter of the step, while the run used 23 of the H200's 140 GiB. Every layer left unchecked saves its recompute and
keeps its activations from forward to backward instead (a layer's worth per layer), so a run that has memory to spare
leaves as many layers unchecked as fit: `gradient_checkpointing_kwargs={"unchecked_layers": N}`, in every trainer of
this package, beside transformers' own `every_n_layers` (which checkpoints every n-th layer) and our `selective`
(which keeps the attention outputs of the layers that are checkpointed). The memory plan traces it like any other
setting and proposes the largest N that fits (`trl_longrm.memory_plan.plan.largest_unchecked_layers`).

Which layers are left unchecked does not change the peak (every unchecked layer's activations are live when backward
starts); the first ones are, as Megatron-LM's `recompute_method="block"` checkpoints the last ones of each stage.

Example:
```python
>>> from trl_longrm import SimPODisRMConfig
>>> args = SimPODisRMConfig(output_dir="disrm", gradient_checkpointing=True,
...                         gradient_checkpointing_kwargs={"unchecked_layers": 12, "selective": True})
```
"""

from __future__ import annotations

import functools

from torch import nn


UNCHECKED_KEY = "unchecked_layers"  # in `gradient_checkpointing_kwargs`
_PARTIAL_MARK = "_longrm_partial_checkpointing"  # on a backbone whose `activation_checkpointing_enable` is wrapped


def unchecked_layers(args) -> int:
    """The number of first decoder layers the training arguments leave unchecked (0 without checkpointing)."""
    if not getattr(args, "activation_checkpointing", False):
        return 0
    return int((getattr(args, "activation_checkpointing_kwargs", None) or {}).get(UNCHECKED_KEY, 0))


def check_partial_checkpointing_args(args) -> None:
    """Refuse an `unchecked_layers` that cannot be honoured, at configuration time: it must be an integer of at least
    0, and it needs gradient checkpointing (without it no layer is checkpointed to begin with)."""
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or {}
    if UNCHECKED_KEY not in kwargs:
        return
    value = kwargs[UNCHECKED_KEY]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"gradient_checkpointing_kwargs={{'{UNCHECKED_KEY}': {value!r}}}: `{UNCHECKED_KEY}` must be an integer "
            ">= 0 (the number of first decoder layers that keep their activations instead of being checkpointed)."
        )
    if value and not args.activation_checkpointing:
        raise ValueError(
            f"`gradient_checkpointing_kwargs={{'{UNCHECKED_KEY}': {value}}}` requires `gradient_checkpointing=True` "
            "(without it every layer keeps its activations already)."
        )


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers that gradient checkpointing can checkpoint, first to last (transformers'
    `GradientCheckpointingLayer`s, in module order)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_partial_checkpointing(model: nn.Module) -> None:
    """Make the model's `activation_checkpointing_enable` (what the HF Trainer calls in `train()`) honour
    `unchecked_layers`: the key is taken out of the checkpoint kwargs (torch's `checkpoint` does not take it), the call
    goes on as before, then the first N decoder layers are switched back to running without checkpointing. Without
    the key the call is unchanged. Wrapped on the backbone instance, as `enable_selective_checkpointing` is;
    idempotent."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if vars(base).get(_PARTIAL_MARK, False):
        return
    enable = base.activation_checkpointing_enable

    @functools.wraps(enable)
    def activation_checkpointing_enable(activation_checkpointing_kwargs=None, *args, **kwargs):
        activation_checkpointing_kwargs = dict(activation_checkpointing_kwargs or {})
        unchecked = activation_checkpointing_kwargs.pop(UNCHECKED_KEY, 0)
        enable(activation_checkpointing_kwargs or None, *args, **kwargs)
        for layer in checkpointed_layers(base)[:unchecked]:
            layer.gradient_checkpointing = False

    vars(base)[_PARTIAL_MARK] = True
    base.activation_checkpointing_enable = activation_checkpointing_enable
