"""How long one optimizer step of a planned run takes on a GPU: a model good enough to rank layouts and settings.

The time of a step on one rank is the sum of what its kernels and transfers need, each at a rate measured on the card
(`CARDS`), scaled by coefficients fitted on the runs measured on GPUs (`bench/step_time_calibration.py`, from
`bench/results/gpu/`; their error on each run predicted without it is in `bench/results/step_time_model.json`):

- matrix multiplications: the FLOPs executed (forward; backward, without the frozen weights' gradients under LoRA;
  the forward again for every checkpointed layer, twice for a tiled MLP's), at the card's measured GEMM rate;
- attention: each call's (query, key) pairs at the measured rate of the kernel the run takes (cuDNN's or flash-attn's,
  by sequence length), the forward again for every checkpointed layer unless selective checkpointing keeps it;
- elementwise kernels and copies (norms, rotary, activations, casts, LoRA's scaling and addition): bytes moved per
  token and layer at the card's memory bandwidth, fewer with Liger's kernels and with fused LoRA;
- offloaded activations (checkpoint offload, activation offload): their bytes both ways over the host link;
- sequence parallelism's collectives (the ring's key/value gathers and gradient reduce-scatters, Ulysses' all-to-alls)
  and ZeRO's (gradient reduce-scatter, ZeRO-3's parameter gathers): bytes at the interconnect's bandwidth, the part
  that the computation does not hide. No run on several GPUs has been measured yet: these terms are the rates'
  arithmetic, not calibrated.

Example:
```python
>>> from trl_longrm.memory_plan.step_time import StepSettings, estimate_step_seconds
>>> seconds = estimate_step_seconds(config, "simpo_disrm", GroupShape(32768, 256, 4), StepSettings(lora_r=8), "h200")
```
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CardRates:
    """What a card does per second: bf16 dense peak FLOP/s (MFU's denominator), the GEMM rate measured on it, each
    attention kernel's forward and backward rate by sequence length (`{kernel: {length: (forward, backward)}}`,
    FLOP/s counted as 4 x heads x head_dim per attended pair forward and 2.5x that backward), HBM bandwidth, the host
    link (pinned copies, one direction) and the interconnect (NCCL bus bandwidth within a node, and between nodes)."""

    peak_flops: float
    gemm_flops: float
    attention: dict
    memory_bytes_per_s: float
    host_link_bytes_per_s: float
    interconnect_bytes_per_s: float
    internode_bytes_per_s: float
    source: str = ""


CARDS = {
    # H100 SXM 80GB: bench/results/gpu/attention_kernels.json (GEMM 753 TFLOP/s; Qwen3-0.6B's heads), HBM3 3.35 TB/s,
    # PCIe Gen5 x16 ~50 GB/s pinned, NVLink 4 ~370 GB/s NCCL bus bandwidth, 400 Gb/s InfiniBand per GPU (50 GB/s).
    "h100-80gb": CardRates(
        peak_flops=989.4e12, gemm_flops=753.1e12,
        attention={"cudnn": {8192: (386e12, 397e12), 32768: (607e12, 557e12), 65536: (651e12, 546e12)},
                   "flash_attn": {8192: (212e12, 225e12), 32768: (345e12, 315e12), 65536: (365e12, 317e12)}},
        memory_bytes_per_s=3.35e12, host_link_bytes_per_s=50e9, interconnect_bytes_per_s=370e9,
        internode_bytes_per_s=50e9, source="bench/results/gpu/attention_kernels.json",
    ),  # fmt: skip
    # H200: bench/results/gpu/h200/attention_kernels_8b.json (GEMM 784 TFLOP/s; 32K only: the H100's length profile
    # scaled to it), HBM3e 4.8 TB/s; the links as the H100's.
    "h200": CardRates(
        peak_flops=989.4e12, gemm_flops=784.5e12,
        attention={"cudnn": {8192: (393e12, 401e12), 32768: (619e12, 562e12), 65536: (664e12, 551e12)},
                   "flash_attn": {8192: (208e12, 223e12), 32768: (339e12, 312e12), 65536: (359e12, 314e12)}},
        memory_bytes_per_s=4.8e12, host_link_bytes_per_s=50e9, interconnect_bytes_per_s=370e9,
        internode_bytes_per_s=50e9, source="bench/results/gpu/h200/attention_kernels_8b.json",
    ),  # fmt: skip
}


@dataclass(frozen=True)
class StepSettings:
    """The settings of a run that change its step time (defaults: TRL's, one process)."""

    lora_r: int = 0
    gradient_checkpointing: bool = True
    selective: bool = False
    unchecked_layers: int = 0
    use_liger_kernel: bool = False
    fused_lora: bool = False
    mlp_tile_tokens: int | None = None
    checkpoint_offload: bool = False
    activation_offloading: bool = False
    shared_prefix: bool = True
    attention: str = "cudnn"  # the kernel 'auto' takes (`kernels.auto_backend`): 'cudnn' or 'flash_attn'
    sequence_parallel_size: int = 1
    sequence_parallel_mode: str = "ring"
    ulysses_size: int | None = None
    world_size: int = 1
    gpus_per_node: int = 8
    zero_stage: int = 0  # 0: DDP (or one process)
    ring_head_stride: int = 1
    rows_per_micro_batch: int = 1  # groups a rank's micro-batch holds (`per_device_train_batch_size`)
    accumulation_steps: int = 1  # micro-batches per optimizer step (`gradient_accumulation_steps`)


@dataclass
class StepTerms:
    """The step's parts in seconds on one rank, before and after the fitted coefficients."""

    gemm: float
    attention: float
    elementwise: float
    elementwise_liger: float
    offload: float
    communication: float
    coefficients: dict = field(default_factory=dict)
    micro_steps: int = 1  # micro-batches a step (ZeRO's collectives recur per micro-batch; the constant does not)

    @property
    def seconds(self) -> float:
        c = self.coefficients or COEFFICIENTS
        return (c["gemm"] * self.gemm + c["attention"] * self.attention + c["elementwise"] * self.elementwise
                + c["elementwise_liger"] * self.elementwise_liger + c["step"] + self.offload
                + self.communication)  # fmt: skip

    def features(self) -> list[float]:
        """The fitted terms, in `FEATURES`' order (the constant last)."""
        return [self.gemm, self.attention, self.elementwise, self.elementwise_liger, 1.0]


FEATURES = ("gemm", "attention", "elementwise", "elementwise_liger", "step")

# Fitted by `bench/step_time_calibration.py` on the 33 timed runs of ours in bench/results/gpu/ (H100 and H200,
# Qwen3-0.6B and the 8B shapes; bench/results/step_time_model.json: each run's error predicted without it, mean 6.7%,
# median 5.1%, max 23% on a 0.6B run bound by host syncs since removed); `tests/test_step_time.py` checks these equal a
# fresh fit. A coefficient of 1 is the rate itself (1.24: the matmuls run at 80% of the measured GEMM rate); `step` is
# seconds per step (host time, optimizer). Every calibration run took one group per step, unaccumulated: with several
# micro-batches a step the constant is taken as paid once a step (what recurs per micro-batch is not told apart: on
# CPU, 2 groups a micro-batch x 2 and 1 x 4 ran within 2% of each other, bench/results/plan_ranking_rows.json).
COEFFICIENTS = {
    "gemm": 1.2430337027863259,
    "attention": 1.1879596127842509,
    "elementwise": 2.959811185078869,
    "elementwise_liger": 1.2510550688245194,
    "step": 0.1239586091269127,
}


def _attention_rate(card: CardRates, kernel: str, length: int) -> tuple[float, float]:
    """(forward, backward) FLOP/s of `kernel` on a causal sequence of `length` tokens, interpolated in log length
    between the measured ones (the shortest's below them, the longest's above)."""
    table = card.attention["cudnn" if kernel == "cudnn" else "flash_attn"]
    lengths = sorted(table)
    if length <= lengths[0]:
        return table[lengths[0]]
    if length >= lengths[-1]:
        return table[lengths[-1]]
    for lo, hi in zip(lengths, lengths[1:]):
        if lo <= length <= hi:
            t = (math.log(length) - math.log(lo)) / (math.log(hi) - math.log(lo))
            return tuple(a + (b - a) * t for a, b in zip(table[lo], table[hi]))
    raise AssertionError("unreachable")


def _shape(config) -> dict:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return dict(hidden=config.hidden_size, inter=config.intermediate_size, layers=config.num_hidden_layers,
                heads=heads, kv_heads=config.num_key_value_heads, head_dim=head_dim, vocab=config.vocab_size)  # fmt: skip


def step_terms(model_config, stage: str, shape, settings: StepSettings, card: str | CardRates) -> StepTerms:
    """The step's terms (`StepTerms`) on one rank of a run of `stage` with `settings` on `card` (a `CARDS` name or
    rates), for groups of `shape` (a `GroupShape`): `settings.rows_per_micro_batch` of them a micro-batch (a packed
    row's documents: each its own attention), `settings.accumulation_steps` micro-batches a step. What a group
    computes scales with the groups; ZeRO's collectives recur per micro-batch; the fitted constant is paid once."""
    rates = CARDS[card] if isinstance(card, str) else card
    s = _shape(model_config)
    hidden, inter, layers = s["hidden"], s["inter"], s["layers"]
    q_dim, kv_dim = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    responses = [shape.response_tokens] * (1 + shape.num_rejected) if stage != "sft" else []
    prompt = shape.prompt_tokens
    if stage == "sft":
        sequences = [prompt + shape.response_tokens]
    elif settings.shared_prefix:
        sequences = [prompt + sum(responses)]
    else:
        sequences = [prompt + r for r in responses]
    tokens = sum(sequences)
    sp = max(settings.sequence_parallel_size, 1)
    rank_tokens = tokens / sp

    # Layers whose forward runs again in backward.
    checked = 0 if not settings.gradient_checkpointing else max(layers - settings.unchecked_layers, 0)
    attention_params = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden
    mlp_params = 3 * hidden * inter
    forward = 2 * (attention_params + mlp_params) * rank_tokens * layers
    # Backward: the inputs' gradients (2x forward's FLOPs... half of backward) always; the weights' only when trained.
    backward = forward if settings.lora_r else 2 * forward
    recompute = 2 * (attention_params + mlp_params) * rank_tokens * checked
    if settings.mlp_tile_tokens:
        recompute += 2 * mlp_params * rank_tokens * checked  # the tiled MLP's own recompute inside the layer's
    adapters = 0.0
    if settings.lora_r:
        per_token = settings.lora_r * (3 * hidden + q_dim + 2 * kv_dim + q_dim + hidden + 3 * (hidden + inter))
        adapters = 2 * per_token * rank_tokens * (3 * layers + checked)
    head = 0.0
    if stage in ("simpo_grm", "sft"):  # the sparse LM head: the scored (response) tokens only
        scored = sum(responses) if stage == "simpo_grm" else shape.response_tokens
        head = 2 * hidden * s["vocab"] * scored / sp * 3
    gemm = (forward + backward + recompute + adapters + head) / rates.gemm_flops

    # Attention: each sequence's pairs (a response attends the shared prompt and itself), this rank's share.
    attention = 0.0
    per_pair = 4 * q_dim
    forward_runs = 1 + (0 if settings.selective else checked / layers)
    if stage != "sft" and settings.shared_prefix:
        calls = [(prompt, prompt * (prompt + 1) / 2)]
        calls += [(r, r * prompt + r * (r + 1) / 2) for r in responses]
    else:
        calls = [(n, n * (n + 1) / 2) for n in sequences]
    for length, pairs in calls:
        fwd_rate, bwd_rate = _attention_rate(rates, settings.attention, length)
        flops = per_pair * pairs / sp * layers
        attention += forward_runs * flops / fwd_rate + 2.5 * flops / bwd_rate

    # Elementwise traffic (bf16 bytes): per token and layer, the norms, rotary, activation and residual passes over
    # the hidden states and the MLP's intermediates, and LoRA's scaling and addition over each projection's output
    # unless fused; forward, recompute and backward (twice a forward's).
    passes = 1 + checked / layers + 2
    per_token_layer = 2 * (8 * hidden + 2 * (q_dim + 2 * kv_dim) + 4 * inter)
    if settings.lora_r and not settings.fused_lora:
        per_token_layer += 2 * 3 * (q_dim + 2 * kv_dim + hidden + 2 * inter + hidden)
    elementwise = per_token_layer * rank_tokens * layers * passes / rates.memory_bytes_per_s
    liger = 0.0
    if settings.use_liger_kernel:
        liger, elementwise = elementwise, 0.0

    # Offloaded activations: each checkpointed layer's input (checkpoint offload), or everything kept (activation
    # offload: taken as twice the inputs with checkpointing, a layer's activations without), both ways.
    offload = 0.0
    layer_input = 2 * hidden * rank_tokens
    if settings.checkpoint_offload:
        offload += 2 * layer_input * checked / rates.host_link_bytes_per_s
    if settings.activation_offloading:
        kept = layer_input * (2 * checked + 12 * (layers - checked))
        offload += 2 * kept / rates.host_link_bytes_per_s

    rows, micro_steps = max(settings.rows_per_micro_batch, 1), max(settings.accumulation_steps, 1)
    groups = rows * micro_steps
    sequence_parallel, zero = _communication_seconds(s, settings, rank_tokens, tokens, rates)
    return StepTerms(gemm=groups * gemm, attention=groups * attention, elementwise=groups * elementwise,
                     elementwise_liger=groups * liger, offload=groups * offload,
                     communication=groups * sequence_parallel + micro_steps * zero,
                     micro_steps=micro_steps)  # fmt: skip


def _communication_seconds(s: dict, settings: StepSettings, rank_tokens: float, tokens: float,
                           rates: CardRates) -> tuple[float, float]:  # fmt: skip
    """Collectives not hidden by computation, (per group: sequence parallelism's, per micro-batch: ZeRO's): the ring gathers each document's keys/values per layer
    (forward, and again in backward) and reduce-scatters their gradients, overlapped with the attention of the
    previous head chunk (taken as hidden up to the attention's own time: what is left counts); Ulysses' all-to-alls
    (q, k, v and the output, forward and backward) are not overlapped; ZeRO-2's gradient reduce-scatter and ZeRO-3's
    parameter gathers run against the whole model's bytes. Uncalibrated: no run on several GPUs measured yet."""
    sp = max(settings.sequence_parallel_size, 1)
    world = max(settings.world_size, 1)
    bandwidth = rates.interconnect_bytes_per_s if world <= settings.gpus_per_node else rates.internode_bytes_per_s
    layers, kv_dim, q_dim, hidden = s["layers"], s["kv_heads"] * s["head_dim"], s["heads"] * s["head_dim"], s["hidden"]
    seconds = 0.0
    if sp > 1:
        ulysses = settings.ulysses_size or (sp if settings.sequence_parallel_mode == "ulysses" else 1)
        ring = sp // ulysses
        if ulysses > 1:
            # q, k, v and out each way in forward (and the recompute), their gradients in backward.
            moved = 2 * rank_tokens * (2 * q_dim + 2 * kv_dim) * (ulysses - 1) / ulysses
            seconds += 3 * moved * layers / bandwidth
        if ring > 1:
            # Keys/values of the row up to this rank's tokens (on average half the row), gathered in forward and
            # backward, their gradients reduce-scattered: about half of it hidden behind the attention's kernels.
            gathered = 2 * 2 * kv_dim * tokens / 2 * (ring - 1) / ring
            seconds += 0.5 * 3 * gathered * layers / bandwidth
    sequence_parallel, seconds = seconds, 0.0
    if settings.zero_stage and world > 1:
        params = layers * (hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * s["inter"])
        trained = params if not settings.lora_r else 0.02 * params
        seconds += 2 * trained * (world - 1) / world / bandwidth  # gradients reduce-scattered (bf16)
        if settings.zero_stage == 3:
            seconds += 2 * 2 * params * (world - 1) / world / bandwidth  # weights gathered in forward and backward
    return sequence_parallel, seconds


def estimate_step_seconds(model_config, stage: str, shape, settings: StepSettings, card: str | CardRates,
                          coefficients: dict | None = None) -> float:  # fmt: skip
    """Seconds of one optimizer step (`settings.accumulation_steps` micro-batches of `settings.rows_per_micro_batch`
    groups of `shape` on a rank; `step_terms`, with the fitted `COEFFICIENTS`)."""
    terms = step_terms(model_config, stage, shape, settings, card)
    terms.coefficients = coefficients or COEFFICIENTS
    return terms.seconds


def settings_of(training_args, *, lora_r: int = 0, attention: str = "cudnn", world_size: int = 1,
                zero_stage: int = 0) -> StepSettings:  # fmt: skip
    """The `StepSettings` of a trainer config (`SimPOGRMConfig`, ...) as the run takes it."""
    kwargs = getattr(training_args, "activation_checkpointing_kwargs", None) or {}
    checkpointing = bool(getattr(training_args, "activation_checkpointing", False))
    return StepSettings(
        lora_r=lora_r,
        gradient_checkpointing=checkpointing,
        selective=bool(kwargs.get("selective")) and checkpointing,
        unchecked_layers=int(kwargs.get("unchecked_layers", 0)) if checkpointing else 0,
        use_liger_kernel=bool(getattr(training_args, "use_liger_kernel", False)),
        fused_lora=bool(getattr(training_args, "fused_lora", False)),
        mlp_tile_tokens=getattr(training_args, "mlp_tile_tokens", None),
        checkpoint_offload=bool(kwargs.get("offload")) and checkpointing,
        activation_offloading=bool(getattr(training_args, "activation_offloading", False)),
        shared_prefix=bool(getattr(training_args, "shared_prefix", True)) and bool(getattr(training_args,
                                                                                          "padding_free", True)),
        attention=attention,
        sequence_parallel_size=getattr(training_args, "sequence_parallel_size", 1) or 1,
        sequence_parallel_mode=getattr(training_args, "sequence_parallel_mode", "ring") or "ring",
        ulysses_size=getattr(training_args, "ulysses_size", None),
        world_size=world_size,
        zero_stage=zero_stage,
        ring_head_stride=getattr(training_args, "ring_head_stride", 1) or 1,
        rows_per_micro_batch=getattr(training_args, "per_device_train_batch_size", 1) or 1,
        accumulation_steps=getattr(training_args, "gradient_accumulation_steps", 1) or 1,
    )


def replace(settings: StepSettings, **changes) -> StepSettings:
    return dataclasses.replace(settings, **changes)


__all__ = ["CARDS", "COEFFICIENTS", "CardRates", "StepSettings", "StepTerms", "estimate_step_seconds", "settings_of",
           "step_terms"]
