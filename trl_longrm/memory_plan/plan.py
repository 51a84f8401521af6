"""The per-rank memory plan of a run: the traced step (`trl_longrm.memory_plan.trace`) plus named terms for what the
trace cannot see, as data (`MemoryPlan`) and as text.

What is traced and what is a term:

- traced, exactly as the run does it: weights, gradients and the optimizer's states (the optimizer the config names,
  its states allocated by its own first step), activations and temporaries of forward, backward (with gradient
  checkpointing as configured) and the optimizer step, for the rank predicted (its slice of the row, its gathered or
  exchanged keys/values), DDP's wrapper included;
- terms where DeepSpeed's ZeRO partitions, flattens, buckets or gathers what the trace holds whole (`zero_terms`, from
  `trl_longrm.memory_plan.deepspeed`): its partitions and buffers, sized from the traced model's layout and the run's
  DeepSpeed config as DeepSpeed resolves it (its defaults for what an accelerate YAML leaves unset, "auto" from the
  hidden size), and with offload the states DeepSpeed keeps in host memory (`host_terms`);
- on CUDA, constants for what no tensor holds: the CUDA context and library workspaces, NCCL's buffers, and the
  caching allocator's fragmentation (`CUDA_*`, `NCCL_*`); none on CPU, where the plan is checked against the tensor
  bytes a run allocates (`tests/test_memory_plan.py`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from trl_longrm.memory_plan.deepspeed import ZeroSettings, describe_settings, zero_phase, zero_settings
from trl_longrm.memory_plan.planned_kernels import planned_cuda_attention
from trl_longrm.memory_plan.shapes import model_config_file
from trl_longrm.memory_plan.trace import GroupShape, TracedStep, trace_step
from trl_longrm.sequence_parallel.groups import communicator_sizes


GIB = 2**30

# CUDA only (not tensors, so not traced): the CUDA context with cuBLAS / cuDNN workspaces of a PyTorch process on an
# H100 (the order of what `nvidia-smi` shows for a process that has run one matmul), NCCL's communication buffers of
# each communicator a rank is in (`communicator_sizes`: NCCL_BUFFSIZE 4 MiB x channels x peers, by its defaults), and
# a margin for the caching allocator's fragmentation of the peak (blocks cached but not reusable at that size).
# Estimates not yet measured on a GPU (see docs/memory_plan.md); the card's own memory is measured (`devices.py`).
CUDA_CONTEXT_BYTES = 750 * 2**20
NCCL_BUFFER_BYTES = 256 * 2**20
CUDA_FRAGMENTATION_FRACTION = 0.05

_TENSOR_KINDS = ("weights", "buffers", "gradients", "optimizer_states", "activations", "temporaries", "other")

# Layers traced before the per-layer extrapolation (`trace_step`): 3 and 2 layers, a few seconds each at 128K tokens.
DEFAULT_MAX_TRACED_LAYERS = 3


@dataclass
class MemoryPlan:
    """Per-rank memory of one optimizer step of a run, in bytes (see the module docstring for what each part counts).

    `peak` is what the rank needs: the larger of the forward/backward peak and the optimizer step's peak, each with
    the terms of its phase (`extra`). `weights` ... `temporaries` are the parts live at that peak.
    """

    stage: str
    trainer: str  # the traced trainer class: ours, or stock TRL's (`plan_memory(..., stock=True)`)
    rank: int
    world_size: int
    sequence_parallel_size: int
    sequence_parallel_mode: str | None
    distributed: str  # "single", "ddp", "zero2", "zero3"
    device: str  # "cpu" (checked against CPU runs) or "cuda" (CUDA terms added)
    group: dict
    row_tokens: int
    rank_tokens: int
    trainable_parameters: int
    total_parameters: int
    weights: int
    # Of `weights`, those of the trainable parameters (a LoRA adapter's: what a run allocates after the base model).
    trainable_weights: int
    gradients: int
    optimizer_states: int
    activations: int
    temporaries: int
    extra: dict[str, int] = field(default_factory=dict)
    # Host (CPU) memory this rank holds at its peak: offloaded activations, and what DeepSpeed offloads (`host_terms`).
    host_memory: int = 0
    host_terms: dict[str, int] = field(default_factory=dict)
    peak: int = 0
    peak_phase: str = ""
    traced_peak: int = 0
    trace_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def fits(self, device_bytes: int) -> bool:
        return self.peak <= device_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self, device_bytes: int | None = None) -> str:
        """A few lines: the parts in GiB, the peak, and whether it fits `device_bytes`."""
        parts = [("weights", self.weights), ("gradients", self.gradients), ("optimizer states", self.optimizer_states),
                 ("activations", self.activations), ("temporaries", self.temporaries), *self.extra.items()]  # fmt: skip
        lines = [
            f"{self.trainer}, rank {self.rank} of {self.world_size} ({self.distributed}, sequence parallel {self.sequence_parallel_size}"
            f"{' ' + self.sequence_parallel_mode if self.sequence_parallel_mode else ''}): {self.rank_tokens:,} of "
            f"{self.row_tokens:,} tokens of a row"
        ]
        lines += [f"  {name:<34s} {value / GIB:9.2f} GiB" for name, value in parts]
        verdict = ""
        if device_bytes is not None:
            verdict = (
                f" -> fits {device_bytes / GIB:.0f} GiB" if self.fits(device_bytes)
                else f" -> does NOT fit {device_bytes / GIB:.0f} GiB"
            )  # fmt: skip
        lines.append(f"  {'peak (' + self.peak_phase + ')':<34s} {self.peak / GIB:9.2f} GiB{verdict}")
        lines += [f"  {'host: ' + name:<34s} {value / GIB:9.2f} GiB" for name, value in self.host_terms.items()]
        if self.host_memory:
            lines.append(f"  {'host memory (offloaded)':<34s} {self.host_memory / GIB:9.2f} GiB")
        return "\n".join(lines)


def zero_terms(traced: TracedStep, settings: ZeroSettings, world_size: int, rank: int, phase_name: str,
               phase: dict[str, int], checkpointing: bool) -> tuple[dict, dict[str, int], dict[str, int]]:  # fmt: skip
    """ZeRO's replacement of the traced parts of `phase` (a peak's parts by kind, of phase `phase_name`) on rank
    `rank`, its device terms and its host terms (what it offloads).

    The trace holds every weight, gradient and torch optimizer state whole; DeepSpeed holds per rank, as its code
    allocates them (`trl_longrm.memory_plan.deepspeed`, each term with the DeepSpeed function it follows):
    ZeRO-2: the trainable weights flattened (padded) on every rank, the rank's fp32 partition and the optimizer's
    states on it, the gradient bucket(s) of `reduce_bucket_size` elements in backward whatever the trainable count (two
    with `overlap_comm`), and the gradients of the parameters its partition overlaps once a bucket of them is
    reduced; ZeRO-3: every parameter partitioned (frozen ones too) and those under `stage3_param_persistence_threshold`
    whole besides, the parameters gathered at the peak (of all parameters, by the coordinator's prefetch and reuse
    rules), one gradient bucket and the gradient partition allocated once; with offload, the optimizer's states,
    fp32 weights and gradient partitions (and the parameters' partitions) in host memory.

    What DeepSpeed holds changes within a phase (its buckets from a backward's first gradient on, its gathered
    parameters with the module), so the forward/backward peak is the largest over the trace's segments (the peak of
    each context: `TracedStep.segments`) of the traced parts plus DeepSpeed's at that context, not DeepSpeed's at the
    traced peak."""
    candidates = [(phase, None)]
    if phase_name == "forward/backward" and traced.segments:
        candidates = [(parts, context) for context, parts in traced.segments]
    best = None
    for parts, context in candidates:
        result = zero_phase(traced, settings, world_size, rank, phase_name, parts, checkpointing, context)
        total = sum(result[0][k] for k in _TENSOR_KINDS) + sum(result[1].values())
        if best is None or total > best[0]:
            best = (total, result)
    return best[1]


def _combine(traced: TracedStep, distributed: str, world_size: int, device: str, communicators: int = 1,
             zero: ZeroSettings | None = None, rank: int = 0, checkpointing: bool = False):  # fmt: skip
    """Per phase (forward/backward, optimizer step): the parts and terms, and which phase peaks; and the host terms."""
    phases, host_terms = {}, {}
    for name, phase in (("forward/backward", traced.forward_backward_peak), ("optimizer step", traced.optimizer_peak)):
        parts, terms = dict(phase), {}
        if distributed in ("zero2", "zero3"):
            parts, terms, host = zero_terms(traced, zero, world_size, rank, name, phase, checkpointing)
            host_terms.update(host)
        elif distributed == "ddp":
            # DDP's gradient buckets (our trainers set gradient_as_bucket_view: the gradients are views of them) are
            # allocated when the model is wrapped and live through every step; the trace counts a bucket as gradients
            # from its first write in backward on (`trace._memory_tracker`), this term the buckets not written by then.
            terms["ddp_gradient_buckets"] = max(traced.gradient_bytes - parts["gradients"], 0)
        if device == "cuda":
            terms["cuda_context"] = CUDA_CONTEXT_BYTES
            if world_size > 1:
                terms["nccl_buffers"] = NCCL_BUFFER_BYTES * communicators
        tensors = sum(parts[k] for k in _TENSOR_KINDS)
        if device == "cuda":
            terms["allocator_fragmentation"] = int(CUDA_FRAGMENTATION_FRACTION * (tensors + sum(terms.values())))
        phases[name] = (parts, terms, tensors + sum(terms.values()))
    return (*max(phases.items(), key=lambda item: item[1][2]), host_terms)


def plan_memory(
    stage: str,
    training_args,
    model_config,
    shape: GroupShape,
    *,
    peft_config=None,
    dtype: torch.dtype | None = None,
    world_size: int = 1,
    rank: int = 0,
    distributed: str | None = None,
    device: str = "cpu",
    max_traced_layers: int | None = DEFAULT_MAX_TRACED_LAYERS,
    stock: bool = False,
    attention: str | None = None,
    load_in_4bit: bool = False,
    nested_quant: bool = True,
    deepspeed_config=None,
    traced: TracedStep | None = None,
) -> MemoryPlan:
    """The memory plan of rank `rank` of a `world_size`-process run of `stage` ('sft', 'simpo_grm', 'simpo_disrm') with
    `training_args` (the stage's config, as a recipe builds it) on a model of `model_config` (a transformers config, or
    a `config.json` path; nothing is downloaded), for batches of groups of `shape`.

    `distributed`: 'single', 'ddp', 'zero2' or 'zero3' (default: 'single' on one process, else 'ddp'). `device`:
    'cpu' counts tensors only (what a CPU run's allocator events show); 'cuda' adds the CUDA terms.
    `max_traced_layers`: deeper models are traced with this many layers and one less, and extrapolated per layer
    (`trace_step`); None traces every layer (an 8B model at 128K then takes minutes on two cores).
    `stock=True`: the plan of stock TRL's trainer of the stage on the same model, group and training arguments
    (`trl_longrm.memory_plan.stock`: pairs of whole rows, no sequence parallelism). `attention` (device 'cuda'): the
    attention kernels our trainers' run takes, 'flash_attn' or 'cudnn' (cuDNN's fused attention, its grouped-query
    heads repeated per call); default: those `training_args.ring_attn_backend` resolves to
    (`trl_longrm.memory_plan.planned_kernels.planned_cuda_attention`). `load_in_4bit` (QLoRA; `nested_quant`:
    bitsandbytes' double quantization): the model as a 4-bit load trains it, its 4-bit layers traced in `dtype` (their
    compute dtype, default bfloat16) and their weights then counted in 4 bits (`trl_longrm.memory_plan.quantized`).
    `traced`: a step already traced with these arguments (`trace_step`), whose terms are recombined for
    `distributed` and `deepspeed_config` instead of tracing again (what a search over ZeRO settings reuses).
    `deepspeed_config` (ZeRO): the DeepSpeed config
    the run uses, a dict or a JSON path (default: `training_args.deepspeed`, else what accelerate builds from an
    accelerate YAML: the stage alone, DeepSpeed's defaults for the rest; `accelerate_deepspeed_config` builds it from
    a YAML's `deepspeed_config` section, offload devices included).

    Example:
    ```python
    >>> from trl_longrm import SimPOGRMConfig
    >>> from trl_longrm.memory_plan import GroupShape, plan_memory
    >>> args = SimPOGRMConfig(output_dir="grm", use_cpu=True, sequence_parallel_size=8, gradient_checkpointing=True)
    >>> plan = plan_memory("simpo_grm", args, "qwen3-8b", GroupShape(120_000, 2_000, 4),
    ...                    world_size=8, rank=7, distributed="zero2", device="cuda")
    >>> print(plan.describe(80 * 2**30))
    ```
    """
    if isinstance(model_config, (str, bytes)) or hasattr(model_config, "__fspath__"):
        model_config = load_model_config(model_config)
    distributed = distributed or ("single" if world_size == 1 else "ddp")
    if distributed not in ("single", "ddp", "zero2", "zero3"):
        raise ValueError(f"distributed={distributed!r}: expected 'single', 'ddp', 'zero2' or 'zero3'.")
    if attention is None:
        attention = planned_cuda_attention(getattr(training_args, "ring_attn_backend", "auto") or "auto")
    if load_in_4bit:
        dtype = dtype or torch.bfloat16
    zero = None
    if distributed in ("zero2", "zero3"):
        config = deepspeed_config if deepspeed_config is not None else getattr(training_args, "deepspeed", None)
        zero = zero_settings(config, int(distributed[-1]), getattr(model_config, "hidden_size", None))
    started = time.perf_counter()
    if traced is None:
        traced = trace_step(stage, training_args, model_config, shape, peft_config=peft_config, dtype=dtype,
                            world_size=world_size, rank=rank, max_traced_layers=max_traced_layers,
                            ddp=distributed not in ("zero2", "zero3"), stock=stock, kernels=device,
                            attention=attention, load_in_4bit=load_in_4bit, nested_quant=nested_quant)  # fmt: skip
    seconds = time.perf_counter() - started
    sp = 1 if stock else getattr(training_args, "sequence_parallel_size", 1) or 1
    groups = communicator_sizes(world_size, sp, getattr(training_args, "sequence_parallel_mode", "ring") or "ring",
                                getattr(training_args, "ulysses_size", None))  # fmt: skip
    checkpointing = bool(getattr(training_args, "gradient_checkpointing", False))
    phase, (parts, terms, peak), host_terms = _combine(traced, distributed, world_size, device, len(groups), zero, rank,
                                                       checkpointing)  # fmt: skip
    plan = MemoryPlan(
        stage=stage,
        trainer=_trainer_name(stage, stock),
        rank=rank,
        world_size=world_size,
        sequence_parallel_size=sp,
        sequence_parallel_mode=getattr(training_args, "sequence_parallel_mode", None) if sp > 1 else None,
        distributed=distributed,
        device=device,
        group=asdict(shape),
        row_tokens=traced.row_tokens,
        rank_tokens=traced.rank_tokens,
        trainable_parameters=traced.trainable_parameters,
        total_parameters=traced.total_parameters,
        weights=parts["weights"] + parts["buffers"],
        trainable_weights=traced.trainable_weight_bytes // (world_size if distributed == "zero3" else 1),
        gradients=parts["gradients"],
        optimizer_states=parts["optimizer_states"],
        activations=parts["activations"],
        temporaries=parts["temporaries"] + parts["other"],
        extra=terms,
        host_memory=traced.host_bytes + sum(host_terms.values()),
        host_terms=host_terms,
        peak=peak,
        peak_phase=phase,
        traced_peak=traced.peak,
        trace_seconds=round(seconds, 2),
        notes=[*traced.notes, *_kernel_notes(device, attention), *([describe_settings(zero)] if zero else [])],
    )
    if load_in_4bit:
        from trl_longrm.memory_plan.quantized import quantize_plan

        plan = quantize_plan(plan, stage, model_config, nested_quant, torch.empty((), dtype=dtype).element_size(),
                             CUDA_FRAGMENTATION_FRACTION)
    return plan


def _trainer_name(stage: str, stock: bool) -> str:
    if stock:
        from trl_longrm.memory_plan.stock import STOCK_TRAINERS

        return STOCK_TRAINERS[stage][1]
    from trl_longrm.stages import STAGES

    return STAGES[stage][0]


def _kernel_notes(device: str, attention: str) -> list[str]:
    if device != "cuda":
        return []
    # The trace runs on CPU fake tensors; `planned_kernels("cuda", attention)` gives our attention the kernels as
    # their allocations. Stock trainers' attention is the model's own (SDPA), traced as on CPU.
    if attention == "cudnn":
        return ["our attention traced with cuDNN's fused attention (what 'auto' takes from Hopper on, and before it "
                "without flash-attn; torch's varlen kernels for short sequences); half precision only"]
    return ["our attention traced with flash-attn's varlen kernels (their allocations; what 'auto' takes before "
            "Hopper with flash-attn installed, and `ring_attn_backend: flash_attn` or `torch`); half precision only"]


def load_model_config(path):
    """A transformers config from a `config.json` file, a model folder holding one or a bundled shape's name (read
    locally, never from the Hub)."""
    from transformers import AutoConfig

    path = model_config_file(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such config.json")
    import json

    config_dict = json.loads(path.read_text())
    return AutoConfig.for_model(**config_dict)
