"""Fused LoRA: fewer, larger kernels for PEFT's LoRA layers (`fused_lora=True` in every config of this package).

PEFT computes a LoRA layer as `base(x) + lora_B(lora_A(dropout(x))) * scaling`: two skinny matmuls, then a scaling
and an addition over the layer's whole output, in forward, in the recompute of gradient checkpointing and again in
backward. With adapters on every linear layer of an 8B model at 32K tokens those elementwise passes over the
projections' outputs (4096 + 1024 + 1024 + 4096 + 3 x 14336 features a token per layer) are several percent of a
step. Here instead:

- the scaling is folded into B (`B * scaling`, an `r x out` product) and the adapter is added into the base layer's
  output by the matmul itself (`addmm(base(x), x A^T, (s B)^T)`: cuBLAS's beta = 1 epilogue), no separate pass;
- layers that read the same input (a decoder layer's q/k/v projections, its MLP's gate/up) compute `x A^T` as one
  matmul against their A matrices concatenated (`x` read once; in backward one matmul gives their input gradient
  instead of three plus two additions of hidden-state-sized tensors).

The same function of the same parameters: PEFT's result up to the order of floating-point sums (equal gradients to
1e-6 in float32: tests/test_fused_lora.py); adapters, checkpoints and `merge_and_unload` are PEFT's own. A layer
(or a call) the fused path cannot serve runs PEFT's forward unchanged: a LoRA variant (DoRA...), dropout in training,
a LoRA bias, several active adapters, merged or disabled adapters, mixed-batch `adapter_names`, and quantized base
layers (QLoRA's LoRA classes are others than `peft.tuners.lora.Linear`).

Example:
```python
>>> from trl_longrm import SimPODisRMConfig
>>> args = SimPODisRMConfig(output_dir="disrm", fused_lora=True)  # with a peft_config: its LoRA layers fused
```
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn


logger = logging.getLogger(__name__)

FUSED_MARK = "_longrm_fused_lora"
# Projections of a decoder layer that read the same input, by the names transformers' decoders give them.
INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _active_adapter(module: nn.Module) -> str | None:
    """The one active adapter of a LoRA layer, or None where it has several (or none)."""
    active = [name for name in module.active_adapters if name in module.lora_A]
    return active[0] if len(active) == 1 else None


def unfusable_reason(module: nn.Module) -> str | None:
    """Why the fused path cannot serve this LoRA layer as it is configured (None: it can)."""
    from peft.tuners.lora import Linear as LoraLinear

    if type(module) is not LoraLinear:
        return f"{type(module).__name__} (a quantized or other LoRA layer)"
    name = _active_adapter(module)
    if name is None:
        return "several active adapters"
    if name in getattr(module, "lora_variant", {}):
        return f"a LoRA variant ({type(module.lora_variant[name]).__name__})"
    if module.lora_B[name].bias is not None:
        return "a LoRA bias"
    dropout = module.lora_dropout[name]
    if not isinstance(dropout, nn.Identity) and getattr(dropout, "p", 0.0) > 0:
        return f"lora_dropout={dropout.p}"
    return None


class _SharedInput:
    """The LoRA layers of a decoder layer that read the same input: whichever is called first with an input computes
    `x A^T` for all of them in one matmul, and each of the others takes its slice when called with that same input
    (checked by identity; a layer called with another input computes its own)."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self._input = None  # weak reference to the input whose products are pending
        self._pending: dict[int, torch.Tensor] = {}

    def down(self, module: nn.Module, x: torch.Tensor, name: str) -> torch.Tensor:
        if self._input is not None and self._input() is x and id(module) in self._pending:
            return self._pending.pop(id(module))
        members = [m for m in self.modules if m is module or (_fusable_call(m) and _active_adapter(m) == name)]
        if len(members) == 1:
            return torch.nn.functional.linear(x, module.lora_A[name].weight)
        weights = [m.lora_A[name].weight for m in members]
        if len({w.dtype for w in weights}) > 1:
            return torch.nn.functional.linear(x, module.lora_A[name].weight)
        products = torch.nn.functional.linear(x, torch.cat(weights)).split([w.shape[0] for w in weights], dim=-1)
        self._pending = {id(m): p for m, p in zip(members, products) if m is not module}
        self._input = weakref.ref(x)
        return products[members.index(module)]


def _fusable_call(module: nn.Module) -> bool:
    """Whether this call of the layer can take the fused path (its configuration, and its state now)."""
    if module.disable_adapters or module.merged:
        return False
    return unfusable_reason(module) is None


def _fused_forward(module: nn.Module, peft_forward, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    # (Extra arguments are PEFT's: mixed-batch `adapter_names`, a variant's keys.)
    if args or kwargs or not _fusable_call(module):
        return peft_forward(x, *args, **kwargs)
    name = _active_adapter(module)
    result = module.base_layer(x)
    weight = module.lora_A[name].weight
    autocast = torch.is_autocast_enabled(x.device.type)
    if not autocast:  # PEFT computes the adapter in its weights' dtype, and adds it to the base output there
        x = x.to(weight.dtype)
    shared = getattr(module, "_longrm_shared_input", None)
    down = shared.down(module, x, name) if shared is not None else torch.nn.functional.linear(x, weight)
    up = module.lora_B[name].weight * module.scaling[name]  # [out, r]: the scaling folded into B
    flat = result.reshape(-1, result.shape[-1])
    if not autocast:
        flat = flat.to(weight.dtype)
    out = torch.addmm(flat, down.reshape(-1, down.shape[-1]), up.t())
    return out.view(result.shape).to(result.dtype)


def apply_fused_lora(model: nn.Module) -> int:
    """Give every PEFT LoRA `Linear` of `model` the fused forward (module docstring), its q/k/v and gate/up layers
    sharing their input's down-projection; returns how many layers can take it. Raises if the model has no LoRA
    layer (`fused_lora=True` would do nothing); logs which layers keep PEFT's forward and why. Idempotent.

    Example:
    ```python
    >>> model = get_peft_model(base_model, LoraConfig(target_modules="all-linear"))
    >>> apply_fused_lora(model)
    ```
    """
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # PEFT not installed: no LoRA layers
        LoraLayer = ()  # noqa: N806
    layers = {name: m for name, m in model.named_modules() if LoraLayer and isinstance(m, LoraLayer)}
    if not layers:
        raise ValueError(
            f"fused_lora=True: {type(model).__name__} has no LoRA layers to fuse (it fuses PEFT LoRA adapters: pass a "
            "LoRA peft_config, or leave fused_lora unset)."
        )
    fusable, reasons = 0, {}
    for name, module in layers.items():
        reason = unfusable_reason(module)
        if reason is not None:
            reasons.setdefault(reason, []).append(name)
            continue
        fusable += 1
        if not getattr(module, FUSED_MARK, False):
            peft_forward = module.forward
            module.forward = lambda x, *a, _m=module, _f=peft_forward, **k: _fused_forward(_m, _f, x, *a, **k)
            setattr(module, FUSED_MARK, True)
    for reason, names in reasons.items():
        logger.warning("fused_lora: %d LoRA layers keep PEFT's forward (%s), e.g. %s.", len(names), reason, names[0])
    # Layers reading the same input, by their parent module (a decoder layer's attention or MLP).
    for parent in model.modules():
        for group in INPUT_GROUPS:
            members = [getattr(parent, child, None) for child in group]
            members = [m for m in members if m is not None and getattr(m, FUSED_MARK, False)]
            if len(members) > 1:
                shared = _SharedInput(members)
                for member in members:
                    member._longrm_shared_input = shared
    return fusable


__all__ = ["apply_fused_lora", "unfusable_reason"]
