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
        refusal: why the engine refused this prompt (a server's 4xx answer: longer than its context, a field it does
            not take), None when it generated. A refused prompt has no tokens; the caller decides what it is worth (the
            evaluation stops on it, a reward leaves the row unscored).
    """

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    refusal: str | None = None


class EngineError(RuntimeError):
    """An engine could not serve a request: a server down, slow past its timeout, or refusing the request. Its message
    says which and names the server; it is the user's setting to fix, so the CLI prints it without a traceback."""


class EngineUnavailable(EngineError):
    """The engine's server could not be reached, did not answer in time, or answered a server error (5xx) past the
    retries: nothing about the request itself, so the same request may succeed later (the reward server answers its
    clients 503 with `Retry-After`)."""


@runtime_checkable
class GenerationEngine(Protocol):
    """Greedy generation from token-id prompts.

    `generate(prompts, max_new_tokens, logprob_token_ids)` returns one `Generation` per prompt, in order: greedy
    decoding (temperature 0), at most `max_new_tokens` tokens, stopping at the model's end-of-sequence tokens, and for
    each step the log-probabilities of `logprob_token_ids`: the model's own (raw) log-probabilities, before the
    generation config's processors (a repetition penalty), which choose the greedy tokens. `identity()` names what
    decides the outputs (the engine and its model and settings, never a secret), for the evaluation's run identity.

    An engine may have `max_model_len`, the longest prompt + generation it takes (None: unknown), which a judge cuts
    its prompts to fit.
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


# Generation-config fields that change which token greedy decoding picks. transformers' `generate` applies them all;
# vLLM (in process or served) takes only the repetition penalty from a checkpoint's generation config.
_GREEDY_FIELDS_VLLM_LACKS = (
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "suppress_tokens",
    "begin_suppress_tokens", "sequence_bias", "forced_bos_token_id", "forced_eos_token_id", "min_length",
    "min_new_tokens", "exponential_decay_length_penalty", "encoder_repetition_penalty", "watermarking_config",
)  # fmt: skip


def greedy_settings(model_path: str | None, backend: str) -> dict:
    """What of the checkpoint's `generation_config.json` changes a greedy judgment, for an engine that does not read
    it the way transformers' `generate` does: `{"repetition_penalty": x}` when it sets one (vLLM in process ignores
    the checkpoint's config when given explicit sampling parameters; a server may have been started without it).
    A field that changes greedy tokens and that vLLM cannot apply is refused for `backend` `vllm` / `openai`, naming
    it: the backends would write different judgments. `{}` without a checkpoint or a generation config."""
    if not model_path:
        return {}
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return {}
    defaults = GenerationConfig()
    if backend != "transformers":
        changed = [
            field for field in _GREEDY_FIELDS_VLLM_LACKS
            if getattr(config, field, None) not in (None, 0, getattr(defaults, field, None))
        ]  # fmt: skip
        if changed:
            raise ValueError(
                f"{model_path}/generation_config.json sets {', '.join(f'{f}={getattr(config, f)!r}' for f in changed)}, "
                f"which changes greedy judgments and which the {backend} backend cannot apply (vLLM applies only "
                "repetition_penalty): judge with --backend transformers, or remove it from the generation config."
            )
    penalty = getattr(config, "repetition_penalty", None)
    return {"repetition_penalty": float(penalty)} if penalty not in (None, 1.0) else {}
