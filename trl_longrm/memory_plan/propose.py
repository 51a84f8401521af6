"""Settings the memory plan proposes: spare memory spent on speed.

`largest_unchecked_layers`: the most decoder layers a run can leave unchecked by gradient checkpointing
(`gradient_checkpointing_kwargs={"unchecked_layers": N}`, `trl_longrm.memory.partial_checkpointing`) and still fit the
card with a margin. Each unchecked layer keeps its activations (the same bytes for every layer past the first: the plan
is affine in N, `trace._add_unchecked_layers`) and saves its recompute, so two plans give the slope and a third, of the
N proposed, confirms it.

Example:
```python
>>> from trl_longrm import SimPODisRMConfig
>>> from trl_longrm.memory_plan import GroupShape
>>> from trl_longrm.memory_plan.devices import device_memory_bytes
>>> from trl_longrm.memory_plan.propose import largest_unchecked_layers
>>> args = SimPODisRMConfig(output_dir="disrm", use_cpu=True, bf16=True, gradient_checkpointing=True)
>>> layers, plan = largest_unchecked_layers("simpo_disrm", args, "llama-3.1-8b",
...                                         GroupShape(32768, 256, 4), device_memory_bytes("h200"), device="cuda")
```
"""

from __future__ import annotations

from trl_longrm.memory_plan.plan import MemoryPlan, load_model_config, plan_memory
from trl_longrm.memory_plan.trace import with_unchecked_layers


# The share of the card a proposal leaves free: the plan is within 2% of every peak measured (docs/memory_plan.md).
DEFAULT_MARGIN = 0.03


def most_unchecked_layers(plan, layers: int, budget: float):
    """`(N, plan(N))`: the most first layers of a `layers`-layer model left unchecked whose plan's peak is within
    `budget`, where `plan(n)` plans the run with `n` unchecked; `(0, None)` where one does not fit. The plan is affine
    in N from the first unchecked layer on (`trace._add_unchecked_layers`): the plans of 1 and 2 give the slope, the
    plan of the N it gives confirms it (stepped down while it does not fit: the top layer's recompute is the backward's
    peak while it is checkpointed)."""
    one = plan(1)
    if one.peak > budget:
        return 0, None
    two = plan(2) if layers > 1 else one
    slope = max(two.peak - one.peak, 1)
    n = max(1, min(layers, 1 + int((budget - one.peak) // slope)))
    proposed = {1: one, 2: two}.get(n) or plan(n)
    while proposed.peak > budget and n > 1:
        n -= 1
        proposed = plan(n)
    return n, proposed


def largest_unchecked_layers(stage: str, training_args, model_config, shape, device_bytes: int,
                             margin: float = DEFAULT_MARGIN, **plan_kwargs) -> tuple[int, MemoryPlan]:  # fmt: skip
    """`(N, plan)`: the largest number of first decoder layers `training_args` (with gradient checkpointing) can leave
    unchecked with the planned peak within `(1 - margin) * device_bytes`, and the plan of it (`plan_memory` with
    `plan_kwargs`; `most_unchecked_layers`' rule). N is the model's layer count when no layer needs checkpointing, 0
    when none can be left unchecked (then the plan is that of every layer checkpointed, fitting or not)."""
    if not training_args.activation_checkpointing:
        raise ValueError("largest_unchecked_layers needs gradient_checkpointing=True: without it no layer is checked.")
    if isinstance(model_config, (str, bytes)) or hasattr(model_config, "__fspath__"):
        model_config = load_model_config(model_config)

    def plan(layers):
        return plan_memory(stage, with_unchecked_layers(training_args, layers), model_config, shape, **plan_kwargs)

    layers, proposed = most_unchecked_layers(plan, model_config.num_hidden_layers, (1 - margin) * device_bytes)
    return (layers, proposed) if proposed is not None else (0, plan(0))


__all__ = ["DEFAULT_MARGIN", "largest_unchecked_layers", "most_unchecked_layers"]
