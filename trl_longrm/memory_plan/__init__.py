"""Will it fit? A run's per-rank peak memory, predicted before it starts by tracing one optimizer step of the real
trainer on fake tensors (`trl_longrm.memory_plan.trace`), plus named terms for what the trace cannot see."""
