"""Fake weights and activations, real metadata: the dispatch mode under which a memory plan runs a training step.

`torch._subclasses.fake_tensor.FakeTensorMode` alone fakes every tensor, but our trainers read values of small
integer tensors all along the step (a packed row's document lengths, `cu_seqlens`, which positions are scored, which
rank holds which slice of a row) and branch on them: under a plain fake mode those reads are data-dependent errors.
`HybridFakeMode` keeps them real and fakes what costs memory:

- a factory op (no tensor inputs: `torch.empty`, `zeros`, `nn.Linear`'s weights, ...) making a floating-point tensor
  makes a fake one (no storage); integer and boolean factories (`arange`, `torch.tensor(list)`) are real;
- an op whose inputs are all real runs for real (the collator's batch and everything derived from it);
- an op with a fake input runs on fake tensors (FakeTensor's own dispatch; real inputs are converted), so the model's
  weights, activations, gradients and optimizer states are fake from end to end.

Two data-dependent cases are resolved here because the values that decide them are real: indexing a fake tensor with
a real boolean mask (its `nonzero` is computed on the real mask), and reading a fake scalar (`.item()`: a loss, a
metric, a NaN check), which reads 0 / False: no value of a fake tensor can decide anything, and in our code paths only
logging and metrics read them.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


aten = torch.ops.aten

# `*_like` / `new_*` factories read only their input's shape: an integer or boolean one is made real (a mask of
# ones, a count of zeros), so that values built from it stay readable.
_SHAPE_FACTORIES = {
    aten.zeros_like.default: lambda shape, kw, a: torch.zeros(shape, **kw),
    aten.ones_like.default: lambda shape, kw, a: torch.ones(shape, **kw),
    aten.empty_like.default: lambda shape, kw, a: torch.zeros(shape, **kw),
    aten.full_like.default: lambda shape, kw, a: torch.full(shape, a[1], **kw),
    aten.new_zeros.default: lambda shape, kw, a: torch.zeros(a[1], **kw),
    aten.new_ones.default: lambda shape, kw, a: torch.ones(a[1], **kw),
    aten.new_empty.default: lambda shape, kw, a: torch.zeros(a[1], **kw),
    aten.new_full.default: lambda shape, kw, a: torch.full(a[1], a[2], **kw),
}

# Real tensors are metadata: a value per token of a row at most (a few per token: one per response of a group). A
# pointwise op of real inputs whose result broadcasts them to more than this, and to more than EXPANSION times its
# largest input, is data (a mask of queries x keys that CPU attention kernels build, 1,024 queries per chunk), made
# fake: computing it for real would cost the trace seconds per layer at 128K tokens. Per-token metadata stays real at
# any row length: a row of 2^22 + 4 tokens still has its own documents.
LARGEST_REAL_ELEMENTS = 2**22
EXPANSION = 16

_BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default}


def _is_fake(value) -> bool:
    return isinstance(value, FakeTensor)


def _factory_is_float(func, args, kwargs) -> bool:
    """Whether a factory op (no tensor inputs) makes a floating-point tensor: its dtype read from a meta run."""
    dtype = kwargs.get("dtype")
    if dtype is not None:
        return dtype.is_floating_point or dtype.is_complex
    try:
        out = func(*args, **{**kwargs, "device": torch.device("meta")})
    except (TypeError, RuntimeError):
        return False
    return isinstance(out, torch.Tensor) and (out.dtype.is_floating_point or out.dtype.is_complex)


def _broadcast_numel(tensors) -> int:
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    except RuntimeError:
        return 0
    numel = 1
    for size in shape:
        numel *= size
    return numel


def _builds_data(tensors) -> bool:
    """Whether a pointwise op over these real tensors broadcasts metadata into data (see `LARGEST_REAL_ELEMENTS`)."""
    numel = _broadcast_numel(tensors)
    return numel > LARGEST_REAL_ELEMENTS and numel > EXPANSION * max(t.numel() for t in tensors)


def _mask_to_indices(indices):
    """Boolean masks among the indices of `aten.index` as integer indices, one per masked dimension: a real mask's
    own `nonzero`; a fake mask (its values unknown) counts as all true, the largest result it can select."""
    converted = []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            if _is_fake(index):
                index = torch.ones(index.shape, dtype=torch.bool)
            converted.extend(index.nonzero().unbind(1))
        else:
            converted.append(index)
    return converted


# Out-of-place ops that autograd's backward formulas use in place on real tensors (FunctionsManual.cpp: the
# `areAnyTensorSubclassLike` branches of gather_backward and index_select_backward), and their in-place ops.
_IN_PLACE_IN_REAL_BACKWARD = {
    aten.scatter_add.default: aten.scatter_add_.default,
    aten.index_add.default: aten.index_add_.default,
}


class HybridFakeMode(TorchDispatchMode):
    """Fake weights, activations, gradients and optimizer states; real integer metadata (see the module docstring).

    Use as a context manager around building the model and running the step:
    ```python
    >>> with HybridFakeMode():
    ...     model = AutoModelForCausalLM.from_config(config)  # fake weights, nothing allocated
    ...     loss = model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum()  # real ids, fake logits
    ```
    """

    def __init__(self):
        super().__init__()
        # Real tensors reaching an op with fake ones (the batch's ids into the embedding) are converted there.
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._original_apply = None

    def __enter__(self):
        self._original_apply = original = torch.nn.Module._apply

        def _apply(module, fn, recurse=True):
            # torch moves or casts a fake parameter by swapping it with the converted one, which fails (a fake tensor
            # has weak references): `model.to(device)` of a model already there (the Trainer and accelerate move it;
            # `cpu:0` is `cpu`) is skipped, and a real cast (PEFT casts new adapters to the base layer's dtype)
            # replaces the parameter by a new one, before any optimizer holds it.
            if not any(_is_fake(t) for t in (*module.parameters(), *module.buffers())):
                return original(module, fn, recurse)
            if recurse:
                for child in module.children():
                    child._apply(fn)
            with torch.no_grad():
                for store in (module._parameters, module._buffers):
                    for key, tensor in store.items():
                        if tensor is None:
                            continue
                        out = fn(tensor)
                        if out is tensor or (out.dtype == tensor.dtype and out.device.type == tensor.device.type):
                            continue
                        if isinstance(tensor, torch.nn.Parameter):
                            out = torch.nn.Parameter(out, requires_grad=tensor.requires_grad)
                        store[key] = out
            return module

        torch.nn.Module._apply = _apply
        return super().__enter__()

    def __exit__(self, *exc):
        torch.nn.Module._apply = self._original_apply
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [value for value in flat if isinstance(value, torch.Tensor)]
        if not any(_is_fake(t) for t in tensors):
            if not tensors and _factory_is_float(func, args, kwargs):
                with self.fake_mode:
                    return func(*args, **kwargs)
            if len(tensors) > 1 and torch.Tag.pointwise in func.tags and _builds_data(tensors):
                with self.fake_mode:
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        if func in _SHAPE_FACTORIES:
            dtype = kwargs.get("dtype") or args[0].dtype
            if not (dtype.is_floating_point or dtype.is_complex):
                options = {"dtype": dtype}
                return _SHAPE_FACTORIES[func](args[0].shape, options, args)
        if func is aten._local_scalar_dense.default:
            # `.item()` of a fake scalar (a loss or metric read for logging): it has no value.
            dtype = args[0].dtype
            return False if dtype == torch.bool else (0.0 if dtype.is_floating_point else 0)
        if func in _IN_PLACE_IN_REAL_BACKWARD and _is_fake(args[0]) and torch._C._current_autograd_node() is not None:
            # autograd's backward formulas (gather's, index_select's) fill a fresh zeros tensor in place, but use the
            # out-of-place op when an input is a tensor subclass, as fake tensors are: one more buffer of the input's
            # size than the real run allocates. Done in place here, as the real run does.
            return _IN_PLACE_IN_REAL_BACKWARD[func](*args, **kwargs)
        if func in _BOOL_INDEXED:
            args = (args[0], _mask_to_indices(args[1]), *args[2:])
        elif func is aten.masked_select.default and not _is_fake(args[1]) and args[0].shape == args[1].shape:
            return aten.index.Tensor(args[0], _mask_to_indices([args[1]]))
        return func(*args, **kwargs)


def is_fake(tensor) -> bool:
    """Whether `tensor` is a fake tensor (no storage)."""
    return _is_fake(tensor)


__all__ = ["HybridFakeMode", "is_fake"]
