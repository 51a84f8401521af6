"""What a judge needs of an inference engine, whatever runs it: greedy continuations of token-id prompts with the
log-probabilities of a few named tokens at each step (a generative judge), or the scalar score of token-id sequences
(a discriminative RM).

Prompts travel as token ids, rendered and cut to head + tail by the judge with the checkpoint's own tokenizer, so that
transformers, an in-process vLLM engine and an OpenAI-compatible server all see the very tokens training saw; the
continuation comes back as token ids too and is decoded by the same tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass
class Generation:
    """One greedy continuation.

    Args:
        token_ids: the generated tokens (without the prompt), as the engine sampled them.
        logprobs: for each generated step, the log-probability of each token id asked for (`logprob_token_ids`) at that
            step, keyed by token id; None when none were asked. A token the engine did not report at a step (a server
            that only returns its top-k) is absent from that step's dict.
    """

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None


class EngineError(RuntimeError):
    """An engine could not serve a request: a server down, slow past its timeout, or refusing the request. Its message
    says which and names the server; it is the user's setting to fix, so the CLI prints it without a traceback."""


@runtime_checkable
class GenerationEngine(Protocol):
    """Greedy generation from token-id prompts.

    `generate(prompts, max_new_tokens, logprob_token_ids)` returns one `Generation` per prompt, in order: greedy
    decoding (temperature 0), at most `max_new_tokens` tokens, stopping at the model's end-of-sequence tokens, and for
    each step the log-probabilities of `logprob_token_ids`. `identity()` names what decides the outputs (the engine and
    its model and settings, never a secret), for the evaluation's run identity.
    """

    def generate(
        self, prompts: Sequence[list[int]], max_new_tokens: int, logprob_token_ids: list[int] | None = None
    ) -> list[Generation]: ...

    def identity(self) -> dict: ...


@runtime_checkable
class ScoringEngine(Protocol):
    """The scalar score of each token-id sequence, read at its last token (a 1-label sequence classifier's raw logit,
    no activation), in order; `identity()` as for `GenerationEngine`."""

    def score(self, sequences: Sequence[list[int]]) -> list[float]: ...

    def identity(self) -> dict: ...
