"""One optimizer step of our real trainer, traced on fake tensors: what `torch.distributed._tools.mem_tracker.MemTracker`
saw live at the step's peak, by kind (parameters, gradients, optimizer states, activations, temporaries).

The trainer is the one a recipe builds (`SimPOGRMTrainer`, `SimPODisRMTrainer`, `LongSFTTrainer`), with the user's
config, a model built from its `config.json` with fake weights (`HybridFakeMode`), and a synthetic dataset of groups
(or SFT examples) of the requested shape; `trainer.train()` runs one optimizer step through the HF Trainer's loop, so
everything the run does is in the trace: our collator and packing, the model patches (sparse LM head, score head,
ring attention), the losses, gradient accumulation, clipping and the optimizer the config names.

Sequence parallelism: the rank predicted joins a fake process group (`torch.testing._internal.distributed.fake_pg`)
of the run's world size, so the real sharding code places its slice of the row and the real collectives run (as
no-ops on fake tensors; their outputs are allocated as the real ones are).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import TrainerCallback

from trl_longrm.memory.activation_offload import CountingHostStore, use_host_store
from trl_longrm.memory.partial_checkpointing import UNCHECKED_KEY, unchecked_layers
from trl_longrm.memory_plan.cuda_paths import cuda_code_paths
from trl_longrm.memory_plan.fake_mode import HybridFakeMode
from trl_longrm.memory_plan.model import build_model
from trl_longrm.memory_plan.planned_kernels import planned_kernels
from trl_longrm.memory_plan.quantized import as_4bit_layers, loaded_in_4bit
from trl_longrm.memory_plan.workspaces import KernelWorkspaces


logger = logging.getLogger(__name__)

# MemTracker's kinds (`_MemRefType` values) as the plan names them.
KINDS = {
    "Parameter": "weights",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_states",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
}


@dataclass(frozen=True)
class GroupShape:
    """The synthetic data of the traced step: groups of one prompt and `1 + num_rejected` responses (SFT: one
    example of `prompt_tokens + response_tokens` tokens, `num_rejected` unused)."""

    prompt_tokens: int
    response_tokens: int
    num_rejected: int = 1

    def tokens(self, shared_prefix: bool, stage: str) -> int:
        """Tokens the group occupies in a row."""
        if stage == "sft":
            return self.prompt_tokens + self.response_tokens
        responses = (1 + self.num_rejected) * self.response_tokens
        if shared_prefix:
            return self.prompt_tokens + responses
        return (1 + self.num_rejected) * self.prompt_tokens + responses


@dataclass
class TracedStep:
    """What the trace measured, in bytes: `peak` (live tensor bytes at the step's peak) and its parts by kind (`KINDS`),
    plus what was live at the step's start (weights, optimizer states), and the sizes later terms derive from."""

    peak: int
    at_peak: dict[str, int]
    at_start: dict[str, int]
    # The peak before the optimizer step (forward, backward, clipping) and inside it (with `zero_grad`), by kind.
    forward_backward_peak: dict[str, int]
    optimizer_peak: dict[str, int]
    trainable_parameters: int
    total_parameters: int
    weight_bytes: int
    trainable_weight_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    row_tokens: int
    rank_tokens: int
    # Host memory of offloaded activations at its peak (`activation_offloading`, or checkpoint offload), counted by a
    # `CountingHostStore` the offload hooks fill instead of host buffers.
    host_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    # The model's layout, for the terms of DeepSpeed's ZeRO (`trl_longrm.memory_plan.deepspeed`), which partitions,
    # flattens and gathers parameters the trace holds whole: every parameter as (name, numel, element size, trainable),
    # in `named_parameters` order; the optimizer's parameter groups (indices into `parameters`); the trainable
    # parameters in the order their gradients are accumulated in backward (where ZeRO's gradient hooks run).
    parameters: list[tuple[str, int, int, bool]] = field(default_factory=list)
    param_groups: list[list[int]] = field(default_factory=list)
    gradient_order: list[int] = field(default_factory=list)
    # Where the forward/backward peak happened (see `_TraceStep.context`): in backward or not, how many gradients its
    # backward had accumulated by then, its micro-batch, and the module whose forward ran last (its recomputation, in
    # a backward with gradient checkpointing).
    peak_context: dict = field(default_factory=dict)
    # For a ZeRO plan (`trace_step(..., ddp=False)`): the forward/backward peak of each context (as `peak_context`),
    # as (context, parts by kind): DeepSpeed's buffers change with the context (a gradient bucket from a backward's
    # first gradient on, ZeRO-3's gathered parameters with the module), so its peak may be another context's.
    segments: list[tuple[dict, dict[str, int]]] = field(default_factory=list)


def synthetic_dataset(stage: str, shape: GroupShape, num_rows: int, vocab_size: int, eos_token_id: int):
    """`num_rows` tokenised groups (or SFT examples) of `shape`, of ordinary token ids (below the model's vocabulary;
    values do not change memory), each response ending with EOS as real data does."""
    from datasets import Dataset

    modulus = max(vocab_size - 3, 1)

    def ids(n, offset):  # (numpy: a million-token prompt's ids in milliseconds, not a second per trace)
        return (3 + (np.arange(offset, offset + n) % modulus)).tolist()

    rows = []
    for r in range(num_rows):
        prompt = ids(shape.prompt_tokens, r)
        if stage == "sft":
            completion = ids(shape.response_tokens - 1, r + 1) + [eos_token_id]
            rows.append({"input_ids": prompt + completion, "completion_mask": [0] * len(prompt) + [1] * len(completion)})
            continue
        response = ids(max(shape.response_tokens - 1, 0), r + 7) + [eos_token_id]
        rows.append(
            {
                "prompt_ids": prompt,
                "chosen_completion_ids": response,
                "rejected_completion_ids": [list(response) for _ in range(shape.num_rejected)],
            }
        )
    return Dataset.from_list(rows)


def fresh_args(training_args, **overrides):
    """A copy of `training_args` with `overrides`, rebuilt through `__post_init__` (so the copy's device and process
    state are read again, in the fake world if one is set up)."""
    values = {f.name: getattr(training_args, f.name) for f in dataclasses.fields(training_args) if f.init}
    values.update(overrides)
    return type(training_args)(**values)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """A fake process group of `world_size` ranks, seen from `rank`, with the environment accelerate reads to find a
    distributed run; everything restored (and accelerate's shared state reset) on exit."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size == 1:
        AcceleratorState._reset_state(True)
        try:
            yield
        finally:
            AcceleratorState._reset_state(True)
        return
    if dist.is_initialized():
        raise RuntimeError("A memory plan of several ranks needs a process without a process group of its own.")
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    AcceleratorState._reset_state(True)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        from trl_longrm.sequence_parallel.collectives import destroy_process_groups

        destroy_process_groups()
        if dist.is_initialized():
            dist.destroy_process_group()
        AcceleratorState._reset_state(True)
        PartialState._reset_state()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _WorkHoldingTensors:
    """A fake collective's work, holding the tensors a real backend's work holds until it is dropped."""

    def __init__(self, work, tensors):
        self._work, self._tensors = work, tensors

    def __getattr__(self, name):
        return getattr(self._work, name)


# The methods of a process group that issue the collectives our trainers and DDP use.
_COLLECTIVES = ("allreduce", "broadcast", "allgather", "all_gather_single", "_allgather_base", "reduce_scatter_single",
                "_reduce_scatter_base", "alltoall_base", "all_to_all_single")  # fmt: skip
_REDUCE_SCATTERS = ("reduce_scatter_single", "_reduce_scatter_base")


@contextlib.contextmanager
def collectives_hold_their_tensors(gloo: bool):
    """Within it, a collective on the fake process group returns a work that holds its tensors until it is dropped,
    as gloo's and NCCL's works do (a ring's reduce-scatter input lives until the ring waits for it, not until the
    call returns). With `gloo` (a CPU plan, which stands for a gloo run), a reduce-scatter also holds a copy of its
    input, as gloo's does (`ProcessGroupGloo::reduce_scatter_tensor_coalesced` all-reduces a clone of the input):
    memory of the calling thread there; NCCL makes none."""
    from torch._C._distributed_c10d import ProcessGroup

    saved = {name: ProcessGroup.__dict__[name] for name in _COLLECTIVES if name in ProcessGroup.__dict__}

    def holding(name, original):
        def method(self, *args, **kwargs):
            work = original(self, *args, **kwargs)
            if work is None or torch.distributed.get_backend(self) != "fake":
                return work
            held = [args, kwargs]
            if gloo and name in _REDUCE_SCATTERS:
                held.append(args[1].clone())  # (output, input, ...)
            return _WorkHoldingTensors(work, held)

        return method

    try:
        for name, method in saved.items():
            setattr(ProcessGroup, name, holding(name, method))
        yield
    finally:
        for name, method in saved.items():
            setattr(ProcessGroup, name, method)


@contextlib.contextmanager
def rng_states_tracked():
    """Within it, `torch.get_rng_state()` returns its state through a dispatched copy, which the tracker sees. Every
    `torch.utils.checkpoint` call keeps the CPU generator's state (5,056 bytes) until its backward, made by the
    generator outside torch's dispatch: a CPU run holds one per checkpointed call in memory (a tiled MLP has one per
    slice, per layer), which a CUDA run holds in host memory, not on the device."""
    original = torch.get_rng_state

    def get_rng_state():
        return original().clone()

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def _memory_tracker(gradient_buckets: bool = False):
    """torch's `MemTracker`, except that (1) gradient hooks go on trainable parameters only: it registers one on every
    parameter a module uses, which raises for frozen ones (LoRA's base weights); (2) only the whole step's peak is
    kept, not every module's: its per-module update visits every module at every op, quadratic in the layers (a
    36-layer trace ran for over 10 minutes); (3) with `gradient_buckets` (a DDP-wrapped model whose gradients are
    views of its buckets), a storage the tracker first meets as the target of an in-place write is one of DDP's
    gradient buckets, counted as gradients: they were allocated when the model was wrapped, before the tracker, and
    it would otherwise count the first one written (in backward) as a temporary, beside the plan's term for buckets
    the trace did not see (`ddp_gradient_buckets`)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, get_untyped_storages

    _DEVICE_OF = torch.ops.prim.device.default

    class _Tracker(MemTracker):
        _writing = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is _DEVICE_OF and isinstance(args[0], FakeTensor):
                # C++ asks a fake tensor's device several times an op (over half of a trace's dispatches): no memory
                # to track; answered here as the fake tensor's own dispatch answers it, without the modes below.
                return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
            self._writing = gradient_buckets and func._schema.is_mutable
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _track(self, reftype, t):
            if self._writing and any(st not in self._WINFO for st in get_untyped_storages(t)):
                reftype = _MemRefType.GRAD
            return super()._track(reftype, t)

        peak_context = None
        context = None  # a callable giving where the step is (`_TraceStep.context`), kept with each new peak
        segments = None  # where kept: {context: (bytes, snapshot)}, the peak of each context (`_TraceStep`)

        def _update_peak_stats(self, peak_state):
            context = self.context() if self.context is not None else None
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(dev_snap)
                    if context is not None and getattr(dev, "type", dev) != "meta":
                        self.peak_context = context
            if self.segments is not None and context is not None:
                key = tuple(context.values())
                total = sum(snap[_TOTAL_KEY] for dev, snap in self._curr_mem_snap.items()
                            if getattr(dev, "type", dev) != "meta")  # fmt: skip
                if key not in self.segments or self.segments[key][0] < total:
                    self.segments[key] = (total, {dev: dict(snap) for dev, snap in self._curr_mem_snap.items()})

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            frozen = [p for p in module.parameters() if not p.requires_grad]
            for param in frozen:  # no hook to install: marked as installed
                self._param_to_grad_hook_handles.setdefault(param, ())
            try:
                return super()._track_module_params_and_buffers(module, install_grad_hooks)
            finally:
                for param in frozen:
                    if self._param_to_grad_hook_handles.get(param) == ():
                        del self._param_to_grad_hook_handles[param]

        def _deregister_param_and_optimizer_hooks(self):
            for param in [p for p, handles in self._param_to_grad_hook_handles.items() if handles == ()]:
                del self._param_to_grad_hook_handles[param]
            super()._deregister_param_and_optimizer_hooks()

    tracker = _Tracker()
    tracker._mod_tracker = _forward_mod_tracker()
    return tracker


def _forward_mod_tracker():
    """torch's `ModTracker` (MemTracker's module bookkeeping) without its backward hooks. It registers a multi-grad
    hook on every module's inputs and outputs that require grad, to follow modules in backward; each hook holds a node
    of the micro-batch's autograd graph, hence the graph's nodes down to the gradient accumulator of any leaf that
    requires grad (the input embeddings' output under `enable_input_require_grads`, which TRL and our trainers turn on
    for PEFT with gradient checkpointing), hence that leaf and its `.grad`, for the rest of the trace. The run the plan
    stands for frees them after each micro-batch's backward: two hidden-state-sized tensors per micro-batch too many
    (8 GiB for Llama-3.1-8B at 512K tokens). The whole-step peak needs the forward bookkeeping only (which module runs;
    whether the engine is in backward is read from the engine itself, `is_bw`)."""
    import weakref

    from torch.distributed._tools.mod_tracker import ModTracker

    class _ForwardModTracker(ModTracker):
        last_module = None  # the module whose forward ran last, and whether in backward (a recomputation)
        last_in_backward = False

        def _fw_pre_hook(self, mod, input):
            name = self._get_mod_name(mod)
            self.last_module, self.last_in_backward = name, torch._C._current_graph_task_id() != -1
            self._get_append_fn(weakref.ref(mod), name, False)()
            if self._user_pre_fw_hook is not None:
                self._user_pre_fw_hook(mod, input)

        def _fw_post_hook(self, mod, input, output):
            if self._user_post_fw_hook is not None:
                self._user_post_fw_hook(mod, input, output)
            self._get_pop_fn(weakref.ref(mod), self._get_mod_name(mod), False)()

    return _ForwardModTracker()


class _TraceStep(TrainerCallback):
    """Primes the optimizer's states (as after a first step: they are alive through every later one), then tracks
    the first optimizer step with a `MemTracker`; with `workspaces`, kernels' in-call buffers (`KernelWorkspaces`)
    are allocated above it."""

    def __init__(self, workspaces: bool = False):
        self.workspaces = KernelWorkspaces() if workspaces else None
        self.tracker = None
        self.at_start = None
        self.peak = None
        self.forward_backward_peak = None
        self.forward_backward_context = {}
        self.forward_backward_segments = []
        self.record_segments = False
        self.trainer = None
        self.parameters, self.param_groups, self.gradient_order = [], [], []
        self._produced, self._micro_batch, self._hooks = [], 0, []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from torch.nn.parallel import DistributedDataParallel

        wrapped = getattr(self.trainer, "model_wrapped", None)
        if isinstance(wrapped, DistributedDataParallel):
            # The fake process group's all-reduce completes with no tensor, which DDP's reducer refuses; a hook that
            # returns the bucket as it is stands for it (the real all-reduce and average are in place).
            wrapped.register_comm_hook(None, _bucket_as_reduced)

        trainer = self.trainer
        training_step = trainer.training_step

        def step_with_loss_on_the_loop_device(*args, **kwargs):
            # Stock CPOTrainer moves its loss to accelerate's device, which in a fake world of several CPU ranks is
            # `cpu:0`, and the HF loop refuses to add it to its `cpu` total; a real zero there stands for the logged
            # value (a fake loss has none).
            loss = training_step(*args, **kwargs)
            total = getattr(trainer, "_tr_loss", None)
            if total is not None and loss.device != total.device:
                return total.new_zeros(())
            return loss

        trainer.training_step = step_with_loss_on_the_loop_device
        inner = getattr(optimizer, "optimizer", optimizer)
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:
            p.grad = torch.zeros_like(p)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "optimizer.step() before lr_scheduler.step()": the priming step
            inner.step()
        inner.zero_grad(set_to_none=True)
        self._record_layout(model, inner)
        buckets = isinstance(wrapped, DistributedDataParallel) and wrapped.gradient_as_bucket_view
        self.tracker = _memory_tracker(gradient_buckets=buckets)
        self.tracker.context = self.context
        if self.record_segments:
            self.tracker.segments = {}
        self.tracker.track_external(model, inner)
        self.tracker.__enter__()
        if self.workspaces is not None:
            self.workspaces.__enter__()
        self.at_start = _by_kind(self.tracker.get_tracker_snapshot("current"))

    def _record_layout(self, model, optimizer):
        """The parameters, the optimizer's groups, and a hook per trainable parameter that records when backward
        accumulates its gradient (the order of the first micro-batch's, and how many the current backward has)."""
        named = list(model.named_parameters())
        index = {id(p): i for i, (_, p) in enumerate(named)}
        self.parameters = [(n, p.numel(), p.element_size(), p.requires_grad) for n, p in named]
        self.param_groups = [[index[id(p)] for p in group["params"] if id(p) in index]
                             for group in optimizer.param_groups]  # fmt: skip

        def accumulated(i):
            self._produced.append(i)
            if self._micro_batch == 0 and i not in self._seen:
                self._seen.add(i)
                self.gradient_order.append(i)

        self._seen = set()
        for i, (_, p) in enumerate(named):
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda _, i=i: accumulated(i)))

    def context(self) -> dict:
        """Where the step is: in backward or not (the autograd engine running), the gradients the current backward has
        accumulated, the micro-batch, and the module whose forward (or recomputation) ran last."""
        mods = self.tracker._mod_tracker if self.tracker is not None else None
        return {
            "backward": torch._C._current_graph_task_id() != -1,
            "produced": len(self._produced),
            "micro_batch": self._micro_batch,
            "module": getattr(mods, "last_module", None),
            "module_in_backward": bool(getattr(mods, "last_in_backward", False)),
        }

    def on_step_begin(self, args, state, control, **kwargs):
        self._produced, self._micro_batch = [], 0

    def on_substep_end(self, args, state, control, **kwargs):
        # Another micro-batch of the same step follows: its modules run again, which MemTracker's per-module stats
        # (not used here) refuse unless cleared; the whole-step totals and peak are kept.
        self.tracker.reset_mod_stats()
        self._produced, self._micro_batch = [], self._micro_batch + 1

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # The peak so far is the forward/backward one; the optimizer step's own starts from what is live now.
        tracker = self.tracker
        self.forward_backward_peak = tracker.get_tracker_snapshot("peak")
        self.forward_backward_context = dict(tracker.peak_context or {})
        if tracker.segments is not None:
            keys = list(self.context())
            self.forward_backward_segments = [(dict(zip(keys, key)), _by_kind(snapshot))
                                              for key, (_, snapshot) in tracker.segments.items()]  # fmt: skip
            tracker.segments = None
        tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
        tracker._peak_mem = {dev: snap["Total"] for dev, snap in tracker._peak_mem_snap.items()}

    def on_step_end(self, args, state, control, **kwargs):
        if self.tracker is not None and self.peak is None:
            self._exit()
            self.peak = self.tracker.get_tracker_snapshot("peak")

    def close(self):
        if self.tracker is not None and self.peak is None:
            self._exit()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _exit(self):
        if self.workspaces is not None:
            self.workspaces.__exit__(None, None, None)
            self.workspaces = None
        self.tracker.__exit__(None, None, None)


def _as_deepspeed_casts(model, *args, dtype=None, **kwargs):
    """What DeepSpeed's engine does to the model it wraps, in place of accelerate's `prepare_model`: its floating
    parameters cast to the mixed precision dtype, in place (`p.data`: the optimizer keeps its parameters)."""
    if dtype is not None:
        for p in model.parameters():
            if p.dtype in (torch.float16, torch.bfloat16, torch.float32) and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model


def _bucket_as_reduced(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _by_kind(snapshot) -> dict[str, int]:
    """A MemTracker snapshot (per device, per kind) as bytes per plan kind, summed over devices, with `total`.

    `meta` tensors are not device memory: they stand for host copies of offloaded activations (`CountingHostStore`),
    counted as host memory instead."""
    kinds = dict.fromkeys(KINDS.values(), 0)
    total = 0
    for device, device_snapshot in snapshot.items():
        if getattr(device, "type", device) == "meta":
            continue
        for key, value in device_snapshot.items():
            name = KINDS.get(getattr(key, "value", key))
            if name is not None:
                kinds[name] += value
            elif key == "Total":
                total += value
    kinds["total"] = total
    return kinds


def with_layers(model_config, layers: int):
    """A copy of `model_config` with its first `layers` decoder layers (per-layer lists cut to match)."""
    config = copy.deepcopy(model_config)
    config.num_hidden_layers = layers
    for name in ("layer_types", "mlp_only_layers"):
        value = getattr(config, name, None)
        if isinstance(value, list) and len(value) > layers:
            setattr(config, name, value[:layers])
    return config


def _extrapolate(small: TracedStep, large: TracedStep, small_layers: int, large_layers: int, layers: int) -> TracedStep:
    """The step of a `layers`-layer model from traces of `small_layers` and `large_layers` (consecutive) layers:
    every size is affine in the layer count (each layer adds its weights, gradients, optimizer states, and the
    activations it keeps; the peak's other parts are those of one layer, or of the head), so each part of each
    phase is extended by its measured per-layer increment."""
    scale = (layers - small_layers) / (large_layers - small_layers)

    def extend(a, b):
        if isinstance(a, dict):
            return {key: extend(a[key], b[key]) for key in a}
        return round(a + (b - a) * scale)

    values = {}
    layout = _extend_layout(large, large_layers, layers)
    for f in dataclasses.fields(TracedStep):
        a, b = getattr(small, f.name), getattr(large, f.name)
        if f.name in ("parameters", "param_groups", "gradient_order", "peak_context"):
            values[f.name] = layout.get(f.name, b)
        elif f.name == "segments":
            values[f.name] = _extend_segments(small, large, small_layers, large_layers, layers)
        elif f.name in ("row_tokens", "rank_tokens"):
            values[f.name] = a
        elif f.name == "notes":
            values[f.name] = [*a, f"extrapolated to {layers} layers from traces of {small_layers} and {large_layers}"]
        else:
            values[f.name] = extend(a, b)
    # The peak is the larger phase's total, recomputed from the extended phases (a phase may overtake the other).
    phases = (values["forward_backward_peak"], values["optimizer_peak"])
    values["at_peak"] = max(phases, key=lambda kinds: kinds["total"])
    values["peak"] = values["at_peak"]["total"]
    return TracedStep(**values)


_LAYER = re.compile(r"(^|\.)layers\.(\d+)(\.|$)")


def layer_index(name: str | None) -> int | None:
    """The decoder layer a parameter or module name is in (`...layers.{i}...`), else None."""
    match = _LAYER.search(name or "")
    return int(match.group(2)) if match else None


def _rename_layer(name: str, layer: int) -> str:
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{layer}{m.group(3)}", name, count=1)


def _extend_layout(large: TracedStep, large_layers: int, layers: int) -> dict:
    """The layout fields of a `layers`-layer model from a trace of `large_layers`: its last layer's parameters
    repeated for the layers added (same groups), their gradients where backward accumulates them (a layer's after
    the layers above it), and the peak's context moved with them (in backward: as far from the top; in forward: the
    same layer)."""
    last = large_layers - 1
    params = large.parameters
    template = [i for i, p in enumerate(params) if layer_index(p[0]) == last]
    if not template:  # no decoder layers named as such: the layout stays the traced one
        return {}
    added = {}  # (template index, layer) -> new index
    new_params = []
    position = {}
    for i, p in enumerate(params):
        position[i] = len(new_params)
        new_params.append(p)
        if i == template[-1]:
            for layer in range(large_layers, layers):
                for t in template:
                    added[(t, layer)] = len(new_params)
                    name, numel, size, trainable = params[t]
                    new_params.append((_rename_layer(name, layer), numel, size, trainable))
    group_of = {i: g for g, members in enumerate(large.param_groups) for i in members}
    groups = [[position[i] for i in members] for members in large.param_groups]
    for (t, _), new in sorted(added.items(), key=lambda kv: kv[1]):
        if t in group_of:
            groups[group_of[t]].append(new)
    groups = [sorted(g) for g in groups]
    # Backward accumulates the top layers' gradients first: the added layers' (top down) before the last traced one's.
    # A backward peak keeps its distance from the top (its count of gradients, its layer counted from the top).
    order = []
    members = set(template)
    first_of_last = next((k for k, i in enumerate(large.gradient_order) if i in members), None)
    for k, i in enumerate(large.gradient_order):
        if k == first_of_last:
            block = [j for j in large.gradient_order if j in members]
            for layer in range(layers - 1, last, -1):
                order += [added[(t, layer)] for t in block]
        order.append(position[i])
    context = dict(large.peak_context)
    module = context.get("module")
    index = layer_index(module)
    if index is not None and context.get("backward"):
        context["module"] = _rename_layer(module, index + layers - large_layers)
    return {"parameters": new_params, "param_groups": groups, "gradient_order": order, "peak_context": context}


def _extend_segments(small: TracedStep, large: TracedStep, small_layers: int, large_layers: int, layers: int):
    """The segments of a `layers`-layer model: the larger trace's, each grown by the per-layer growth of the
    forward/backward peak (so that its peak's segment extends as the peak does: where a segment falls moves with the
    layers, a peak in the second layer from the top of one trace and the top one of the other, so segments are not
    matched across the traces), a module's layer counted from the top (as the gradients its backward accumulated)."""
    scale = (layers - small_layers) / (large_layers - small_layers) - 1
    growth = {kind: large.forward_backward_peak[kind] - small.forward_backward_peak[kind]
              for kind in large.forward_backward_peak}  # fmt: skip
    segments = []
    for context, parts in large.segments:
        module, index = context.get("module"), layer_index(context.get("module"))
        if index is not None:
            context = {**context, "module": _rename_layer(module, index + layers - large_layers)}
        segments.append((context, {kind: round(value + growth.get(kind, 0) * scale) for kind, value in parts.items()}))
    return segments


def unchecked_layer_count(training_args, layers: int) -> int:
    """How many of a `layers`-layer model's decoder layers a run with these arguments leaves unchecked: the first
    `unchecked_layers` (`trl_longrm.memory.partial_checkpointing`), and those transformers' `every_n_layers` skips;
    0 without gradient checkpointing (no layer is checkpointed: nothing to count apart)."""
    if not getattr(training_args, "activation_checkpointing", False):
        return 0
    kwargs = getattr(training_args, "activation_checkpointing_kwargs", None) or {}
    every = int(kwargs.get("every_n_layers", 1) or 1)
    unchecked = {i for i in range(layers) if i % every} | set(range(min(unchecked_layers(training_args), layers)))
    return len(unchecked)


def with_unchecked_layers(training_args, unchecked: int):
    """A copy of `training_args` whose checkpointing leaves the first `unchecked` decoder layers unchecked and
    checkpoints the rest (its other checkpointing keys kept, but `every_n_layers`)."""
    kwargs = {k: v for k, v in (training_args.activation_checkpointing_kwargs or {}).items() if k != "every_n_layers"}
    kwargs[UNCHECKED_KEY] = unchecked
    return fresh_args(training_args, activation_checkpointing_kwargs=kwargs, gradient_checkpointing_kwargs=kwargs)


def _add_unchecked_layers(step: TracedStep, by_unchecked: list[TracedStep], unchecked: int) -> TracedStep:
    """`step` (every layer checkpointed) with its first `unchecked` layers unchecked, from traces of one model with 0,
    1 and 2 (if `unchecked` > 1) first layers unchecked (`by_unchecked`, its top layer checkpointed): the first
    unchecked layer adds what the first adds there, each further one what the second adds (its activations kept from
    forward to backward, its recompute gone). The first differs by a hidden state: its input is the embeddings'
    output. Which layers does not matter to the peak past that: all unchecked layers' activations are live when
    backward starts, and the top layer (checkpointed) recomputes as before."""
    increments = [(by_unchecked[0], by_unchecked[1], 1)]
    if unchecked > 1:
        increments.append((by_unchecked[1], by_unchecked[2], unchecked - 1))

    def delta(a, b):
        return {key: delta(a[key], b[key]) for key in a} if isinstance(a, dict) else b - a

    def plus(value, change, times):
        return {key: plus(value[key], change[key], times) for key in value} if isinstance(value, dict) else (
            value + change * times)

    values = {f.name: getattr(step, f.name) for f in dataclasses.fields(TracedStep)}
    growth = {kind: 0 for kind in step.forward_backward_peak}
    for a, b, times in increments:
        for name in ("forward_backward_peak", "optimizer_peak", "at_start", "host_bytes"):
            values[name] = plus(values[name], delta(getattr(a, name), getattr(b, name)), times)
        growth = plus(growth, delta(a.forward_backward_peak, b.forward_backward_peak), times)
    # Each segment (a ZeRO plan's contexts) grows as the forward/backward peak does.
    values["segments"] = [(context, {kind: v + growth.get(kind, 0) for kind, v in parts.items()})
                          for context, parts in step.segments]  # fmt: skip
    values["notes"] = [*step.notes, f"its first {unchecked} layers unchecked (traced with 0, 1 and 2 unchecked)"]
    phases = (values["forward_backward_peak"], values["optimizer_peak"])
    values["at_peak"] = max(phases, key=lambda kinds: kinds["total"])
    values["peak"] = values["at_peak"]["total"]
    return TracedStep(**values)


def trace_step(stage: str, training_args, model_config, shape: GroupShape, *, peft_config=None,
               dtype: torch.dtype | None = None, world_size: int = 1, rank: int = 0,
               max_traced_layers: int | None = None, ddp: bool = True, stock: bool = False,
               kernels: str = "cpu", attention: str = "flash_attn", load_in_4bit: bool = False,
               nested_quant: bool = True, pool=None) -> TracedStep:  # fmt: skip
    """Trace one optimizer step of `stage`'s trainer on rank `rank` of `world_size` (see the module docstring).

    `max_traced_layers`: a model with more decoder layers is traced with `max_traced_layers - 1` and
    `max_traced_layers` of them and extrapolated per layer (`_extrapolate`; checked against full traces in
    tests/test_memory_plan.py). None traces every layer. `ddp=False` leaves the model unwrapped on several ranks (a
    ZeRO run: DeepSpeed, not DDP, holds its gradients; `plan.zero_terms` adds them). `stock=True` traces stock TRL's
    trainer of the stage instead, on the same model, group and training arguments (`trl_longrm.memory_plan.stock`).
    `kernels`: the device whose attention kernels are traced ('cuda': flash-attn's allocations,
    `trl_longrm.memory_plan.planned_kernels`; 'cpu': the CPU kernels a CPU run uses). `attention`: on
    'cuda', whose attention kernels: 'flash_attn' (what 'auto' takes before Hopper with flash-attn installed) or 'cudnn'
    (from Hopper on, and without flash-attn).
    `load_in_4bit`: the model goes through the trainer as a bitsandbytes 4-bit load does, its quantized layers in
    `dtype` (`quantized.loaded_in_4bit`, `as_4bit_layers`; `quantized.quantize_plan` then puts their weights in 4
    bits). `pool`: an executor of other processes (`trace_processes`) that runs the extrapolation's other traces
    while this process runs the first."""
    layers = model_config.num_hidden_layers
    if max_traced_layers is not None and layers > max_traced_layers:
        if max_traced_layers < 2:
            raise ValueError("max_traced_layers must be at least 2 (two traces give the per-layer increment).")
        trace = functools.partial(_trace_step, stage, shape=shape, peft_config=peft_config, dtype=dtype,
                                  world_size=world_size, rank=rank, ddp=ddp, stock=stock, kernels=kernels,
                                  attention=attention, load_in_4bit=load_in_4bit, nested_quant=nested_quant)  # fmt: skip
        # Partial checkpointing: the traced models are too shallow to hold the run's unchecked layers; each is traced
        # checkpointed, and one unchecked layer's difference added per unchecked layer (`_add_unchecked_layers`).
        unchecked = 0 if stock else unchecked_layer_count(training_args, layers)
        partial = 0 < unchecked < layers
        args = with_unchecked_layers(training_args, 0) if partial else training_args
        # The deeper (longer) trace in this process, the other beside it where a pool is given; in depth order after.
        depths = (max_traced_layers, max_traced_layers - 1)
        traces = _run_traces(trace, [(args, with_layers(model_config, n)) for n in depths], pool)[::-1]
        step = _extrapolate(*traces, max_traced_layers - 1, max_traced_layers, layers)
        if partial:
            # A model deep enough for 2 unchecked layers under a checkpointed one.
            depth = max(max_traced_layers, 3) if unchecked > 1 else max_traced_layers
            jobs = [(with_unchecked_layers(training_args, n), with_layers(model_config, depth))
                    for n in range(1, min(unchecked, 2) + 1)]  # fmt: skip
            if depth != max_traced_layers:
                jobs.insert(0, (args, with_layers(model_config, depth)))
            by_unchecked = ([traces[1]] if depth == max_traced_layers else []) + _run_traces(trace, jobs, pool)
            step = _add_unchecked_layers(step, by_unchecked, unchecked)
        return step
    return _trace_step(stage, training_args, model_config, shape, peft_config=peft_config, dtype=dtype,
                       world_size=world_size, rank=rank, ddp=ddp, stock=stock, kernels=kernels,
                       attention=attention, load_in_4bit=load_in_4bit, nested_quant=nested_quant)  # fmt: skip


@contextlib.contextmanager
def _transformers_verbosity_kept():
    """The traced trainer's `log_level="error"` sets transformers' verbosity for the whole process (HF Trainer's
    `__init__` does): the caller's verbosity is restored after the trace, so that a plan made in a user's process does
    not silence transformers' warnings there."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


@contextlib.contextmanager
def _collections_skip_older_objects():
    """Garbage collections during a trace traverse only what the trace made: the Trainer collects at the start of
    `train()` (accelerate's `free_memory`), a full collection of a process holding torch, transformers and DeepSpeed,
    0.3 s a trace (a tenth of the search). What was alive before is frozen meanwhile (`gc.freeze`), then handed back
    to the collector; it holds nothing the trace's memory tracker counts."""
    import gc

    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _run_traces(trace, jobs: list[tuple], pool) -> list[TracedStep]:
    """`trace(*job)` of each job, in order. With `pool`, all but the first run in its processes while this one runs
    the first: each trace is a fake run of its own, on a model and arguments it is given whole."""
    if pool is None or len(jobs) < 2:
        return [trace(*job) for job in jobs]
    futures = [pool.submit(trace, *job) for job in jobs[1:]]
    try:
        first = trace(*jobs[0])
    except BaseException:
        for future in futures:
            future.cancel()  # (one already running finishes; its result is dropped)
        raise
    return [first, *(future.result() for future in futures)]


def _trace_worker() -> None:
    """A tracing process: one torch thread, and quiet (a fake run's logs, bars and warnings read as a failed run;
    the process that asked prints what the plan says)."""
    import sys

    import datasets
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    warnings.simplefilter("ignore")
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the process's own stdout, for its life)


def _import_trainers() -> None:
    """A tracing process's first job: the trainers' imports (TRL, DeepSpeed: seconds), while the process that asked
    is still setting up, not inside its first trace."""
    from trl_longrm.stages import stage_classes

    for stage in ("sft", "simpo_grm", "simpo_disrm"):
        stage_classes(stage)


@contextlib.contextmanager
def trace_processes(processes: int | None = None):
    """An executor of `processes - 1` other processes for `trace_step(pool=...)` (None for one process): a plan's two
    traces (of 2 and 3 layers) then run at once, each process with one torch thread (a fake trace is Python-bound),
    this one too while the executor lives; the others print nothing. Default: 2 where this process may use 2 cores or
    more. The processes are spawned (a few seconds of imports, once) and stopped on leaving the context."""
    import concurrent.futures
    import multiprocessing

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    processes = min(2, cores) if processes is None else processes
    if processes < 2:
        yield None
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with concurrent.futures.ProcessPoolExecutor(processes - 1, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_trace_worker) as pool:  # fmt: skip
            for _ in range(processes - 1):
                pool.submit(_import_trainers)
            yield pool
    finally:
        torch.set_num_threads(threads)


def _trace_step(stage: str, training_args, model_config, shape: GroupShape, *, peft_config=None,
                dtype: torch.dtype | None = None, world_size: int = 1, rank: int = 0, ddp: bool = True,
                stock: bool = False, kernels: str = "cpu", attention: str = "flash_attn",
                load_in_4bit: bool = False, nested_quant: bool = True) -> TracedStep:  # fmt: skip
    """One trace of `trace_step`: the trainer built on fake weights and `trainer.train()` for one optimizer step.

    The dataset holds the rows of that step for every data-parallel replica (the sampler gives this rank its
    replica's): a row is one micro-batch of `per_device_train_batch_size` groups, or with `max_tokens_per_row` (SFT:
    packing) as many groups of the shape as the row holds."""
    from trl_longrm.stages import stage_classes
    from trl_longrm.testing_utils import build_chat_tokenizer

    # PEFT rewrites the config it is given: `target_modules="all-linear"` becomes the full names of the first model's
    # linear layers (and SEQ_CLS appends its head to `modules_to_save`). Each trace takes its own copy: the second
    # trace of the per-layer extrapolation, a model one layer deeper, got no adapters on its extra layer from a shared
    # one, and every LoRA layer past the first traced ones was planned without its recomputation (the 8B LoRA runs
    # on an H200 at twice their plan), and the caller's config is left as it was.
    peft_config = copy.deepcopy(peft_config)
    trainer_cls, _, _ = stage_classes(stage)
    tokenizer = build_chat_tokenizer()
    sp = getattr(training_args, "sequence_parallel_size", 1) or 1
    if stock:
        from trl_longrm.memory_plan.stock import stock_classes

        trainer_cls, _ = stock_classes(stage)
        sp = 1  # stock has no sequence parallelism: every rank holds whole rows
    if world_size % sp:
        raise ValueError(f"sequence_parallel_size={sp} does not divide the world size {world_size}.")
    accumulation = min(training_args.gradient_accumulation_steps, 2)  # the second micro-batch runs with gradients
    per_device = training_args.per_device_train_batch_size
    shared = bool(getattr(training_args, "shared_prefix", False)) and bool(training_args.padding_free)
    group_tokens = shape.tokens(shared, stage)
    row_budget = getattr(training_args, "max_tokens_per_row", None)
    if stage == "sft" and getattr(training_args, "packing", False):
        row_budget = row_budget or training_args.max_length
    if stock:
        # A micro-batch of `per_device` pairs (chosen and rejected padded to one length) or SFT examples.
        row_budget = None
        group_tokens = shape.prompt_tokens + shape.response_tokens
        if stage != "sft":
            group_tokens *= 2
    groups_per_row = max(row_budget // group_tokens, 1) if row_budget else per_device
    num_rows = groups_per_row * accumulation * (world_size // sp)
    callback = _TraceStep(workspaces=kernels == "cpu")
    callback.record_segments = not ddp
    with (
        _transformers_verbosity_kept(),
        _collections_skip_older_objects(),
        fake_world(rank, world_size),
        tempfile.TemporaryDirectory() as tmp,
    ):
        overrides = dict(
            output_dir=tmp, max_steps=1, num_train_epochs=1, gradient_accumulation_steps=accumulation,
            save_strategy="no", eval_strategy="no", report_to=[], logging_steps=1, disable_tqdm=True,
            dataloader_num_workers=0, use_cpu=True, push_to_hub=False, resume_from_checkpoint=None,
            log_level="error", log_level_replica="error",  # the trainer's own logger level: a traced run's notes
        )  # fmt: skip
        if stock and stage != "sft":  # (stock SFTTrainer takes the same examples as ours)
            from trl_longrm.memory_plan.stock import stock_args, stock_dataset

            args = stock_args(stage, training_args, shape, **overrides)
            # Stock's rows are pairs: a group of k rejected responses is k of them (the step traces the first ones).
            groups = -(-num_rows // max(shape.num_rejected, 1))
            dataset = stock_dataset(stage, shape, groups, model_config.vocab_size, tokenizer.eos_token_id)
        else:
            if stock:
                from trl_longrm.memory_plan.stock import stock_args

                args = stock_args(stage, training_args, shape, **overrides)
            else:
                args = fresh_args(training_args, **overrides)
            dataset = synthetic_dataset(stage, shape, num_rows, model_config.vocab_size, tokenizer.eos_token_id)
        # Built and trained under the planned kernels: a CUDA run's checks of its attention backend (at the trainer's
        # construction) pass where the plan is made, flash-attn or not.
        with HybridFakeMode(), warnings.catch_warnings(), planned_kernels(kernels, attention):
            warnings.simplefilter("ignore")
            model = build_model(stage, model_config, dtype)
            if load_in_4bit:
                loaded_in_4bit(model)
            if stock:
                from trl_longrm.trainers.common import install_activation_offload, stock_activation_offloading_off

                # TRL's `activation_offloading` and transformers' checkpoint offload need an accelerator; on the CPU of
                # the trace ours stands in for them, by the same rule (what is saved, what is offloaded).
                with stock_activation_offloading_off(args):
                    trainer = trainer_cls(
                        model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                        peft_config=peft_config, callbacks=[callback],
                    )  # fmt: skip
                install_activation_offload(trainer)
            else:
                trainer = trainer_cls(
                    model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config,
                    callbacks=[callback],
                )  # fmt: skip
            callback.trainer = trainer
            if load_in_4bit:
                as_4bit_layers(trainer.model, dtype, nested_quant, kernels)
            if not ddp:
                # A ZeRO run: DeepSpeed (which does not run on fake tensors) takes the place of DDP's wrapper, and of
                # accelerate's autocast: with bf16 (fp16) its engine casts every parameter, a LoRA adapter's fp32
                # weights too, to that dtype (deepspeed/runtime/engine.py `_cast_module_mixed_precision`).
                trainer.accelerator.prepare_model = functools.partial(_as_deepspeed_casts, dtype=(
                    torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None))
            try:
                # Where a CUDA run's code path differs from a CPU one's (masked SDPA, TRL's fused log-probs).
                cuda_paths = cuda_code_paths() if kernels == "cuda" else contextlib.nullcontext()
                # (A CPU plan of several ranks stands for a gloo run, the one it is checked against.)
                works = collectives_hold_their_tensors(gloo=kernels == "cpu")
                rng_states = rng_states_tracked() if kernels == "cpu" else contextlib.nullcontext()
                # A CUDA run's host copies are pinned: each holds its size rounded up to a power of two.
                with use_host_store(CountingHostStore(pinned=kernels == "cuda")) as host, cuda_paths, works, rng_states:
                    trainer.train()
            finally:
                callback.close()
            model = trainer.model
            parameters = list(model.parameters())
            trainable = [p for p in parameters if p.requires_grad]
            optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            state_bytes = sum(
                v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            )  # fmt: skip
            row_tokens = groups_per_row * group_tokens if row_budget else per_device * group_tokens
            forward_backward, optimizer_phase = _by_kind(callback.forward_backward_peak), _by_kind(callback.peak)
            at_peak = max(forward_backward, optimizer_phase, key=lambda kinds: kinds["total"])
            traced = TracedStep(
                peak=at_peak["total"],
                at_peak=at_peak,
                at_start=callback.at_start,
                forward_backward_peak=forward_backward,
                optimizer_peak=optimizer_phase,
                trainable_parameters=sum(p.numel() for p in trainable),
                total_parameters=sum(p.numel() for p in parameters),
                weight_bytes=sum(p.numel() * p.element_size() for p in parameters),
                trainable_weight_bytes=sum(p.numel() * p.element_size() for p in trainable),
                gradient_bytes=sum(p.numel() * p.element_size() for p in trainable),
                optimizer_state_bytes=state_bytes,
                row_tokens=row_tokens,
                rank_tokens=-(-row_tokens // sp),
                host_bytes=host.peak_bytes,
                parameters=callback.parameters,
                param_groups=callback.param_groups,
                gradient_order=callback.gradient_order,
                peak_context=callback.forward_backward_context,
                segments=callback.forward_backward_segments,
            )
            del trainer, model, optimizer, parameters, trainable
    return traced
