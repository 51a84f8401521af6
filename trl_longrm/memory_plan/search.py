"""What fits my GPUs: the settings this package supports searched for a model, a stage, a data shape and a cluster,
each candidate's memory planned (`plan_memory`: traced, never a formula) and its step timed by the step-time model
(`step_time`), the fitting ones ranked by tokens per second.

The search, per training method (full parameters, LoRA):

- layouts: the sequence-parallel size (each divisor of the world size, largest first: its trace is the cheapest) and
  mode (ring, Ulysses where the heads divide), ZeRO (DDP, ZeRO-2, ZeRO-3, ZeRO-3 with the optimizer's states and the
  weights offloaded: the last only where nothing else fits);
- activation settings on a ladder from the fastest: gradient checkpointing (TRL's default), then the tiled MLP, then
  checkpoint offload, then both; a layout's first rung that fits is its candidate (the rungs below it are rejected
  with their planned peak);
- spare memory spent on speed, for the fastest candidates: selective checkpointing and as many unchecked layers as fit
  (`propose.largest_unchecked_layers`' rule), each planned;
- rows per step (`rows_per_step`, the global batch in groups): each layout splits them over its data-parallel replicas,
  one group a micro-batch accumulated; the fastest candidates, and their spare-memory settings, also take the most
  groups a micro-batch that fit (fewer micro-batches a step: ZeRO's collectives paid less often; on one process, or
  under DDP, the step-time model gives rows and accumulation the same time).

Traces are reused: ZeRO settings are recombined from one trace (`plan_memory(traced=...)`), and a layout whose
smaller sequence-parallel size is estimated (the larger one's activations scaled by the tokens a rank holds) to need
more than 1.15x the card is rejected without being traced. Finalists are planned on the first and the last rank of a
group, as `--dry_run` does.

Not modelled: fragmentation beyond the plan's allowance (`CUDA_FRAGMENTATION_FRACTION`), NVMe offload, Liger's kernels
(they do not run on fake tensors; measured to keep less), pipeline and tensor parallelism.

Example:
```python
>>> from trl_longrm.memory_plan import GroupShape
>>> from trl_longrm.memory_plan.search import Cluster, search
>>> result = search("simpo_grm", "qwen3-8b", GroupShape(1046528, 2048, 4),
...                 Cluster.parse("8xh100-80gb"))
>>> print(result.table())
```
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time
from dataclasses import dataclass, field

import torch

from trl_longrm.memory_plan.devices import DEVICE_MEMORY_BYTES, device_memory_bytes
from trl_longrm.memory_plan.plan import DEFAULT_MAX_TRACED_LAYERS, GIB, MemoryPlan, load_model_config, plan_memory
from trl_longrm.memory_plan.propose import most_unchecked_layers
from trl_longrm.memory_plan.step_time import CARDS, estimate_step_seconds, settings_of
from trl_longrm.memory_plan.trace import GroupShape, trace_step


DEFAULT_MARGIN = 0.03
DEFAULT_TILE_TOKENS = 16384
# A layout estimated to need more than this share of the card (from a traced layout) is not traced.
ESTIMATE_REJECT = 1.15


@dataclass
class Cluster:
    """The GPUs a run gets: `gpus_per_node` cards of `card` on each of `nodes` machines, `device_bytes` per card (what
    a process gets: `devices.DEVICE_MEMORY_BYTES`, or given), `host_bytes_per_node` of host memory (None: unchecked)."""

    card: str
    gpus_per_node: int
    nodes: int = 1
    device_bytes: int = 0
    host_bytes_per_node: int | None = None

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @classmethod
    def parse(cls, cards: str, nodes: int = 1, device_memory_gib: float | None = None,
              host_memory_gib: float | None = None) -> Cluster:  # fmt: skip
        """`"8xh100-80gb"` (cards per machine x card; a card `devices.DEVICE_MEMORY_BYTES` knows, or any name with
        `device_memory_gib`)."""
        match = re.fullmatch(r"(?:(\d+)x)?([\w.-]+)", cards.strip().lower())
        if not match:
            raise ValueError(f"--cards {cards!r}: expected COUNTxCARD, e.g. 8xh100-80gb or 1xh200.")
        count, card = int(match.group(1) or 1), match.group(2)
        if card not in DEVICE_MEMORY_BYTES and device_memory_gib is None:
            raise ValueError(f"--cards {cards!r}: {card!r} is not a card whose memory was measured "
                             f"({', '.join(DEVICE_MEMORY_BYTES)}); give --device_memory_gib.")  # fmt: skip
        return cls(card=card, gpus_per_node=count, nodes=nodes,
                   device_bytes=device_memory_bytes(card, device_memory_gib),
                   host_bytes_per_node=None if host_memory_gib is None else int(host_memory_gib * GIB))  # fmt: skip

    @property
    def rates(self) -> str:
        """The step-time model's card (`step_time.CARDS`): this card's, else the H100's."""
        return self.card if self.card in CARDS else "h100-80gb"


@dataclass(frozen=True)
class Layout:
    sequence_parallel_size: int = 1
    mode: str = "ring"
    distributed: str = "single"  # 'single', 'ddp', 'zero2', 'zero3'
    offload: bool = False  # ZeRO-3 with the optimizer's states and the weights in host memory

    def describe(self) -> str:
        parts = [f"sp {self.sequence_parallel_size} {self.mode}" if self.sequence_parallel_size > 1 else "no sp",
                 {"single": "one process", "ddp": "DDP"}.get(self.distributed, self.distributed.replace("zero", "ZeRO-"))]
        return ", ".join(parts) + (" + offload" if self.offload else "")


@dataclass(frozen=True)
class Activations:
    tile_tokens: int | None = None
    checkpoint_offload: bool = False
    selective: bool = False
    unchecked_layers: int = 0

    def describe(self) -> str:
        parts = ["checkpointing" + (" (selective)" if self.selective else "")]
        if self.unchecked_layers:
            parts.append(f"{self.unchecked_layers} layers unchecked")
        if self.tile_tokens:
            parts.append(f"tiled MLP {self.tile_tokens}")
        if self.checkpoint_offload:
            parts.append("checkpoint offload")
        return ", ".join(parts)


@dataclass(frozen=True)
class Batching:
    """How a rank takes its share of a step's groups: `rows` groups a micro-batch (`per_device_train_batch_size`),
    `accumulation` micro-batches a step (`gradient_accumulation_steps`)."""

    rows: int = 1
    accumulation: int = 1

    def describe(self) -> str:
        return f"{self.rows} x {self.accumulation}"


# The ladder, fastest first: what a layout tries until something fits.
LADDER = (Activations(), Activations(tile_tokens=DEFAULT_TILE_TOKENS), Activations(checkpoint_offload=True),
          Activations(tile_tokens=DEFAULT_TILE_TOKENS, checkpoint_offload=True))  # fmt: skip


@dataclass
class Candidate:
    method: str
    layout: Layout
    activations: Activations
    peak_bytes: int
    host_bytes_per_node: int
    fits: bool
    step_seconds: float | None = None
    tokens_per_s: float | None = None  # the unshared layout's tokens (the prompt once per response), whole cluster
    computed_tokens_per_s: float | None = None  # the tokens computed (the prompt once), whole cluster
    reason: str = ""
    estimated: bool = False  # peak estimated from another layout's trace, not traced
    plans: list[MemoryPlan] = field(default_factory=list, repr=False)
    batching: Batching = Batching()

    @property
    def peak(self) -> int:  # (as a `MemoryPlan`'s: `propose.most_unchecked_layers` reads either)
        return self.peak_bytes

    def overrides(self, stage: str, lora_r: int) -> dict:
        """The recipe keys of this candidate (`trl-longrm plan --write`)."""
        kwargs = {"use_reentrant": False}
        if self.activations.checkpoint_offload:
            kwargs["offload"] = True
        if self.activations.selective:
            kwargs["selective"] = True
        if self.activations.unchecked_layers:
            kwargs["unchecked_layers"] = self.activations.unchecked_layers
        out = {"sequence_parallel_size": self.layout.sequence_parallel_size,
               "sequence_parallel_mode": self.layout.mode, "gradient_checkpointing": True,
               "gradient_checkpointing_kwargs": kwargs, "mlp_tile_tokens": self.activations.tile_tokens,
               "per_device_train_batch_size": self.batching.rows,
               "gradient_accumulation_steps": self.batching.accumulation}  # fmt: skip
        if self.method == "lora":
            out.update(use_peft=True, lora_r=lora_r, lora_alpha=2 * lora_r if stage != "simpo_disrm" else lora_r,
                       lora_dropout=0.0, lora_target_modules="all-linear", fused_lora=True)  # fmt: skip
        return out


@dataclass
class SearchResult:
    stage: str
    cluster: Cluster
    shape: GroupShape
    margin: float
    proposals: list[Candidate]
    rejected: list[Candidate]
    traces: int
    seconds: float
    planner: object = field(default=None, repr=False)
    rows_per_step: int | None = None  # groups an optimizer step takes over the cluster (None: one a replica)

    def table(self, top: int = 5) -> str:
        budget = (1 - self.margin) * self.cluster.device_bytes
        lines = [f"{self.stage} on {self.cluster.nodes} x {self.cluster.gpus_per_node} x {self.cluster.card} "
                 f"({self.cluster.device_bytes / GIB:.1f} GiB a process, {self.margin:.0%} kept free: "
                 f"{budget / GIB:.1f} GiB); groups of {self.shape.prompt_tokens:,} prompt tokens + "
                 f"{1 + self.shape.num_rejected if self.stage != 'sft' else 1} x {self.shape.response_tokens:,}, "
                 + (f"{self.rows_per_step} a step" if self.rows_per_step else "one a step per data-parallel replica"),
                 f"{'#':>2} {'method':6} {'layout':28} {'activations':52} {'rows':>7} {'peak GiB':>9} "
                 f"{'host GiB':>9} {'step s':>7} {'tokens/s':>10} {'computed':>9}"]  # fmt: skip
        for i, c in enumerate(self.proposals[:top], 1):
            lines.append(f"{i:>2} {c.method:6} {c.layout.describe():28} {c.activations.describe():52} "
                         f"{c.batching.describe():>7} {c.peak_bytes / GIB:9.2f} {c.host_bytes_per_node / GIB:9.1f} "
                         f"{c.step_seconds:7.2f} {c.tokens_per_s:10,.0f} {c.computed_tokens_per_s:9,.0f}")  # fmt: skip
        if not self.proposals:
            lines.append("   nothing fits")
        if self.rejected:
            # Per layout, what it was rejected for: its last rung (the one keeping the least on the card).
            last = {}
            for c in self.rejected:
                last[(c.method, c.layout, c.activations.selective, c.activations.unchecked_layers, c.batching.rows)] = c
            lines.append("rejected (each layout's last setting tried):")
            for c in last.values():
                lines.append(f"   {c.method:6} {c.layout.describe():28} {c.activations.describe():52} "
                             f"{c.batching.describe():>7} {c.reason}")  # fmt: skip
        lines.append(f"({self.traces} traces, {self.seconds:.0f} s; step times by the step-time model, see "
                     "docs/memory_plan.md#what-fits-my-gpus)")
        return "\n".join(lines)


def _sp_sizes(world: int) -> list[int]:
    return [n for n in range(world, 0, -1) if world % n == 0 and n & (n - 1) == 0]


def _modes(sp: int, config) -> list[str]:
    if sp == 1:
        return ["ring"]
    modes = ["ring"]
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % sp == 0 and (kv % sp == 0 or sp % kv == 0):
        modes.append("ulysses")
    return modes


def _distributions(method: str, world: int) -> list[tuple[str, bool]]:
    if world == 1:
        return [("single", False)]
    if method == "lora":
        return [("ddp", False), ("zero3", False)]
    return [("zero2", False), ("zero3", False), ("zero3", True)]


def _deepspeed(distributed: str, offload: bool) -> dict | None:
    if not distributed.startswith("zero"):
        return None
    zero = {"stage": int(distributed[-1])}
    if offload:
        zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    return {"zero_optimization": zero}


class _Planner:
    """Plans candidates, with every trace cached by what it depends on (not the ZeRO settings)."""

    def __init__(self, stage, config, shape, cluster, base_args, peft_configs, dtype, max_traced_layers, attention,
                 margin, device="cuda", pool=None):  # fmt: skip
        self.stage, self.config, self.shape, self.cluster, self.device = stage, config, shape, cluster, device
        self.budget = (1 - margin) * cluster.device_bytes
        self.base_args, self.peft_configs, self.dtype = base_args, peft_configs, dtype
        self.max_traced_layers, self.attention = max_traced_layers, attention
        self.cache: dict = {}
        self.pool = pool  # other processes tracing (`trace.trace_processes`), while the search lasts

    def args(self, method: str, layout: Layout, activations: Activations, batching: Batching = Batching()):
        kwargs = {"use_reentrant": False}
        if activations.checkpoint_offload:
            kwargs["offload"] = True
        if activations.selective:
            kwargs["selective"] = True
        if activations.unchecked_layers:
            kwargs["unchecked_layers"] = activations.unchecked_layers
        values = {f.name: getattr(self.base_args, f.name) for f in dataclasses.fields(self.base_args) if f.init}
        values.update(sequence_parallel_size=layout.sequence_parallel_size, sequence_parallel_mode=layout.mode,
                      gradient_checkpointing=True, activation_checkpointing=True, gradient_checkpointing_kwargs=kwargs,
                      activation_checkpointing_kwargs=kwargs, mlp_tile_tokens=activations.tile_tokens,
                      fused_lora=method == "lora", per_device_train_batch_size=batching.rows,
                      gradient_accumulation_steps=batching.accumulation)  # fmt: skip
        return type(self.base_args)(**values)

    def _key(self, method: str, layout: Layout, activations: Activations, rank: int, batching: Batching) -> tuple:
        ddp = not layout.distributed.startswith("zero")
        # A trace runs at most two micro-batches (`trace._trace_step`): any longer accumulation is the same trace.
        rows = (batching.rows, min(batching.accumulation, 2))
        return (method, layout.sequence_parallel_size, layout.mode, activations, rank, ddp, rows)

    def is_traced(self, method: str, layout: Layout, activations: Activations, rank: int = 0,
                  batching: Batching = Batching()) -> bool:  # fmt: skip
        """Whether this plan's trace is cached (its plan costs no trace)."""
        return self._key(method, layout, activations, rank, batching) in self.cache

    def plan(self, method: str, layout: Layout, activations: Activations, rank: int = 0,
             batching: Batching = Batching()) -> MemoryPlan:  # fmt: skip
        world = self.cluster.world_size
        args = self.args(method, layout, activations, batching)
        ddp = not layout.distributed.startswith("zero")
        key = self._key(method, layout, activations, rank, batching)
        if key not in self.cache:
            self.cache[key] = trace_step(self.stage, args, self.config, self.shape, peft_config=self.peft_configs[method],
                                         dtype=self.dtype, world_size=world, rank=rank,
                                         max_traced_layers=self.max_traced_layers, ddp=ddp, kernels=self.device,
                                         attention=self.attention, pool=self.pool)  # fmt: skip
        return plan_memory(self.stage, args, self.config, self.shape, peft_config=self.peft_configs[method],
                           dtype=self.dtype, world_size=world, rank=rank, distributed=layout.distributed,
                           device=self.device, attention=self.attention,
                           deepspeed_config=_deepspeed(layout.distributed, layout.offload),
                           traced=self.cache[key])  # fmt: skip

    def candidate(self, method, layout, activations, lora_r, plans, batching: Batching = Batching()) -> Candidate:
        peak = max(p.peak for p in plans)
        host = max(p.host_memory for p in plans) * self.cluster.gpus_per_node
        fits = peak <= self.budget
        reason = ""
        if not fits:
            reason = f"peak {peak / GIB:.1f} GiB over {self.budget / GIB:.1f}"
        elif self.cluster.host_bytes_per_node is not None and host > self.cluster.host_bytes_per_node:
            fits, reason = False, f"host memory {host / GIB:.0f} GiB a machine over {self.cluster.host_bytes_per_node / GIB:.0f}"
        candidate = Candidate(method, layout, activations, peak, host, fits, reason=reason, plans=plans,
                              batching=batching)  # fmt: skip
        if fits:
            self.time(candidate, lora_r)
        return candidate

    def time(self, candidate: Candidate, lora_r: int) -> None:
        args = self.args(candidate.method, candidate.layout, candidate.activations, candidate.batching)
        zero = int(candidate.layout.distributed[-1]) if candidate.layout.distributed.startswith("zero") else 0
        settings = settings_of(args, lora_r=lora_r if candidate.method == "lora" else 0, attention=self.attention,
                               world_size=self.cluster.world_size, zero_stage=zero)  # fmt: skip
        settings = dataclasses.replace(settings, gpus_per_node=self.cluster.gpus_per_node)
        seconds = estimate_step_seconds(self.config, self.stage, self.shape, settings, self.cluster.rates)
        groups = self.cluster.world_size // candidate.layout.sequence_parallel_size * candidate.batching.rows
        groups *= candidate.batching.accumulation
        candidate.step_seconds = seconds
        candidate.tokens_per_s = groups * self.shape.tokens(False, self.stage) / seconds
        candidate.computed_tokens_per_s = groups * self.shape.tokens(True, self.stage) / seconds


def default_lora_r(stage: str) -> int:
    """The recipes' LoRA rank: 8 for the DisRM (`simpo_disrm_lora.yaml`), 16 otherwise."""
    return 8 if stage == "simpo_disrm" else 16


def search(stage: str, model_config, shape: GroupShape, cluster: Cluster, *, methods=("lora", "full"),
           lora_r: int | None = None, base_args=None, margin: float = DEFAULT_MARGIN,
           max_traced_layers: int = DEFAULT_MAX_TRACED_LAYERS, spend_spare_memory: int = 2,
           device: str = "cuda", dtype: torch.dtype = torch.bfloat16, progress=None,
           processes: int | None = 1, rows_per_step: int | None = None) -> SearchResult:  # fmt: skip
    """Search the settings that fit (module docstring); the proposals sorted by tokens per second, fastest first.
    `base_args`: the stage's config the candidates start from (default: TRL's defaults, bf16). `spend_spare_memory`:
    how many of the fastest candidates also try selective checkpointing and unchecked layers. `device`: 'cuda' plans
    a GPU run (its kernels and CUDA terms), 'cpu' a CPU run (what a CPU run allocates: checked against measured CPU
    peaks); the step times are a GPU's either way. `progress(message)` is called as the search goes. `processes`:
    how many trace at once (`trace.trace_processes`; None: 2 where this process may use 2 cores, as `trl-longrm plan`
    does). The others are spawned: a script calling this with `processes` above 1 keeps its own work under
    `if __name__ == "__main__":` (each spawned process imports the script). `rows_per_step`: the groups an
    optimizer step takes over the whole cluster (the global batch; None: one a data-parallel replica, unaccumulated);
    each layout splits them over its replicas, one group a micro-batch accumulated, and the fastest candidates also
    try the most groups a micro-batch that fit (fewer micro-batches: `_larger_micro_batches`)."""
    from trl_longrm.memory_plan.trace import trace_processes

    with trace_processes(processes) as pool:
        result = _search(stage, model_config, shape, cluster, methods=methods, lora_r=lora_r, base_args=base_args,
                         margin=margin, max_traced_layers=max_traced_layers, spend_spare_memory=spend_spare_memory,
                         device=device, dtype=dtype, progress=progress, pool=pool,
                         rows_per_step=rows_per_step)  # fmt: skip
    result.planner.pool = None  # stopped with the context
    return result


def _search(stage, model_config, shape, cluster, *, methods, lora_r, base_args, margin, max_traced_layers,
            spend_spare_memory, device, dtype, progress, pool, rows_per_step=None) -> SearchResult:  # fmt: skip
    from peft import LoraConfig

    from trl_longrm.memory_plan.planned_kernels import planned_cuda_attention
    from trl_longrm.stages import stage_classes

    started = time.perf_counter()
    if isinstance(model_config, (str, bytes)) or hasattr(model_config, "__fspath__"):
        model_config = load_model_config(model_config)
    lora_r = lora_r or default_lora_r(stage)
    _, config_cls, _ = stage_classes(stage)
    tmp = tempfile.mkdtemp(prefix="trl_longrm_plan_")
    if base_args is None:
        extra = {"shared_prefix": True} if stage != "sft" else {"packing": True}
        base_args = config_cls(output_dir=tmp, use_cpu=True, bf16=dtype == torch.bfloat16, report_to=[],
                               gradient_checkpointing=True,
                               per_device_train_batch_size=1, max_length=shape.tokens(True, stage), **extra)  # fmt: skip
    task = "SEQ_CLS" if stage == "simpo_disrm" else "CAUSAL_LM"
    peft_configs = {"full": None, "lora": LoraConfig(r=lora_r, lora_alpha=lora_r if stage == "simpo_disrm" else 2 * lora_r,
                                                     lora_dropout=0.0, target_modules="all-linear", task_type=task)}
    attention = planned_cuda_attention(getattr(base_args, "ring_attn_backend", "auto") or "auto")
    planner = _Planner(stage, model_config, shape, cluster, base_args, peft_configs, dtype, max_traced_layers,
                       attention, margin, device, pool)  # fmt: skip
    say = progress or (lambda message: None)
    budget = (1 - margin) * cluster.device_bytes
    fitting, rejected = [], []
    if rows_per_step is not None and rows_per_step < 1:
        raise ValueError(f"rows_per_step must be at least 1, got {rows_per_step}")
    for method in methods:
        reference = {}  # (activations, ZeRO, offload) -> (sp, its plan's parts that scale with a rank's tokens)
        for sp in _sp_sizes(cluster.world_size):
            replicas = cluster.world_size // sp
            if rows_per_step is not None and rows_per_step % replicas:
                rejected.append(Candidate(method, Layout(sp), Activations(), 0, 0, False, reason=(
                    f"{rows_per_step} rows a step do not split over its {replicas} data-parallel replicas")))  # fmt: skip
                continue
            batching = Batching(1, rows_per_step // replicas if rows_per_step else 1)
            for mode in _modes(sp, model_config):
                for distributed, offload in _distributions(method, cluster.world_size):
                    layout = Layout(sp, mode, distributed, offload)
                    if offload and any(c.method == method for c in fitting):
                        continue  # host offload of ZeRO's states only where nothing else fits
                    for activations in LADDER:
                        estimate = _estimate(reference.get((activations, distributed, offload)), sp, cluster, budget)
                        if estimate is not None:
                            peak, host, reason = estimate
                            rejected.append(Candidate(method, layout, activations, int(peak), int(host), False,
                                                      reason=f"{reason} (from sp {reference[(activations, distributed, offload)][0]})",
                                                      estimated=True, batching=batching))  # fmt: skip
                            continue
                        say(f"{method}: {layout.describe()}, {activations.describe()}")
                        try:
                            plan = planner.plan(method, layout, activations, batching=batching)
                        except (ValueError, NotImplementedError) as error:  # a layout the model cannot take
                            rejected.append(Candidate(method, layout, activations, 0, 0, False,
                                                      reason=str(error).splitlines()[0][:120]))  # fmt: skip
                            break
                        reference.setdefault((activations, distributed, offload), (sp, _scaling_parts(plan)))
                        candidate = planner.candidate(method, layout, activations, lora_r, [plan], batching)
                        (fitting if candidate.fits else rejected).append(candidate)
                        if candidate.fits:
                            break
    # Confirm on the group's last rank too, then spend spare memory on the fastest.
    fitting.sort(key=lambda c: -c.tokens_per_s)
    confirmed = []
    for candidate in fitting:
        sp = candidate.layout.sequence_parallel_size
        plans = [planner.plan(candidate.method, candidate.layout, candidate.activations, rank, candidate.batching)
                 for rank in sorted({0, sp - 1})]  # fmt: skip
        checked = planner.candidate(candidate.method, candidate.layout, candidate.activations, lora_r, plans,
                                    candidate.batching)  # fmt: skip
        (confirmed if checked.fits else rejected).append(checked)
    confirmed.sort(key=lambda c: -c.tokens_per_s)
    upgraded = []
    for candidate in confirmed[:spend_spare_memory]:
        spent = _spend_spare_memory(planner, candidate, lora_r, say)
        upgraded += spent
        # Spare memory spent on rows too, with each activation setting (where the rows' estimate leaves room: the
        # most unchecked layers mostly leave none, and cost no trace then).
        for base in (candidate, *spent):
            larger = _larger_micro_batches(planner, base, lora_r, say)
            upgraded += larger
            rejected += [c for c in larger if not c.fits]
    upgraded = [c for c in upgraded if c.fits]
    proposals = sorted(confirmed + upgraded, key=lambda c: -c.tokens_per_s)
    return SearchResult(stage, cluster, shape, margin, proposals, rejected, len(planner.cache),
                        time.perf_counter() - started, planner, rows_per_step)  # fmt: skip


def longest_prompt(result: SearchResult, candidate: Candidate) -> dict:
    """The longest prompt (a multiple of 1,024 tokens; same responses) `candidate`'s settings fit with the search's
    margin, on the first and last rank of a group: `recipe.longest_group`'s secant search, each step a traced plan."""
    from trl_longrm.memory_plan.recipe import longest_group

    searched = result.planner
    sp = candidate.layout.sequence_parallel_size

    def plans_for(shape, args):
        planner = _Planner(result.stage, searched.config, shape, result.cluster, args, searched.peft_configs,
                           searched.dtype, searched.max_traced_layers, searched.attention, result.margin,
                           searched.device)  # fmt: skip
        return [planner.plan(candidate.method, candidate.layout, candidate.activations, rank, candidate.batching)
                for rank in sorted({0, sp - 1})]  # fmt: skip

    args = searched.args(candidate.method, candidate.layout, candidate.activations, candidate.batching)
    return longest_group(plans_for, args, result.stage, result.shape, candidate.plans, searched.budget)


def _scaling_parts(plan: MemoryPlan) -> tuple[tuple[int, int], tuple[int, int]]:
    """For the device's peak and for host memory, (what does not scale with a rank's tokens, what does): on the
    device a plan's activations and temporaries scale; on the host the offloaded activations (DeepSpeed's offloaded
    states, `host_terms`, do not)."""
    scaling = plan.activations + plan.temporaries
    host_fixed = sum(plan.host_terms.values())
    return (plan.peak - scaling, scaling), (host_fixed, plan.host_memory - host_fixed)


def _estimate(reference, sp: int, cluster: Cluster, budget: float) -> tuple[float, float, str] | None:
    """`(peak, host memory a machine, why)` estimated for sequence-parallel size `sp` from the plan of another size
    (`reference`, its `_scaling_parts`) where that estimate rejects the layout without a trace, else None. The device
    estimate is rejected past `ESTIMATE_REJECT` x the budget (peaks shift between events as the tokens change); host
    memory only 5% over (offloaded activations are proportional to the tokens)."""
    if reference is None:
        return None
    reference_sp, parts = reference
    peak, host = (fixed + scaling * reference_sp / sp for fixed, scaling in parts)
    host *= cluster.gpus_per_node
    if peak > ESTIMATE_REJECT * budget:
        return peak, host, f"estimated {peak / GIB:.0f} GiB"
    if cluster.host_bytes_per_node is not None and host > 1.05 * cluster.host_bytes_per_node:
        return peak, host, f"estimated host memory {host / GIB:.0f} GiB a machine"
    return None


def _ranks_heavier_first(candidate: Candidate) -> list[int]:
    """The group's first and last rank, the one whose plan peaked higher first: where it does not fit, the other is
    not planned (a trace saved)."""
    sp = candidate.layout.sequence_parallel_size
    peaks = {plan.rank: plan.peak for plan in candidate.plans}
    return sorted(sorted({0, sp - 1}), key=lambda rank: -peaks.get(rank, 0))


def _planned_on_ranks(planner: _Planner, candidate: Candidate, activations: Activations, batching: Batching,
                      ranks: list[int], lora_r: int) -> Candidate:  # fmt: skip
    """`candidate`'s layout with `activations` and `batching`, planned on `ranks`: the traced ones first (free), then in
    the order given; where one does not fit, the others are not planned (a trace saved)."""
    plans = []
    order = sorted(ranks, key=lambda r: not planner.is_traced(candidate.method, candidate.layout, activations, r,
                                                              batching))  # fmt: skip
    for rank in order:
        plans.append(planner.plan(candidate.method, candidate.layout, activations, rank, batching))
        if plans[-1].peak > planner.budget:
            break
    return planner.candidate(candidate.method, candidate.layout, activations, lora_r, plans, batching)


def _larger_micro_batches(planner: _Planner, candidate: Candidate, lora_r: int, say) -> list[Candidate]:
    """The most groups a micro-batch (a divisor of the rank's groups a step) that fit `candidate`'s layout, fewer
    micro-batches accumulated in their place: `[]` where the rank takes one group a step. The peak is estimated from
    the candidate's plans (what scales with a rank's tokens, times the rows) to skip what cannot fit; the largest
    estimated to fit is planned, then the next smaller while it does not fit. Returns those tried (the last fits, if
    any does; those estimated over the budget are not planned)."""
    groups = candidate.batching.rows * candidate.batching.accumulation
    sizes = [rows for rows in range(groups, 1, -1) if groups % rows == 0]
    if not sizes:
        return []
    (fixed, scaling), _ = _scaling_parts(max(candidate.plans, key=lambda p: p.peak))
    ranks = _ranks_heavier_first(candidate)
    out = []
    for rows in sizes:
        batching = Batching(rows, groups // rows)
        if fixed + scaling * rows > planner.budget:
            out.append(Candidate(candidate.method, candidate.layout, candidate.activations, int(fixed + scaling * rows),
                                 0, False, reason=f"estimated {(fixed + scaling * rows) / GIB:.2f} GiB", estimated=True,
                                 batching=batching))  # fmt: skip
            continue
        say(f"{candidate.method}: {candidate.layout.describe()}: {rows} groups a micro-batch")
        out.append(_planned_on_ranks(planner, candidate, candidate.activations, batching, ranks, lora_r))
        if out[-1].fits:
            break
    return out


def _spend_spare_memory(planner: _Planner, candidate: Candidate, lora_r: int, say) -> list[Candidate]:
    """Selective checkpointing and unchecked layers on a fitting candidate, each planned; those that fit."""
    out = []
    heavier_first = _ranks_heavier_first(candidate)

    def planned(activations):
        return _planned_on_ranks(planner, candidate, activations, candidate.batching, heavier_first, lora_r)

    base = candidate.activations
    selective = planned(dataclasses.replace(base, selective=True))
    if selective.fits:
        out.append(selective)
        base = selective.activations
    n, best = most_unchecked_layers(lambda n: planned(dataclasses.replace(base, unchecked_layers=n)),
                                    planner.config.num_hidden_layers, planner.budget)  # fmt: skip
    if best is not None:
        say(f"{candidate.method}: {candidate.layout.describe()}: {n} layers unchecked")
        out.append(best)
    return out


__all__ = ["Activations", "Batching", "Candidate", "Cluster", "Layout", "SearchResult", "longest_prompt", "search"]
