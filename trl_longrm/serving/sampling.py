"""Sampling from the engines: several continuations per prompt at a temperature, for the data steps that need a
spread of responses (`trl_longrm.datagen`: responders, best-of-N rollouts) rather than a judge's greedy verdict.

`GenerationEngine.generate` stays greedy; an engine that can also sample has `sample(prompts, max_new_tokens,
sampling)` (`SamplingEngine`): one list of `Sampling.n` `Generation`s per prompt. A `Sampling` may be given per
prompt, so that each request carries its own seed: the same prompt and seed give the same samples whatever else is
in the batch (vLLM and OpenAI-compatible servers seed each request; transformers seeds each prompt's `generate`), and
a data step that resumes after a crash redraws nothing differently.

Example:
```python
>>> from trl_longrm.serving import Sampling, VLLMGenerator
>>> engine = VLLMGenerator("./policy")
>>> groups = engine.sample(prompts, max_new_tokens=512, sampling=Sampling(n=4, temperature=0.8, seed=7))
>>> len(groups[0])
4
```
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from trl_longrm.serving.base import Generation


@dataclass(frozen=True)
class Sampling:
    """How to draw continuations of one prompt.

    Args:
        n: continuations per prompt.
        temperature: softmax temperature; 0 is greedy (then the `n` continuations are the same one).
        top_p: nucleus sampling's probability mass (1.0: off). No top-k: every engine samples from the whole
            vocabulary (transformers' default `top_k=50` is turned off).
        seed: the request's seed (None: the engine's own randomness).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"`n` must be >= 1, got {self.n}.")
        if self.temperature < 0:
            raise ValueError(f"`temperature` must be >= 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"`top_p` must be in (0, 1], got {self.top_p}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def per_prompt(sampling: Sampling | Sequence[Sampling], num_prompts: int) -> list[Sampling]:
    """One `Sampling` per prompt: `sampling` repeated, or the list given (checked to have one per prompt)."""
    if isinstance(sampling, Sampling):
        return [sampling] * num_prompts
    sampling = list(sampling)
    if len(sampling) != num_prompts:
        raise ValueError(f"{len(sampling)} samplings for {num_prompts} prompts; give one, or one per prompt.")
    return sampling


@runtime_checkable
class SamplingEngine(Protocol):
    """An engine that samples: `sample(prompts, max_new_tokens, sampling)` returns, for each token-id prompt in order,
    its `n` continuations (each at most `max_new_tokens` tokens, stopping at the model's end-of-sequence tokens);
    `sampling` is one `Sampling` or one per prompt."""

    def sample(
        self, prompts: Sequence[list[int]], max_new_tokens: int, sampling: Sampling | Sequence[Sampling]
    ) -> list[list[Generation]]: ...

    def identity(self) -> dict: ...
