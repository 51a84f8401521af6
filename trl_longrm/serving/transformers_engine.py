"""The transformers engine: `model.generate` over left-padded batches, and a model's scores at the scored token."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from trl_longrm.serving.base import Generation


def left_padded(rows: Sequence[list[int]], pad_id: int, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` padded to the longest with `pad_id` (on the left, or the right with `left=False`), and the mask."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(row, dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


def pad_token_id(tokenizer) -> int:
    """The id to pad with: the pad token, else EOS (the attention mask hides the padding anyway)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"The tokenizer of {tokenizer.name_or_path!r} has neither a pad nor an EOS token.")
    return pad


class _RawStepLogprobs:
    """Keeps, at every generation step, the model's own log-probabilities of a few tokens (read at the output
    embedding, before `generate`'s generation-config processors such as a repetition penalty), so that they are read
    from the pass that wrote the continuation instead of a second forward over the whole prompt. The raw ones, as
    vLLM reports them (its default `logprobs_mode`) and as the one-token forced pass reads them: the processors change
    which token greedy decoding picks, not what the model believes."""

    def __init__(self, head: torch.nn.Module, token_ids: list[int]):
        self.token_ids = token_ids
        self.steps: list[torch.Tensor] = []
        self.handle = head.register_forward_hook(self._record)

    def _record(self, module, args, output):
        self.steps.append(output[:, -1, :].float().log_softmax(dim=-1)[:, self.token_ids].detach())

    def remove(self) -> None:
        self.handle.remove()


class TransformersGenerator:
    """A `GenerationEngine` over a transformers causal LM: greedy `generate` with the KV cache, `batch_size` prompts
    at a time (left-padded), under the checkpoint's generation config (its repetition penalty, end tokens).

    Example:
    ```python
    >>> engine = TransformersGenerator(model, tokenizer, batch_size=4)
    >>> engine.generate([[1, 2, 3]], max_new_tokens=4, logprob_token_ids=[65, 66])[0].token_ids
    ```
    """

    max_model_len = None  # no limit of its own: the judge's `max_length` bounds what it is given

    def __init__(self, model, tokenizer, batch_size: int | None = None):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {batch_size}.")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.pad_id = pad_token_id(tokenizer)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._lock = threading.Lock()

    def identity(self) -> dict:
        return {"backend": "transformers"}

    def _until_eos(self, row: list[int]) -> list[int]:
        # `generate` fills a finished row with padding: the continuation ends at its first EOS (kept, as vLLM keeps it).
        for i, token in enumerate(row):
            if token in self.eos_ids:
                return row[: i + 1]
        return row

    def generate(
        self, prompts: Sequence[list[int]], max_new_tokens: int, logprob_token_ids: list[int] | None = None
    ) -> list[Generation]:
        """Greedy continuations, `batch_size` prompts per `generate` call (all at once when None). Concurrent calls
        run one after the other: a call's log-probabilities are recorded by a hook on the shared output embedding."""
        size = self.batch_size or max(len(prompts), 1)
        with self._lock:
            return [
                generation
                for start in range(0, len(prompts), size)
                for generation in self._generate_batch(prompts[start : start + size], max_new_tokens, logprob_token_ids)
            ]

    @torch.no_grad()
    def _generate_batch(
        self, prompts: Sequence[list[int]], max_new_tokens: int, logprob_token_ids: list[int] | None = None
    ) -> list[Generation]:
        device = self.model.device
        input_ids, attention_mask = left_padded(prompts, self.pad_id, left=True)
        if max_new_tokens == 1:
            return self._one_step(input_ids.to(device), attention_mask.to(device), logprob_token_ids)
        recorder = _RawStepLogprobs(self.model.get_output_embeddings(), logprob_token_ids) if logprob_token_ids else None
        try:
            generated = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                # With the KV cache whatever the saved configs say: transformers' Trainer saves the models it trains
                # with `use_cache: false` (TrainingArguments' default), and without the cache each new token
                # recomputes the whole prompt (a 16-token judgment: 16 prompt-length passes instead of one).
                use_cache=True,
                pad_token_id=self.pad_id,
            )[:, input_ids.shape[1] :]
        finally:
            if recorder is not None:
                recorder.remove()
        rows = [self._until_eos(row) for row in generated.tolist()]
        if recorder is None:
            return [Generation(token_ids=row) for row in rows]
        steps = torch.stack(recorder.steps, dim=1).cpu()  # [rows, steps, asked tokens]
        return [
            Generation(
                token_ids=row,
                logprobs=[dict(zip(logprob_token_ids, step.tolist())) for step in steps[r, : len(row)]],
            )
            for r, row in enumerate(rows)
        ]

    @torch.no_grad()
    def _one_step(self, input_ids, attention_mask, logprob_token_ids) -> list[Generation]:
        """One token: a plain forward over the prompts' last positions (the forced-decoding pass of a verdict), without
        `generate`'s overhead: the model's own next-token distribution (its log-probabilities raw, as `generate`'s;
        the token is the greedy one under the generation config's repetition penalty, as `generate` picks it)."""
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=1,
            use_cache=False,
        ).logits[:, -1, :].float()  # fmt: skip
        logprobs = logits.log_softmax(dim=-1)
        penalty = getattr(self.model.generation_config, "repetition_penalty", None)
        if penalty not in (None, 1.0):
            from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

            logits = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
        tokens = logits.argmax(dim=-1).tolist()
        if not logprob_token_ids:
            return [Generation(token_ids=[token]) for token in tokens]
        asked = logprobs[:, logprob_token_ids].cpu().tolist()
        return [
            Generation(token_ids=[token], logprobs=[dict(zip(logprob_token_ids, row))]) for token, row in zip(tokens, asked)
        ]

    @torch.no_grad()
    def sample(self, prompts: Sequence[list[int]], max_new_tokens: int, sampling) -> list[list[Generation]]:
        """`Sampling.n` continuations of each prompt (`trl_longrm.serving.sampling`): one `generate` per prompt, under
        the prompt's own seed (forked, so the caller's random state is untouched), so that its samples do not depend
        on the other prompts. Temperature 0 is greedy (one continuation, repeated)."""
        from trl_longrm.serving.sampling import per_prompt

        groups = []
        device = self.model.device
        for prompt, params in zip(prompts, per_prompt(sampling, len(prompts)), strict=True):
            input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
            options = dict(do_sample=False, num_return_sequences=1)
            if not params.greedy:
                # No top-k (transformers' generation default is 50): vLLM and the servers sample the whole vocabulary.
                options = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0,
                               num_return_sequences=params.n)  # fmt: skip
            devices = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                generated = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new_tokens,
                    use_cache=True,
                    pad_token_id=self.pad_id,
                    **options,
                )[:, input_ids.shape[1] :]
            rows = [Generation(token_ids=self._until_eos(row)) for row in generated.tolist()]
            groups.append(rows * params.n if params.greedy else rows)
        return groups
