"""LoRA layers that skip PEFT's copy of their input under mixed precision.

PEFT keeps LoRA adapters in float32 while the base model is in bf16 (`autocast_adapter_dtype=True`, its default) and
casts each LoRA layer's input to the adapter's dtype before `lora_A`. Under autocast (TRL's `bf16=True`), `lora_A`'s
matmul then casts that float32 copy straight back to bf16 and saves the bf16 copy for its backward. The values are the
input's own (bf16 -> float32 -> bf16 is exact), but the memory is not: for every LoRA projection a float32 copy of its
input (transient) and a bf16 copy kept until the backward, beside the input the base layer already keeps. With
`all-linear` adapters on Llama-3.1-8B that is 4 bf16 copies of a layer's hidden states saved by the attention
projections (q, k, v, o), and at 512K tokens on one GPU several GiB.

`skip_lora_input_casts_under_autocast(model)` registers forward hooks on each plain LoRA `Linear` that turn PEFT's cast
off for the call (`cast_input_dtype_enabled`, PEFT's own switch) exactly when autocast is on for the input's device, and
otherwise leave the switch as it is. Only where the result is the same bit for bit: vanilla LoRA (no DoRA or other
variant, whose extra terms PEFT computes in the adapter's dtype) without dropout (dropout would scale the bf16 input
instead of its float32 copy).
"""

from __future__ import annotations

import torch
from torch import nn


HOOKED_MARK = "_longrm_lora_input_cast_hook"


def _cast_is_a_copy(module: nn.Module, x) -> bool:
    """Whether PEFT's cast of `x` to the adapter's dtype only makes a copy that autocast casts back for the matmul."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return False
    if not torch.is_autocast_enabled(x.device.type):
        return False
    if getattr(module, "lora_variant", None):  # DoRA and the like
        return False
    return all(isinstance(dropout, nn.Identity) for dropout in module.lora_dropout.values())


def _pre_hook(module: nn.Module, args, kwargs):
    # The switch as the user (or PEFT's `disable_input_dtype_casting`) left it is restored after the call.
    module._longrm_cast_setting = module.cast_input_dtype_enabled
    if _cast_is_a_copy(module, args[0] if args else kwargs.get("x")):
        module.cast_input_dtype_enabled = False


def _post_hook(module: nn.Module, args, kwargs, output):
    module.cast_input_dtype_enabled = module._longrm_cast_setting


def skip_lora_input_casts_under_autocast(model: nn.Module) -> int:
    """Register the hooks (see the module docstring) on every plain LoRA `Linear` of `model`; returns how many
    layers have it. Idempotent; a model without PEFT LoRA layers is left alone.

    Example:
        >>> model = get_peft_model(base_model, LoraConfig(target_modules="all-linear"))
        >>> skip_lora_input_casts_under_autocast(model)
        >>> with torch.autocast("cuda", dtype=torch.bfloat16):
        ...     loss = model(**batch).loss  # the same loss and gradients, without the LoRA input copies
    """
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # PEFT not installed: no LoRA layers
        return 0
    hooked = 0
    for module in model.modules():
        # The exact class: subclasses (quantized LoRA layers) cast their inputs their own way.
        if type(module) is not LoraLinear:
            continue
        if not getattr(module, HOOKED_MARK, False):
            module.register_forward_pre_hook(_pre_hook, with_kwargs=True)
            module.register_forward_hook(_post_hook, with_kwargs=True, always_call=True)
            setattr(module, HOOKED_MARK, True)
        hooked += 1
    return hooked
