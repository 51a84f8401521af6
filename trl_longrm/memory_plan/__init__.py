"""Will it fit? A run's per-rank peak memory, predicted before it starts by tracing one optimizer step of the real
trainer on fake tensors (`trl_longrm.memory_plan.trace`), plus named terms for what the trace cannot see
(`trl_longrm.memory_plan.plan`). See docs/memory_plan.md."""

from trl_longrm.memory_plan.plan import MemoryPlan, load_model_config, plan_memory
from trl_longrm.memory_plan.trace import GroupShape


__all__ = ["GroupShape", "MemoryPlan", "load_model_config", "plan_memory"]
