"""DeepSpeed ZeRO in the memory plan: the settings a run's DeepSpeed config resolves to, and what ZeRO-2 and ZeRO-3 hold
per rank in place of the whole weights, gradients and optimizer states the trace holds (`zero_phase`).

Every term follows DeepSpeed's own code (0.19; file and function named where each is modelled), and was checked
against the tensors a DeepSpeed run on CPU allocates (tests/test_memory_plan.py, ZERO_CASES):

- the config: DeepSpeed's defaults (`deepspeed/runtime/zero/config.py::DeepSpeedZeroConfig`) for what the run's config
  leaves unset, as the config accelerate builds from an accelerate YAML does (it names the stage and the offload devices
  only: `accelerate/utils/dataclasses.py::DeepSpeedPlugin.__post_init__`); "auto" sizes from the model's hidden size
  (`transformers/integrations/deepspeed.py::HfTrainerDeepSpeedConfig.trainer_config_finalize`).
- ZeRO-2 (`deepspeed/runtime/zero/stage_1_and_2.py::DeepSpeedZeroOptimizer`): the trainable weights of each optimizer
  group flattened into one buffer padded to a multiple of 2 x world (`__init__`, `flatten_dense_tensors_aligned`),
  every rank holding all of it; each rank's partition of that buffer in fp32 (`single_partition_of_fp32_groups`) and
  the optimizer's states on it; in backward, the contiguous gradient bucket of `reduce_bucket_size` elements per
  gradient dtype, two with `overlap_comm` (`setup_buckets`, from the first gradient hook to the backward's end), and
  once a bucket holding a gradient of this rank's partition is reduced, `grads_in_partition`: the gradients of every
  parameter the partition overlaps (`copy_grads_in_partition`), which the next micro-batch of an accumulation keeps
  (`independent_gradient_partition_epilogue`) and the step flattens group by group, in fp32 (`step`).
- ZeRO-3 (`deepspeed/runtime/zero/stage3.py::DeepSpeedZeroOptimizer_Stage3`, `partition_parameters.py`,
  `parameter_offload.py`, `partitioned_param_coordinator.py`): every parameter, frozen or not, partitioned (each padded
  to a multiple of world: `Init._partition_param`); those of at most `stage3_param_persistence_threshold` elements
  kept whole on every rank besides (`DeepSpeedZeRoOffload.mark_persistent_parameters`); the trainable partitions in
  fp32 with the optimizer's states; a gradient partition buffer and one bucket per dtype, allocated once
  (`_setup_for_real_optimizer`); the parameters gathered at the peak (`gathered_at_peak`: the coordinator's fetch,
  prefetch and reuse-distance rules, `fetch_sub_module` / `release_sub_module` / `__params_to_release`); in the step,
  each sub-group's gradient partition flattened in fp32 (`_prepare_fp32_grad_for_sub_group`).
- offload (`offload_optimizer` / `offload_param` device 'cpu'): the fp32 partitions, optimizer states and gradient
  buffers (`stage3.py`: `self.device` is the CPU, `initialize_optimizer_states`), and with parameter offload the
  parameters' partitions (`_create_param_groups_fp16_flat_cpu_memory`), are host memory, reported apart from the
  device's (on a CPU run both are the same memory, so the check measures their sum).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch


# DeepSpeed's defaults where a config leaves a key unset (deepspeed/runtime/zero/config.py::DeepSpeedZeroConfig,
# checked against it in tests/test_memory_plan.py). Keys as a config names them (ZeRO-3's under their stage3_ alias).
ZERO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "contiguous_gradients": True,
    "overlap_comm": None,  # None: on for ZeRO-3 only (validator `overlap_comm_valid`)
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_model_persistence_threshold": 2**63 - 1,  # sys.maxsize
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
# The config's aliases (pydantic aliases of DeepSpeedZeroConfig): either name is read.
_ALIASES = {"prefetch_bucket_size": "stage3_prefetch_bucket_size",
            "param_persistence_threshold": "stage3_param_persistence_threshold",
            "model_persistence_threshold": "stage3_model_persistence_threshold",
            "max_live_parameters": "stage3_max_live_parameters",
            "max_reuse_distance": "stage3_max_reuse_distance"}  # fmt: skip
# ZeRO-2's partitions start on 4-byte boundaries: flat groups are padded to 2 x world elements
# (stage_1_and_2.py: `nccl_start_alignment_factor = 2`).
ZERO2_ALIGNMENT = 2


@dataclass(frozen=True)
class ZeroSettings:
    """What the plan reads of a run's DeepSpeed config: its ZeRO sizes and switches, resolved as DeepSpeed resolves
    them (defaults, "auto")."""

    stage: int
    reduce_bucket_size: int
    overlap_comm: bool
    contiguous_gradients: bool
    prefetch_bucket_size: int
    param_persistence_threshold: int
    model_persistence_threshold: int
    max_live_parameters: int
    max_reuse_distance: int
    sub_group_size: int
    offload_optimizer: str  # 'none', 'cpu' (host memory) or 'nvme'
    offload_param: str
    grad_accum_dtype: torch.dtype | None  # `data_types.grad_accum_dtype` (None: the weights' dtype)


def load_deepspeed_config(config) -> dict:
    """A DeepSpeed config as a dict: a dict as it is, a path read as JSON (what `deepspeed_config_file` and
    `TrainingArguments.deepspeed` name)."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    return json.loads(Path(config).expanduser().read_text())


def accelerate_deepspeed_config(settings: dict, base: Path | None = None) -> dict:
    """The DeepSpeed config accelerate builds from an accelerate YAML's `deepspeed_config` section: its
    `deepspeed_config_file` where it names one, else the stage and offload devices only, the rest left to DeepSpeed's
    defaults (accelerate/utils/dataclasses.py::DeepSpeedPlugin.__post_init__)."""
    if settings.get("deepspeed_config_file"):
        path = Path(settings["deepspeed_config_file"]).expanduser()
        if not path.is_absolute() and base is not None and not path.exists() and (base / path).exists():
            path = base / path
        return load_deepspeed_config(path)
    return {
        "zero_optimization": {
            "stage": int(settings.get("zero_stage", 2)),
            "offload_optimizer": {"device": settings.get("offload_optimizer_device") or "none"},
            "offload_param": {"device": settings.get("offload_param_device") or "none"},
        }
    }


def zero_settings(config, stage: int, hidden_size: int | None) -> ZeroSettings:
    """The ZeRO settings of DeepSpeed config `config` (dict, JSON path, or None: accelerate's config from a YAML, which
    sets no size) for a ZeRO-`stage` run of a model of `hidden_size`: unset keys take DeepSpeed's defaults
    (`ZERO_DEFAULTS`), "auto" sizes what the HF Trainer fills in from the hidden size
    (transformers/integrations/deepspeed.py::HfTrainerDeepSpeedConfig.trainer_config_finalize; accelerate's
    Accelerator._prepare_deepspeed the same): reduce bucket hidden^2, ZeRO-3 prefetch bucket 0.9 hidden^2,
    persistence threshold 10 hidden."""
    config = load_deepspeed_config(config)
    zero = dict(config.get("zero_optimization") or {})
    for short, long in _ALIASES.items():
        if short in zero and long not in zero:
            zero[long] = zero.pop(short)
    configured = zero.get("stage", stage)
    if configured not in ("auto", stage):
        raise ValueError(f"The DeepSpeed config sets ZeRO stage {configured}, the plan is of stage {stage}.")
    auto = {"reduce_bucket_size": lambda h: h * h,
            "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
            "stage3_param_persistence_threshold": lambda h: 10 * h}  # fmt: skip

    def value(key):
        v = zero.get(key, ZERO_DEFAULTS[key])
        if v == "auto":
            if key not in auto or not hidden_size:
                raise ValueError(f"zero_optimization.{key}='auto' needs the model's hidden size.")
            return auto[key](hidden_size)
        return v

    def number(key):  # DeepSpeed takes 5e8 or "5e8" (pp_int)
        v = value(key)
        return v if isinstance(v, int) else int(float(v))

    overlap = value("overlap_comm")
    offload_optimizer = ((zero.get("offload_optimizer") or {}).get("device") or "none").lower()
    offload_param = ((zero.get("offload_param") or {}).get("device") or "none").lower()
    if "nvme" in (offload_optimizer, offload_param):
        raise ValueError("The memory plan does not cover NVMe offload.")
    if stage == 2 and offload_optimizer != "none":
        raise ValueError("The memory plan covers optimizer offload under ZeRO-3 (accelerate_configs/zero3_offload.yaml) only.")
    accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    dtypes = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
              "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}  # fmt: skip
    return ZeroSettings(
        stage=stage,
        reduce_bucket_size=number("reduce_bucket_size"),
        overlap_comm=(stage == 3) if overlap is None else bool(overlap),
        contiguous_gradients=bool(value("contiguous_gradients")),
        prefetch_bucket_size=number("stage3_prefetch_bucket_size"),
        param_persistence_threshold=number("stage3_param_persistence_threshold"),
        model_persistence_threshold=number("stage3_model_persistence_threshold"),
        max_live_parameters=number("stage3_max_live_parameters"),
        max_reuse_distance=number("stage3_max_reuse_distance"),
        sub_group_size=number("sub_group_size"),
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        grad_accum_dtype=dtypes[str(accum).lower()] if accum else None,
    )


# --- ZeRO-2 -----------------------------------------------------------------------------------------------------


@dataclass
class Zero2Layout:
    """Rank `rank`'s share of ZeRO-2's flat groups: per optimizer group its partition size (elements, padding
    included) and padding, and the parameters (indices) its partition overlaps."""

    partition_sizes: list[int]
    paddings: list[int]
    in_partition: set[int]

    @property
    def partition(self) -> int:
        return sum(self.partition_sizes)


def zero2_layout(groups: list[list[tuple[int, int]]], world_size: int, rank: int) -> Zero2Layout:
    """`groups`: per optimizer group its trainable parameters as (index, numel), in order. Each group is flattened and
    padded to a multiple of 2 x world (stage_1_and_2.py `flatten_dense_tensors_aligned`), cut in `world` equal
    partitions (`get_data_parallel_partitions`); a parameter is in a rank's partition where their ranges overlap
    (`get_partition_info`)."""
    alignment = ZERO2_ALIGNMENT * world_size
    sizes, paddings, inside = [], [], set()
    for group in groups:
        total = sum(numel for _, numel in group)
        padded = -(-total // alignment) * alignment
        size = padded // world_size
        sizes.append(size)
        paddings.append(padded - total)
        start, end, offset = rank * size, (rank + 1) * size, 0
        for index, numel in group:
            if offset < end and offset + numel > start:
                inside.add(index)
            offset += numel
    return Zero2Layout(sizes, paddings, inside)


def zero2_partition_gradients_allocated(order: list[tuple[int, int]], produced: int, bucket: int,
                                        inside: set[int]) -> bool:  # fmt: skip
    """Whether, after the first `produced` gradients of `order` ((index, numel) in the order backward accumulates
    them), a bucket holding a gradient of this rank's partition has been reduced, so that `grads_in_partition` is
    allocated: a gradient that would overflow the bucket reduces it first; one larger than the bucket is reduced at
    the next gradient (stage_1_and_2.py `reduce_independent_p_g_buckets_and_remove_grads`, `reduce_ipg_grads`)."""
    elements, holds = 0, False
    for index, numel in order[:produced]:
        if elements + numel > bucket and elements > 0:
            if holds:
                return True
            elements, holds = 0, False
        elements += numel
        holds = holds or index in inside
    return False


# --- ZeRO-3 -----------------------------------------------------------------------------------------------------


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def persistent_parameters(parameters, settings: ZeroSettings) -> set[int]:
    """Indices of the parameters ZeRO-3 keeps whole on every rank: at most `param_persistence_threshold` elements,
    while their total stays within `model_persistence_threshold` (parameter_offload.py
    `mark_persistent_parameters`, in `named_parameters` order)."""
    persistent, total = set(), 0
    for i, (_, numel, _, _) in enumerate(parameters):
        if numel + total > settings.model_persistence_threshold:
            continue
        if numel <= settings.param_persistence_threshold:
            persistent.add(i)
            total += numel
    return persistent


_LAYER = re.compile(r"(^|\.)layers\.(\d+)(\.|$)")


def _unit_of(name: str) -> str:
    """The block a parameter belongs to in the module order: its decoder layer, else its module."""
    match = _LAYER.search(name)
    if match:
        return f"layers.{match.group(2)}"
    return name.rsplit(".", 1)[0]


def _unit_of_module(module: str | None, units: list[str]) -> str | None:
    """The block of a module named as MemTracker names it (root module's class, then its path)."""
    if not module:
        return None
    path = module.split(".", 1)[1] if "." in module else ""
    match = _LAYER.search(path)
    if match:
        return f"layers.{match.group(2)}"
    return next((u for u in units if path == u or path.startswith(u + ".")), None)


def gathered_at_peak(parameters, persistent: set[int], settings: ZeroSettings, context: dict,
                     checkpointing: bool) -> int:  # fmt: skip
    """Bytes of the partitioned (not persistent) parameters ZeRO-3 holds gathered at a forward/backward point.

    The module order is that of the model's blocks (its decoder layers, and each other module with parameters, in
    `named_parameters` order): forward through all of them, then backward in reverse, a checkpointed layer recomputed
    (fetched) right before its backward. At the point (`context`: the block whose forward or recomputation ran last,
    and whether in backward) the coordinator holds (partitioned_param_coordinator.py):

    - the block in use: its trainable parameters whole (fetched by its recomputation, each released when its module's
      backward ends: `release_sub_module`), of its frozen ones (a LoRA base) only the one whose backward runs (frozen
      parameters fetched by a recomputation are released at the first backward hook after it and fetched again one
      module at a time: `update_recompute_parameters`, `ds_recompute_parameters`);
    - every block used earlier whose next use comes within `max_reuse_distance` elements of module order after its
      last one (`__params_to_release` keeps it);
    - a trainable LM head throughout (measured: our trainers run it in checkpointed chunks,
      `trl_longrm.heads.chunked_token_logprobs`, and its backward never releases it);
    - in forward, what it prefetched: the next parameters in order not yet gathered, up to `prefetch_bucket_size`
      elements (the last one whole) within `max_live_parameters` (`fetch_sub_module`); measured, none in backward.

    Measured on the CPU runs of tests/test_memory_plan.py (ZERO_CASES) to within 1 MiB of the gathered buffers live at
    the peak (DeepSpeed's all-gathers sometimes outlive a released parameter)."""
    units, members = [], {}
    for i, (name, _, _, _) in enumerate(parameters):
        unit = _unit_of(name)
        if unit not in members:
            units.append(unit)
            members[unit] = []
        members[unit].append(i)
    numel = {u: sum(parameters[i][1] for i in members[u]) for u in units}
    layers = {u for u in units if u.startswith("layers.")}
    # Module order: forward, then backward (a checkpointed layer twice: its recomputation, then its backward).
    sequence = list(units)
    backward_start = len(sequence)
    for unit in reversed(units):
        sequence += [unit, unit] if (checkpointing and unit in layers) else [unit]
    unit_now = _unit_of_module(context.get("module"), units)
    in_backward = bool(context.get("backward"))
    if not in_backward:
        position = units.index(unit_now) if unit_now in units else len(units) - 1
    elif context.get("module_in_backward") and unit_now in layers:
        # after its recomputation: the layer's backward entry
        position = max(k for k in range(backward_start, len(sequence)) if sequence[k] == unit_now)
    else:
        position = backward_start  # backward has not reached a recomputed layer: the head's backward
    current = sequence[position]
    held = [i for i in members[current] if i not in persistent and (parameters[i][3] or not in_backward)]
    frozen = [parameters[i][1] * parameters[i][2] for i in members[current]
              if i not in persistent and not parameters[i][3]]  # fmt: skip
    total = sum(parameters[i][1] * parameters[i][2] for i in held)
    if in_backward and frozen:
        total += max(frozen)
    gathered = {current}
    for unit in units:
        if unit in gathered:
            continue
        uses = [k for k, u in enumerate(sequence) if u == unit]
        before = [k for k in uses if k < position]
        after = [k for k in uses if k > position]
        head = unit.endswith("lm_head") and any(parameters[i][3] for i in members[unit])
        if not (head and before):
            if not before or not after:
                continue
            last, following = before[-1], after[0]
            if sum(numel[sequence[k]] for k in range(last + 1, following)) >= settings.max_reuse_distance:
                continue
        gathered.add(unit)
        kept = [i for i in members[unit] if i not in persistent]
        held += kept
        total += sum(parameters[i][1] * parameters[i][2] for i in kept)
    if not in_backward:
        available = sum(parameters[i][1] for i in held)
        budget = min(settings.prefetch_bucket_size, settings.max_live_parameters - available)
        prefetched, seen = 0, set(held)
        for unit in sequence[position + 1:]:
            for i in members[unit]:
                if prefetched >= budget:
                    break
                if i in persistent or i in seen:
                    continue
                seen.add(i)
                prefetched += parameters[i][1]
                total += parameters[i][1] * parameters[i][2]
    return total


# --- Per phase ----------------------------------------------------------------------------------------------------


def zero_phase(traced, settings: ZeroSettings, world_size: int, rank: int, phase: str, parts: dict,
               checkpointing: bool, context: dict | None = None):  # fmt: skip
    """ZeRO's replacement of `parts` (the traced parts by kind of a peak of `phase`: 'forward/backward' or
    'optimizer step'; in forward/backward, the peak of `context`, a `TracedStep.segments` context), and its terms:
    `(parts, device_terms, host_terms)`, bytes per rank `rank`. The weights' dtype is the traced model's (the trace
    casts it as DeepSpeed's engine does); gradients, buckets and their reductions are in it too
    (`communication_data_type`; `grad_accum_dtype` unless the config sets `data_types.grad_accum_dtype`); master
    weights, optimizer states and the step's gradients in fp32."""
    parameters = traced.parameters
    trainable = [i for i, p in enumerate(parameters) if p[3]]
    element = parameters[trainable[0]][2] if trainable else 4
    accum = torch.empty((), dtype=settings.grad_accum_dtype).element_size() if settings.grad_accum_dtype else element
    # Optimizer states per element, as the traced optimizer keeps them (2 for Adam), in fp32 on ZeRO's partitions.
    states_per_element = traced.optimizer_state_bytes / max(traced.trainable_weight_bytes, 1)
    parts = dict(parts)
    parts["gradients"] = 0
    parts["optimizer_states"] = 0
    device, host = {}, {}
    backward = phase == "forward/backward"
    context = (traced.peak_context if context is None else context) if backward else {}

    if settings.stage == 2:
        groups = [[(i, parameters[i][1]) for i in group if parameters[i][3]] for group in traced.param_groups]
        layout = zero2_layout(groups, world_size, rank)
        device["zero_flat_weights_padding"] = sum(layout.paddings) * element
        device["zero_fp32_weights_partition"] = 4 * layout.partition
        device["zero_optimizer_partition"] = round(states_per_element * 4 * layout.partition)
        # `grads_in_partition` is in the weights' dtype (`self.dtype`; `copy_grads_in_partition`).
        in_partition = sum(parameters[i][1] for i in layout.in_partition) * element
        if backward:
            in_backward = context.get("backward") and context.get("produced", 0) > 0
            if settings.contiguous_gradients and in_backward:
                device["zero_gradient_buckets"] = settings.reduce_bucket_size * element * (2 if settings.overlap_comm else 1)
            order = [(i, parameters[i][1]) for i in traced.gradient_order]
            allocated = in_backward and zero2_partition_gradients_allocated(
                order, context.get("produced", 0), settings.reduce_bucket_size, layout.in_partition)
            held = (1 if allocated else 0) + (1 if context.get("micro_batch", 0) > 0 else 0)
            if held:
                device["zero_partition_gradients"] = held * in_partition
        else:
            # The step, one group at a time: its gradients flattened (in the gradients' dtype, then fp32), while
            # `grads_in_partition` still backs the other groups' (stage_1_and_2.py `step`).
            largest = max(layout.partition_sizes, default=0)
            device["zero_partition_gradients"] = in_partition
            device["zero_fp32_gradient_partition"] = largest * (accum + 4 if accum != 4 else 4)
            parts["temporaries"] = parts["temporaries"] * largest // max(traced.trainable_parameters, 1)
        return parts, device, host

    # ZeRO-3
    persistent = persistent_parameters(parameters, settings)

    partitions = sum(ceil_div(numel, world_size) * size for _, numel, size, _ in parameters)
    trainable_partition = sum(ceil_div(parameters[i][1], world_size) for i in trainable)
    parts["weights"] = 0
    where_params = host if settings.offload_param == "cpu" else device
    where_optimizer = host if settings.offload_optimizer == "cpu" else device
    where_params["zero3_weight_partitions"] = partitions
    where_optimizer["zero_fp32_weights_partition"] = 4 * trainable_partition
    where_optimizer["zero_optimizer_partition"] = round(states_per_element * 4 * trainable_partition)
    # The gradient partitions' flat buffer (`grad_partitions_flat_buffer`, on the optimizer's device), and with the
    # optimizer offloaded the fp32 gradient buffers of its sub-groups (`initialize_optimizer_states`).
    where_optimizer["zero_partition_gradients"] = trainable_partition * accum
    if settings.offload_optimizer == "cpu":
        host["zero_fp32_gradient_partition"] = 4 * trainable_partition
    if settings.contiguous_gradients:
        device["zero_gradient_buckets"] = settings.reduce_bucket_size * element
    if backward:
        device["zero3_persistent_weights"] = sum(parameters[i][1] * parameters[i][2] for i in persistent)
        device["zero3_gathered_parameters"] = gathered_at_peak(parameters, persistent, settings, context, checkpointing)
    elif settings.offload_optimizer != "cpu":
        # Each sub-group's gradient partition flattened and made fp32 for the step (`_prepare_fp32_grad_for_sub_group`).
        largest = min(trainable_partition, max(settings.sub_group_size, 1))
        device["zero_fp32_gradient_partition"] = largest * (accum + 4 if accum != 4 else 4)
        parts["temporaries"] = parts["temporaries"] * largest // max(traced.trainable_parameters, 1)
    else:
        parts["temporaries"] = 0  # the step runs on the host (DeepSpeed's CPU Adam)
    return parts, device, host


def describe_settings(settings: ZeroSettings) -> str:
    return (f"ZeRO-{settings.stage}: reduce bucket {settings.reduce_bucket_size:,} elements"
            f"{' x2 (overlap_comm)' if settings.overlap_comm and settings.stage == 2 else ''}"
            + (f", prefetch {settings.prefetch_bucket_size:,}, persistence threshold "
               f"{settings.param_persistence_threshold:,}, reuse distance {settings.max_reuse_distance:,}"
               if settings.stage == 3 else "")
            + (f", offload optimizer {settings.offload_optimizer}, parameters {settings.offload_param}"
               if settings.stage == 3 else ""))


