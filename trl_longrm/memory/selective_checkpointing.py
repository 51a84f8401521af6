"""Selective activation checkpointing: gradient checkpointing that keeps each layer's attention output.

Plain gradient checkpointing recomputes a whole decoder layer in backward, attention included. Attention's backward
is irreducible, but its recompute is not: at 32K tokens on an H100 the second forward of the attention kernels is
~10% of a step. TRL's `SFTTrainer` takes `gradient_checkpointing_kwargs={"selective": True}` for this (torch's
selective checkpoint contexts with a policy that saves the attention op's outputs and recomputes the rest); the same
key does it in every trainer of this package, with a policy that knows the kernels our attention paths call:

- the aten ops SDPA dispatches to (flash, memory-efficient, cuDNN, PyTorch's fused CPU attention), which our
  cuDNN (`TorchCudnnOps`) and CPU (`TorchCpuFlashOps`) kernels call directly;
- torch's `varlen_attn` custom op (`torch_attn::_varlen_attn`), which TRL's policy does not match;
- flash-attn's custom ops (namespace `flash_attn`, `flash_attn_3`, or a hashed `_flash_attn2_cuda_*` build), and the
  op a memory plan of a CUDA run traces in their place (`planned_flash_attn_forward`).

Everything else in the layer (norms, projections, rotary, the MLP, the ring's and Ulysses' collectives) is recomputed
as under plain checkpointing. What it costs is each attention call's outputs per layer, kept from forward to backward:
the attention output (as large as the layer's query projection) and its float32 log-sum-exp. The memory plan traces it
like any other saved tensor; at long rows it can cost more than the recompute saves, which is why it is off by default.

Matching happens at the dispatcher, on the operator an attention call runs, so the policy is the same for one process,
packed rows, shared prefixes, a ring (each head chunk's call) and Ulysses.

Example:
```python
>>> from trl_longrm import SimPOGRMConfig
>>> args = SimPOGRMConfig(output_dir="grm", gradient_checkpointing=True,
...                       gradient_checkpointing_kwargs={"selective": True})
```
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from importlib import import_module

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


SELECTIVE_KEY = "selective"  # TRL's key in `gradient_checkpointing_kwargs`

# The aten attention ops whose outputs are kept (those absent from a torch build are skipped).
_ATEN_ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
# torch's varlen attention (`torch.nn.attention.varlen`), a custom op over aten's flash kernel.
_TORCH_VARLEN_OPS = ("_varlen_attn", "_varlen_attn_out")
# Other operators that stand for an attention forward (`register_attention_forward_op`): a memory plan's stand-in for
# flash-attn's forward (`trl_longrm.memory_plan.planned_kernels`).
_REGISTERED_OPS: set = set()


def register_attention_forward_op(op) -> None:
    """Have selective checkpointing keep the outputs of `op` (an `OpOverload`) as an attention kernel's."""
    _REGISTERED_OPS.add(op)
    is_attention_forward_op.cache_clear()


@functools.cache
def _torch_attention_ops() -> frozenset:
    ops = set()
    for name in _ATEN_ATTENTION_OPS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.add(packet.default)
    try:
        import_module("torch.nn.attention.varlen")  # registers the torch_attn ops
    except ImportError:
        pass
    for name in _TORCH_VARLEN_OPS:
        try:
            ops.add(getattr(torch.ops.torch_attn, name).default)
        except (AttributeError, RuntimeError):  # a torch without varlen_attn
            pass
    return frozenset(ops)


@functools.cache  # the policy asks for every op of every checkpointed layer, twice a step: once per operator
def is_attention_forward_op(op) -> bool:
    """Whether `op` (an `OpOverload`) is the forward of an attention kernel whose outputs selective checkpointing
    keeps."""
    if op in _torch_attention_ops() or op in _REGISTERED_OPS:
        return True
    # flash-attn registers its kernels as custom ops: `flash_attn::_flash_attn_varlen_forward` (2.7+),
    # `flash_attn_3::fwd`, or a hashed namespace such as `_flash_attn2_cuda_f12afc9::varlen_fwd`.
    namespace, name = op.namespace, op.name().split("::", 1)[-1]
    return "flash_attn" in namespace and not any(part in name for part in ("backward", "bwd"))


def keep_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective checkpointing policy: keep the attention kernels' outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if is_attention_forward_op(op) else CheckpointPolicy.PREFER_RECOMPUTE


# Whether the code running now is a checkpointed region whose attention outputs are kept (its forward or its
# recompute): the tensors an attention op returns are then the cache's and must not be written to.
_keeping_outputs: contextvars.ContextVar[bool] = contextvars.ContextVar("longrm_keeping_attention_outputs", default=False)


def keeps_attention_outputs() -> bool:
    """Whether selective checkpointing keeps the attention ops' outputs here: a kernel that would write into what an
    attention op returned (the shared-prefix merge) writes into a copy instead (torch refuses a kept tensor that was
    changed, and the recompute would read the changed values)."""
    return _keeping_outputs.get()


@contextlib.contextmanager
def _keeping(context):
    token = _keeping_outputs.set(True)
    try:
        with context:
            yield
    finally:
        _keeping_outputs.reset(token)


def selective_context_fn():
    """The `context_fn` of `torch.utils.checkpoint.checkpoint` for `keep_attention_policy`: torch's selective
    checkpoint contexts for the forward and the recompute, each marking the region as keeping attention outputs."""
    forward_context, recompute_context = create_selective_checkpoint_contexts(keep_attention_policy)
    return _keeping(forward_context), _keeping(recompute_context)


def wants_selective(args) -> bool:
    """Whether the training arguments ask for selective checkpointing (`gradient_checkpointing_kwargs`'s
    `selective`, which transformers resolves into `activation_checkpointing_kwargs`)."""
    return bool((getattr(args, "activation_checkpointing_kwargs", None) or {}).get(SELECTIVE_KEY, False))


def check_selective_checkpointing_args(args) -> None:
    """Refuse what selective checkpointing cannot honour, at configuration time, with TRL's messages: it needs gradient
    checkpointing, and non-reentrant checkpointing (the only kind whose saved tensors a policy can select)."""
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or {}
    if SELECTIVE_KEY not in kwargs:
        return
    value = kwargs[SELECTIVE_KEY]
    if not isinstance(value, bool):
        raise ValueError(
            f"gradient_checkpointing_kwargs={{'selective': {value!r}}}: `selective` must be True or False."
        )
    if not value:
        return
    if not args.activation_checkpointing:
        raise ValueError("`gradient_checkpointing_kwargs={'selective': True}` requires `gradient_checkpointing=True`.")
    if kwargs.get("use_reentrant"):
        raise ValueError(
            "`gradient_checkpointing_kwargs={'selective': True}` requires non-reentrant gradient checkpointing. Set "
            "`use_reentrant` to `False`, or leave it unset."
        )


def check_selective_checkpointing_setup(args, model, peft_config) -> None:
    """Refuse selective checkpointing where TRL forces reentrant checkpointing (PEFT under DeepSpeed ZeRO-3), with
    TRL's message; called by the trainers before the model loads."""
    if not wants_selective(args) or not args.activation_checkpointing:
        return
    is_peft = peft_config is not None or hasattr(model, "peft_config")
    plugin = getattr(args, "deepspeed_plugin", None)
    if is_peft and plugin is not None and plugin.zero_stage == 3:
        raise ValueError(
            "`gradient_checkpointing_kwargs={'selective': True}` is not supported with PEFT + DeepSpeed ZeRO-3, which "
            "requires reentrant gradient checkpointing while SAC requires non-reentrant checkpointing."
        )


_SELECTIVE_MARK = "_longrm_selective_checkpointing"  # on a backbone whose `activation_checkpointing_enable` is wrapped


def enable_selective_checkpointing(model: nn.Module) -> None:
    """Make the model's `activation_checkpointing_enable` (what the HF Trainer calls in `train()`, and PEFT's k-bit
    preparation through its deprecated alias) honour `selective`: the key is taken out of the checkpoint kwargs (torch's
    `checkpoint` does not take it), and when it is True every checkpointed layer runs non-reentrant with
    `selective_context_fn`. Without the key the call is unchanged.

    The backbone's method is wrapped on the instance (for a PEFT model, its base model's: the Trainer's call on the
    PEFT model reaches the base model's method), which covers every call that enables checkpointing. Idempotent.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # Marked on the model, not on the wrapper: `functools.wraps` copies a function's `__dict__` into every wrapper
    # made around it, so a mark on a function is found on wrappers that are not ours (`activation_offload`'s).
    if vars(base).get(_SELECTIVE_MARK, False):
        return
    enable = base.activation_checkpointing_enable

    @functools.wraps(enable)
    def activation_checkpointing_enable(activation_checkpointing_kwargs=None, *args, **kwargs):
        activation_checkpointing_kwargs = dict(activation_checkpointing_kwargs or {})
        if activation_checkpointing_kwargs.pop(SELECTIVE_KEY, False):
            activation_checkpointing_kwargs["use_reentrant"] = False
            activation_checkpointing_kwargs["context_fn"] = selective_context_fn
        return enable(activation_checkpointing_kwargs or None, *args, **kwargs)

    vars(base)[_SELECTIVE_MARK] = True
    base.activation_checkpointing_enable = activation_checkpointing_enable
