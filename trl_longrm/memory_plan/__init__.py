"""Will it fit? A run's per-rank peak memory, predicted before it starts by tracing one optimizer step of the real
trainer on fake tensors (`trl_longrm.memory_plan.trace`), plus named terms for what the trace cannot see
(`trl_longrm.memory_plan.plan`); and what fits a cluster, ranked by estimated speed (`trl_longrm.memory_plan.search`).
See docs/memory_plan.md."""

import importlib


# Imported when first used (PEP 562): `trl-longrm`'s parser reads this package's command options without loading torch.
_EXPORTS = {"GroupShape": "trace", "MemoryPlan": "plan", "load_model_config": "plan", "plan_memory": "plan"}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GroupShape", "MemoryPlan", "load_model_config", "plan_memory"]
