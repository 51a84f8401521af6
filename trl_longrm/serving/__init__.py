"""Inference engines behind the judges: transformers' `generate`, vLLM in process, and OpenAI-compatible servers.

Names are imported on first use, so that importing the package does not import vLLM.

Example:
```python
>>> from trl_longrm.evaluation import GenerativeJudge
>>> from trl_longrm.serving import OpenAIGenerator
>>> judge = GenerativeJudge(OpenAIGenerator("http://127.0.0.1:8000/v1", model="judge"), tokenizer)
```
"""

from __future__ import annotations

import importlib


_EXPORTS = {
    "base": ["EngineError", "EngineUnavailable", "Generation", "GenerationEngine", "ScoringEngine"],
    "transformers_engine": ["TransformersGenerator"],
    "vllm_engine": ["VLLMGenerator", "VLLMScorer"],
    "openai_engine": ["OpenAIGenerator", "OpenAIScorer"],
    "sampling": ["Sampling", "SamplingEngine"],
    "chat": ["ChatCompletion", "OpenAIChatGenerator"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
