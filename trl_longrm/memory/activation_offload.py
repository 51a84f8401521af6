"""Activation offload: the tensors autograd saves for backward held in host memory instead of on the device.

Under gradient checkpointing, what a decoder stack keeps from forward to backward is each checkpointed layer's input:
`layers x rank_tokens x hidden` values (about 36 GiB per rank for Qwen3-8B at 1M tokens over 8 ranks in bf16), which
dominates a long row's memory. `OffloadActivations` is a `torch.autograd.graph.saved_tensors_hooks` context: every
tensor saved for backward while it is active (larger than `min_offload_bytes`, not a parameter) is copied to host
memory when saved and back to its device when the backward reads it. Non-reentrant checkpointing saves its region's
inputs through autograd's saved tensors (`torch.utils.checkpoint` saves them before it enters its own hooks), so an
offload context around the forward moves the checkpointed inputs, while the tensors of the region itself are left to
the recompute. Without checkpointing it moves every saved activation, as TRL's `activation_offloading` does.

On an accelerator the host copies are pinned and made with non-blocking copies on the compute stream (the stream
orders each copy before the device memory it reads is reused, and before the copy back); with
`HostStore(use_streams=True)` the copies to host of CUDA tensors run on a side stream instead, overlapping the forward's
compute, as TRL's `OffloadActivations(use_streams=True)` does. A CPU run still makes a real host copy, which saves
nothing but lets the offloaded run be checked against the plain one on CPU. A saved tensor comes back with its strides
(a transposed weight-like view, a permuted attention layout): its host copy has them (a view with gaps, such as a
strided slice, is copied dense in the same order of dimensions: only its elements are copied).

The host memory itself sits behind a small store (`HostStore`: `to_host(tensor)` / `to_device(packed)`, current and
peak host bytes). `use_host_store(store)` swaps in another store for whatever runs inside it, e.g. `CountingHostStore`,
which counts host bytes without keeping values (a memory plan traced on fake tensors reports them as host memory).

Example:
```python
>>> from trl_longrm.memory.activation_offload import HostStore, OffloadActivations
>>> offload = OffloadActivations(model=model, store=HostStore())
>>> with offload:
...     loss = model(**batch).loss
...     loss.backward()
>>> offload.store.peak_bytes  # host bytes held at the peak
```
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor


logger = logging.getLogger(__name__)

# TRL's `OffloadActivations` threshold: smaller tensors are not worth a copy each way.
MIN_OFFLOAD_BYTES = 1024


def pinned_host_bytes(nbytes: int) -> int:
    """Host bytes a pinned copy of `nbytes` holds: torch's caching host allocator (`CachingHostAllocator`, which
    `pin_memory=True` allocates from) rounds each request up to a power of two (`c10::llvm::PowerOf2Ceil`), so a
    2.002 GiB layer input holds 4 GiB of host memory."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


class HostCopy:
    """A saved tensor held by a `HostStore`: its host copy and the device it returns to. The store's current host
    bytes drop when autograd releases it (after its backward, or with the graph)."""

    __slots__ = ("store", "tensor", "device", "nbytes", "ready", "__weakref__")

    def __init__(self, store: HostStore, tensor: torch.Tensor, device: torch.device, nbytes: int, ready=None):
        # `ready`: the event recorded after the copy to host when it ran on a side stream (None: the compute stream's).
        self.store, self.tensor, self.device, self.nbytes, self.ready = store, tensor, device, nbytes, ready
        store._hold(nbytes)

    def __del__(self):
        self.store._release(self.nbytes)


def host_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """The strides of `tensor`'s host copy: its own when its elements fill their span of storage exactly (contiguous,
    transposed, permuted), else dense strides in the same order of dimensions (a view with gaps: only its elements
    are copied, as `torch.empty_like` lays it out)."""
    shape, strides = tuple(tensor.shape), tensor.stride()
    dense, step = [0] * len(shape), 1
    for dim in sorted(range(len(shape)), key=lambda d: (strides[d], -d)):  # innermost first
        dense[dim] = step
        step *= shape[dim]
    if all(shape[d] == 1 or strides[d] == dense[d] for d in range(len(shape))):
        return strides
    return tuple(dense)


class HostStore:
    """Host memory of offloaded activations, with byte counters: `current_bytes` (held now), `peak_bytes` (most held
    at once), `moved_bytes` and `copies` (everything copied to host so far).

    Args:
        use_streams (`bool`, *optional*, defaults to `False`):
            Copy CUDA tensors to host on a side stream (one per device), which overlaps the copies with the forward's
            compute, as TRL's `OffloadActivations(use_streams=True)`; the copy back waits for it. Without it (and for
            any tensor off CUDA: a CPU run is unchanged) the copies are queued on the compute stream.
        pinned (`bool`, *optional*):
            Count each copy as the pinned memory it holds (`pinned_host_bytes`: rounded up to a power of two). Default
            (None): the copies of accelerator tensors, which are pinned; a CUDA run's memory plan, traced on CPU, sets
            True.
    """

    def __init__(self, use_streams: bool = False, pinned: bool | None = None):
        self.pinned = pinned
        self.current_bytes = 0
        self.peak_bytes = 0
        self.moved_bytes = 0
        self.copies = 0
        self.use_streams = use_streams
        self._streams = {}  # device -> the side stream of the copies to host

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        """A host copy of `tensor`, with its strides (`host_strides`): pinned, copied without blocking, when it lives
        on an accelerator."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.pinned or (self.pinned is None and tensor.device.type != "cpu"):
            nbytes = pinned_host_bytes(nbytes)
        stream = self._copy_stream(tensor)
        if stream is None:
            return HostCopy(self, self._host_tensor(tensor), tensor.device, nbytes)
        # Not exercised by the test suite (no GPU here); the same scheme as TRL's streams: the side stream waits for
        # the compute stream that wrote the tensor, the allocator keeps the tensor's memory until the side stream has
        # read it (`record_stream`), and the copy back waits for the event recorded after the copy.
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host = self._host_tensor(tensor)
            ready = stream.record_event()
        tensor.record_stream(stream)
        return HostCopy(self, host, tensor.device, nbytes, ready)

    def to_device(self, packed: HostCopy) -> torch.Tensor:
        """The tensor back on its device, with its strides (on CPU the host copy itself, as
        `torch.autograd.graph.save_on_cpu`)."""
        if packed.ready is not None:  # copied to host on a side stream: not before that copy is done
            torch.cuda.current_stream(packed.device).wait_event(packed.ready)
        # `to` keeps the strides of a dense tensor, which the host copy is.
        return packed.tensor.to(packed.device, non_blocking=packed.device.type != "cpu")

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def _copy_stream(self, tensor: torch.Tensor):
        """The side stream `tensor` is copied to host on, None for the compute stream."""
        if not self.use_streams or tensor.device.type != "cuda" or type(tensor) is not torch.Tensor:
            return None
        device = tensor.device if tensor.device.index is not None else torch.device("cuda", torch.cuda.current_device())
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _host_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        on_accelerator = tensor.device.type != "cpu"
        host = torch.empty_strided(tensor.shape, host_strides(tensor), dtype=tensor.dtype, device="cpu",
                                   pin_memory=on_accelerator)  # fmt: skip
        return host.copy_(tensor, non_blocking=on_accelerator)

    def _hold(self, nbytes: int) -> None:
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self.moved_bytes += nbytes
        self.copies += 1

    def _release(self, nbytes: int) -> None:
        self.current_bytes -= nbytes


class CountingHostStore(HostStore):
    """A `HostStore` that counts host bytes and keeps no floating-point values: the host copy is a `meta` tensor, and
    the tensor returned to the device is uninitialised memory of the same shape (integer tensors, which can decide
    shapes in backward, keep their values). For memory traces and measurements, never for training."""

    def _host_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            # Integer tensors (indices, lengths) decide shapes in backward: their values are kept (they are small).
            return tensor
        return torch.empty_strided(tensor.shape, host_strides(tensor), dtype=tensor.dtype, device="meta")

    def to_device(self, packed: HostCopy) -> torch.Tensor:
        if packed.tensor.device.type != "meta":
            return packed.tensor.clone()
        return torch.empty_strided(packed.tensor.shape, packed.tensor.stride(), dtype=packed.tensor.dtype,
                                   device=packed.device)  # fmt: skip

    def _copy_stream(self, tensor: torch.Tensor):
        return None  # nothing is copied


_store_overrides: list[HostStore] = []


@contextlib.contextmanager
def use_host_store(store: HostStore):
    """Every `OffloadActivations` moves the tensors it saves into `store` while this context is active (whatever
    store it was built with), e.g. a `CountingHostStore` for a memory trace of a trainer's step:

    ```python
    >>> with use_host_store(CountingHostStore()) as store:
    ...     trainer.train()
    >>> store.peak_bytes
    ```
    """
    _store_overrides.append(store)
    try:
        yield store
    finally:
        _store_overrides.remove(store)


def _default_device() -> torch.device:
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return accelerator if accelerator is not None else torch.device("cpu")


def _storage_key(tensor: torch.Tensor):
    # The storage's own identity (`data_ptr` is refused on fake tensors, whose storages have none).
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


_logged_cpu_run = False


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensors hooks that hold the tensors autograd saves in host memory (see the module docstring).

    Args:
        device (`torch.device` or `str`, *optional*):
            The device the model computes on: tensors saved there are offloaded, others are left as they are. Default:
            the current accelerator, else CPU (where the host copy saves no memory; kept for exactness checks).
        store (`HostStore`, *optional*):
            Where the host copies go; default a new `HostStore` (`use_host_store` overrides it).
        min_offload_bytes (`int`, *optional*, defaults to `1024`):
            Smaller tensors stay where they are.
        model (`nn.Module`, *optional*):
            Its parameters (and views of them, as the transposed weight a linear layer saves) are never offloaded:
            their storages are read again at every entry of the context.

    A tensor saved several times in one forward (the input of the q, k and v projections) is copied once. Tensor
    subclasses other than fake tensors (DTensor, float8 tensors) and broadcast views (a zero stride, whose copy would
    be larger than their storage) stay on the device.
    """

    def __init__(self, device=None, store: HostStore | None = None, min_offload_bytes: int = MIN_OFFLOAD_BYTES,
                 model: nn.Module | None = None):  # fmt: skip
        global _logged_cpu_run
        self.device = torch.device(device) if device is not None else _default_device()
        self.store = store if store is not None else HostStore()
        self.min_offload_bytes = min_offload_bytes
        self.model = model
        self._param_storages = set()
        self._saved = {}  # id(tensor) -> (weak reference, version, HostCopy): one copy per tensor and forward
        self._depth = 0
        if self.device.type == "cpu" and not _logged_cpu_run:
            _logged_cpu_run = True
            logger.info(
                "Activation offload on a CPU run: saved activations are copied within host memory, which saves no "
                "memory (the copies keep the offloaded run checkable against the plain one)."
            )
        super().__init__(self._pack, self._unpack)

    def update_model_params(self, model: nn.Module) -> None:
        """Read the storages of `model`'s parameters, whose views must not be offloaded."""
        self._param_storages = {_storage_key(p) for p in model.parameters()} - {None}

    def _offloads(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, nn.Parameter) or (
            type(tensor) is not torch.Tensor and not isinstance(tensor, FakeTensor)
        ):
            return False
        if tensor.device.type != self.device.type or tensor.layout != torch.strided or 0 in tensor.stride():
            return False
        if tensor.numel() * tensor.element_size() < self.min_offload_bytes:
            return False
        return _storage_key(tensor) not in self._param_storages

    def _pack(self, tensor: torch.Tensor):
        if not self._offloads(tensor):
            return tensor
        seen = self._saved.get(id(tensor))
        if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
            return seen[2]
        store = _store_overrides[-1] if _store_overrides else self.store
        packed = store.to_host(tensor)
        key = id(tensor)
        self._saved[key] = (
            weakref.ref(tensor, lambda _, key=key: self._saved.pop(key, None)),
            tensor._version,
            packed,
        )
        return packed

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, HostCopy):
            return packed.store.to_device(packed)
        return packed

    def __enter__(self):
        if self._depth == 0 and self.model is not None:
            self.update_model_params(self.model)
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._saved.clear()  # the copies now belong to the graph only


def _checkpoint_offloaded(offload: OffloadActivations, checkpoint_func, function, *args, **kwargs):
    # Only what the checkpoint itself saves (its region's inputs) is saved under these hooks: inside the region
    # torch's checkpoint hooks come first, and the recompute runs under its own.
    with offload:
        return checkpoint_func(function, *args, **kwargs)


# On the backbone whose `activation_checkpointing_enable` was wrapped: the hooks its checkpointed layers use now. Held
# by the model, not by the wrapper function: `functools.wraps` copies a function's `__dict__` into any wrapper made
# around it (ours for `selective`, TRL's), so a mark stored on the function would be found on the outer wrapper, and
# a second trainer would set it there while the inner wrapper kept reading the first trainer's hooks.
_OFFLOAD_HOOKS = "_longrm_checkpoint_offload"


def offload_checkpointed_inputs(model: nn.Module, offload: OffloadActivations) -> None:
    """Make transformers' checkpoint offload (`activation_checkpointing_enable(offload=True)`, which the HF Trainer calls
    for `gradient_checkpointing_kwargs={"offload": True}`) hold the checkpointed layers' inputs through `offload`
    instead of `torch.autograd.graph.save_on_cpu(pin_memory=True)`, which fails on a machine without an accelerator.

    As TRL's selective checkpointing does, the model instance's method is wrapped, which covers every call that
    enables checkpointing: it enables checkpointing without transformers' offload, then wraps the checkpoint function
    of every checkpointed module (whatever it is: `use_reentrant`, `context_fn` kept) in `offload`. Idempotent; called
    again (a second trainer on the same model) the next enabling call uses the new `offload`.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's backbone
    installed = _OFFLOAD_HOOKS in vars(base)
    vars(base)[_OFFLOAD_HOOKS] = offload
    if installed:
        return
    enable = base.activation_checkpointing_enable

    @functools.wraps(enable)
    def activation_checkpointing_enable(activation_checkpointing_kwargs=None, every_n_layers: int = 1,
                                        offload: bool = False):  # fmt: skip
        enable(activation_checkpointing_kwargs=activation_checkpointing_kwargs, every_n_layers=every_n_layers)
        if not offload:
            return
        hooks = vars(base)[_OFFLOAD_HOOKS]
        for module in base.modules():
            func = getattr(module, "_gradient_checkpointing_func", None)
            if func is None:
                continue
            if getattr(func, "func", None) is _checkpoint_offloaded:  # wrapped by an earlier call: the new hooks
                func = func.args[1]
            module._gradient_checkpointing_func = functools.partial(_checkpoint_offloaded, hooks, func)

    base.activation_checkpointing_enable = activation_checkpointing_enable
