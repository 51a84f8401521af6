"""Sequence-tiled MLP: each decoder layer's MLP (and RMSNorms) computed over slices of a rank's tokens (ALST's
TiledMLP).

An MLP is applied to every token on its own, so slicing the tokens changes nothing in its outputs or gradients; what
it changes is memory. A whole row's MLP materialises its intermediate activations (gate, up, their product: 3 x
`intermediate_size` per token, 3.5x the hidden state of Llama-3-8B) at once in forward, and again when gradient
checkpointing recomputes the layer in backward: 128K tokens on one rank make 10.5 GiB of them in bf16. Tiled, each slice
runs under `torch.utils.checkpoint` (non-reentrant): the forward keeps only the slice's output, the backward recomputes
one slice's intermediates at a time. The peak then holds one slice's intermediates, at the cost of one more forward of
the MLP per step (with gradient checkpointing, which recomputes the layer anyway, three forwards instead of two).

The decoder layers' RMSNorms (`input_layernorm`, `post_attention_layernorm`, and per-head ones such as Qwen3's
`q_norm`/`k_norm`) and the stack's final `norm` are tiled the same way: they are per-token too, and transformers
computes them in float32, so a whole row's norm keeps float32 copies of the row's hidden states for its backward (4
bytes a value: 8 GiB for Llama-3-8B at 512K tokens, several of them live at once in a norm's backward); tiled, one
slice's.

Gradients reach the parameters through autograd as usual (DDP's and DeepSpeed's hooks see them), so the tiled model
trains the same weights, to rounding of the summation order of each weight's gradient over the slices.

The tiling wraps each module's instance `forward`. Whatever binds another `forward` to the instance later replaces it:
Liger's kernels (`use_liger_kernel=True`) are bound to the MLPs and RMSNorms in `Trainer.train()`, after the trainer
tiled them. A module is tiled only while its `forward` is the tiled one (`tiled_tokens`), and a forward pre-hook on the
decoder stack tiles again, around the new forward, every module whose `forward` was replaced since: Liger's kernels
then run over the slices.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

from trl_longrm.memory.selective_checkpointing import keeps_attention_outputs


TILED_MARK = "_longrm_mlp_tile_tokens"  # on a module tiled once: the size of its slices
_TILED_FORWARD = "_longrm_tiled_forward"  # the `forward` the tiling bound to the module (tiled while it is its forward)
_UNTILED_FORWARD = "_longrm_untiled_forward"  # the `forward` that one slices
_TILED_MODULES = "_longrm_tiled_modules"  # on the decoder stack: (module, token dim) of every module tiled


def tiled_mlp_forward(forward, hidden_states: torch.Tensor, tile_tokens: int, dim: int = -2) -> torch.Tensor:
    """`forward(hidden_states)` over slices of at most `tile_tokens` tokens (along `dim`), each checkpointed when
    gradients are recorded; a plain call when the tokens fit in one slice."""
    length = hidden_states.shape[dim]
    if length <= tile_tokens:
        return forward(hidden_states)
    tiles = hidden_states.split(tile_tokens, dim=dim)  # views; the split's backward is one concatenation
    if torch.is_grad_enabled():
        outputs = []
        for index, tile in enumerate(tiles):
            if _stands_in(tiles, index, outputs):
                # Only the shape of a computed slice's output is kept: a tensor in the closure would outlive it.
                shape, dtype = outputs[-1].shape, outputs[-1].dtype
                outputs.append(checkpoint(functools.partial(_same_buffers, shape, dtype), tile, use_reentrant=False))
            else:
                outputs.append(checkpoint(forward, tile, use_reentrant=False))
    else:
        outputs = [forward(tile) for tile in tiles]
    for output in outputs[:1]:
        if not isinstance(output, torch.Tensor):
            raise NotImplementedError(
                f"mlp_tile_tokens: this MLP returns {type(output).__name__}, not a tensor (a Mixture-of-Experts block "
                "with router outputs?); only per-token MLPs that return their hidden states can be tiled."
            )
    return torch.cat(outputs, dim=dim)


class _SameBuffers(torch.autograd.Function):
    """Under the memory plan's trace: a slice's output and its input's gradient allocated as a computed slice's are,
    without computing it (fake tensors hold no values). It saves its input as the slice's first matmul does: a
    non-reentrant checkpoint's frame (a CPU run's RNG state) lives as long as a saved tensor refers to it."""

    @staticmethod
    def forward(ctx, tile, shape, dtype):
        ctx.save_for_backward(tile)
        return tile.new_empty(shape, dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad), None, None


def _same_buffers(shape, dtype, tile):
    return _SameBuffers.apply(tile, shape, dtype)


def _stands_in(tiles, index: int, outputs: list) -> bool:
    """Whether slice `index` is left to `_SameBuffers`: only under the memory plan's trace (fake tensors), for the
    middle slices of full size past the first three. Each slice's checkpointed forward frees what it computed but its
    output, and its backward what it recomputed but its input's gradient, so a middle slice changes the memory only
    by those two, which the stand-in allocates; the first three and the last two are computed and show each state of
    the peak (the forward's last full slice holds the most outputs beside its intermediates; the backward meets the
    first slice last, with every other slice's gradient held). Not under selective checkpointing, which keeps ops'
    outputs inside the slices."""
    if not (3 <= index < len(tiles) - 2) or not is_fake(tiles[index]) or keeps_attention_outputs():
        return False
    return tiles[index].shape == tiles[0].shape and outputs[-1].shape == outputs[0].shape


def decoder_norms(model: nn.Module) -> list[nn.Module]:
    """The RMSNorms inside every decoder layer of `model` (the layer's own and its attention's per-head ones) and the
    decoder stack's final norm: modules of a `...RMSNorm` class, per token like the MLP."""
    norms = []
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList):
            for layer in layers:
                norms.extend(m for m in layer.modules() if type(m).__name__.endswith("RMSNorm"))
            if norms:
                # The backbone's final norm: per token too, over the whole row (the heads then read a few tokens).
                final = getattr(module, "norm", None)
                if type(final).__name__.endswith("RMSNorm"):
                    norms.append(final)
                return norms
    return norms


def decoder_mlps(model: nn.Module) -> list[nn.Module]:
    """The MLP of every decoder layer of `model` (a transformers model, possibly wrapped by peft): the modules found
    as the `mlp` attribute of a layer of the backbone's `layers` list."""
    mlps = []
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList):
            mlps.extend(layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), nn.Module))
            if mlps:
                return mlps
    return mlps


def tiled_tokens(module: nn.Module) -> int | None:
    """The size of the slices `module` computes over, None when it is not tiled: never tiled, or its `forward` was
    replaced since (Liger's kernels bound in `train()`; the decoder stack's next forward tiles it again)."""
    forward = vars(module).get(_TILED_FORWARD)
    if forward is None or vars(module).get("forward") is not forward:
        return None
    return getattr(module, TILED_MARK)


def untiled_forward(module: nn.Module):
    """The `forward` a tiled module computes each slice with (Liger's when it was bound after the tiling and tiled
    again); the module's `forward` when it is not tiled."""
    return vars(module)[_UNTILED_FORWARD] if tiled_tokens(module) is not None else module.forward


def _tile(module: nn.Module, dim: int) -> None:
    """Bind to `module` a forward that slices its current `forward` along `dim` (the size read from `TILED_MARK`)."""
    untiled = module.forward

    def forward(self, hidden_states, *args, _untiled=untiled, _dim=dim, **kwargs):
        if args or kwargs or hidden_states.dim() < 3:  # not a per-token call we know how to slice
            return _untiled(hidden_states, *args, **kwargs)
        return tiled_mlp_forward(_untiled, hidden_states, getattr(self, TILED_MARK), _dim)

    module.forward = types.MethodType(forward, module)
    vars(module)[_TILED_FORWARD], vars(module)[_UNTILED_FORWARD] = module.forward, untiled


def _tile_again(stack: nn.Module, args) -> None:
    """Forward pre-hook of the decoder stack: tile again every module whose `forward` was replaced since it was tiled
    (one identity check per module when none was)."""
    for module, dim in vars(stack)[_TILED_MODULES]:
        if vars(module).get("forward") is not vars(module)[_TILED_FORWARD]:
            _tile(module, dim)


def _decoder_stack(model: nn.Module) -> nn.Module | None:
    """The module holding the decoder layers (`decoder_mlps`' `layers`)."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and any(
            isinstance(getattr(layer, "mlp", None), nn.Module) for layer in layers
        ):
            return module
    return None


def apply_tiled_mlp(model: nn.Module, tile_tokens: int | None) -> int:
    """Compute every decoder layer's MLP and RMSNorms over slices of at most `tile_tokens` tokens (None: leave the
    model as it is).
    Returns the number of MLPs tiled; raises if `model` has no decoder MLP to tile. Applying again changes the size.
    A module whose `forward` is replaced later (Liger's kernels, bound in `Trainer.train()`) is tiled again, around
    its new forward, when the decoder stack next runs.

    Example:
    ```python
    >>> apply_tiled_mlp(model, 8192)  # each MLP sees at most 8192 tokens at once
    ```
    """
    if tile_tokens is None:
        return 0
    if not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"mlp_tile_tokens must be a positive integer or None, got {tile_tokens!r}.")
    mlps = decoder_mlps(model)
    if not mlps:
        raise NotImplementedError(
            f"mlp_tile_tokens={tile_tokens}: {type(model).__name__} has no decoder layers with an `mlp` module to tile."
        )
    # MLPs take [..., tokens, hidden]; the norms [batch, tokens, hidden] or, per head, [batch, tokens, heads, dim]:
    # tokens on dim 1 (transformers' decoder layers are batch first).
    modules = [*((mlp, -2) for mlp in mlps), *((norm, 1) for norm in decoder_norms(model))]
    for module, dim in modules:
        setattr(module, TILED_MARK, tile_tokens)
        if tiled_tokens(module) is None:  # never tiled, or its forward replaced since: tile the forward it has now
            _tile(module, dim)
    stack = _decoder_stack(model)
    if _TILED_MODULES not in vars(stack):
        stack.register_forward_pre_hook(_tile_again)
    vars(stack)[_TILED_MODULES] = modules
    return len(mlps)
