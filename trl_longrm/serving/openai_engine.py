"""OpenAI-compatible servers (`vllm serve`, SGLang, llama.cpp's server): a judge's prompts sent as token ids to
`/v1/completions`, a DisRM's sequences to `/classify` (vLLM's pooling runner).

The HTTP client is the `openai` package's (httpx underneath: pooled keep-alive connections, a timeout per request,
retries of a dropped connection, a timeout, a 408/409/429 or a 5xx with exponential backoff and jitter, honouring the
server's `Retry-After`). Requests go out in parallel, at most `max_concurrency` in flight for the engine however many
threads call it at once (the server batches them; with its prefix cache the shared context of a group is prefilled
once). A server that is down, too slow or overloaded past the retries gives one `EngineError` naming it; a request
the server refuses (a 4xx: too long for its context, a bad field) comes back as a `Generation` with its `refusal`, so
that the caller decides (the evaluation stops, a reward leaves that row unscored). The API key (the argument or
`OPENAI_API_KEY`) goes in the request header only: never in `identity()`, logs or `repr`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from trl_longrm.serving.base import EngineError, EngineUnavailable, Generation


# Fields only vLLM reads: the exact log-probabilities of asked tokens, and token ids in place of token strings. Another
# server that refuses them is asked again without them (then its top-k log-probabilities are what it reports).
_VLLM_FIELDS = ("logprob_token_ids", "return_tokens_as_token_ids", "return_token_ids")


class _HTTPRefusal(Exception):
    """A server's answer with an error status that retrying does not change (or that retries did not)."""

    def __init__(self, url: str, status: int, body: str):
        super().__init__(f"{url} answered {status}: {body[:500]}")
        self.url, self.status, self.body = url, status, body


def _status_error(what: str, error: _HTTPRefusal) -> EngineError:
    """A server's error answer as an `EngineError`: `EngineUnavailable` for a 5xx (the retries did not clear it: the
    server is failing, not the request), which a caller may try again later."""
    kind = EngineUnavailable if error.status >= 500 else EngineError
    return kind(f"{what}: {error}")


class _Server:
    """JSON over HTTP to one server through the `openai` client: its retries (backoff with jitter, `Retry-After`),
    timeouts and pooled connections, and one clear error."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float, max_retries: int):
        try:
            import openai
        except ImportError as error:
            raise ImportError(f"An OpenAI-compatible server is reached with the `openai` client: pip install openai ({error}).") from None
        self.base_url = base_url.rstrip("/")
        # `/classify`, `/version` and `/metrics` live beside `/v1`, at the server's root.
        self.root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self.timeout = timeout
        self.max_retries = max_retries
        api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        # A server started without --api-key ignores the header; the client needs some key to send.
        self._client = openai.OpenAI(
            base_url=self.base_url, api_key=api_key or "EMPTY", timeout=timeout, max_retries=max_retries
        )
        self._openai = openai

    def __repr__(self) -> str:
        return f"_Server({self.base_url!r})"

    def request(self, url: str, payload: dict | None = None) -> dict:
        """The JSON answer of a GET (no `payload`) or POST to `url`; `_HTTPRefusal` for an error status the retries
        did not clear, `EngineError` for a server that cannot be reached or does not answer in time."""
        openai = self._openai
        try:
            if payload is None:
                answer = self._client.get(url, cast_to=object)
            else:
                answer = self._client.post(url, body=payload, cast_to=object)
            # The client parses JSON by the answer's content type; a server that does not set it sends text.
            return json.loads(answer) if isinstance(answer, (str, bytes)) else answer
        except openai.APIStatusError as error:
            raise _HTTPRefusal(url, error.status_code, error.response.text) from None
        except openai.APITimeoutError:
            raise self.timed_out(url) from None
        except openai.APIConnectionError as error:
            raise self.unreachable(error.__cause__ or error) from None

    def timed_out(self, url: str) -> EngineUnavailable:
        return EngineUnavailable(
            f"{url} did not answer within {self.timeout:g} s ({self.max_retries + 1} tries); raise "
            "--request-timeout or check the server."
        )

    def unreachable(self, reason) -> EngineUnavailable:
        return EngineUnavailable(
            f"Cannot reach the server at {self.base_url} ({reason}; {self.max_retries + 1} tries). Is it "
            "running? Start one with `python -m vllm.entrypoints.openai.api_server --model PATH` (or `vllm "
            "serve PATH`) and pass its address as --base-url."
        )

    def models(self) -> list[dict]:
        """`/v1/models`' entries (vLLM's carry `root`, the checkpoint it loaded, and `max_model_len`)."""
        try:
            return list(self.request(f"{self.base_url}/models")["data"])
        except _HTTPRefusal as error:
            raise EngineError(f"{self.base_url}/models answered {error.status}: {error.body[:300]}") from None

    def served_models(self) -> list[str]:
        return [model["id"] for model in self.models()]

    def resolve_model(self, model: str | None) -> str:
        """The served model to ask for: `model`, checked against `/v1/models`, or the only one served."""
        served = self.served_models()
        if model is None:
            if len(served) != 1:
                raise EngineError(f"The server at {self.base_url} serves {served}; name one with --served-model.")
            return served[0]
        if model not in served:
            raise EngineError(
                f"The server at {self.base_url} does not serve {model!r}; it serves {served}. Pass one of them as "
                "--served-model (vLLM names a model by its path unless started with --served-model-name)."
            )
        return model


class _OpenAIEngine:
    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        max_concurrency: int = 8,
        timeout: float = 600.0,
        max_retries: int = 3,
    ):
        if max_concurrency < 1:
            raise ValueError(f"`max_concurrency` must be >= 1, got {max_concurrency}.")
        self.server = _Server(base_url, api_key, timeout, max_retries)
        self.model = self.server.resolve_model(model)
        card = next((entry for entry in self.server.models() if entry.get("id") == self.model), {})
        # vLLM reports the checkpoint it loaded and its context (prompt + generation); other servers may not.
        self.served_checkpoint = card.get("root")
        self.max_model_len = card.get("max_model_len")
        self.max_concurrency = max_concurrency
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.server.base_url!r}, model={self.model!r})"

    def identity(self) -> dict:
        return {"backend": "openai", "base_url": self.server.base_url, "served_model": self.model}

    def _map(self, function, items: Sequence) -> list:
        """`function` over `items`, at most `max_concurrency` requests in flight for the engine as a whole: the
        calls of several threads at once (the reward server judges groups concurrently) share one pool, so the
        server sees `max_concurrency` requests however many calls are made."""
        if not items:
            return []
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="openai-engine")
            pool = self._pool
        return list(pool.map(function, items))


# What a served checkpoint's tokenizer is compared on with the local one: chat markup, verdicts, digits, words and
# multi-byte characters.
_TOKENIZER_PROBE = "<|im_start|>user\nJudge [[A]] or [[B]], [[C>A>B]], [[7]]: 0123456789 the quick brown fox, déjà vu, 漢字 😀<|im_end|>\n"


class OpenAIGenerator(_OpenAIEngine):
    """A `GenerationEngine` on an OpenAI-compatible server's `/v1/completions`: each prompt sent as token ids, greedy
    (temperature 0, top_p 1), at most `max_new_tokens` tokens.

    From vLLM it reads the generated token ids and the exact log-probabilities of the asked tokens at each step
    (`logprob_token_ids`). A server without these fields (SGLang, llama.cpp) returns text and its top
    `top_logprobs` log-probabilities by token string: `tokenizer` (the checkpoint's) then re-tokenizes the text and
    maps the strings to ids, and a verdict token outside its top-k is missing from that step (the judge counts it).

    Example:
    ```python
    >>> engine = OpenAIGenerator("http://127.0.0.1:8000/v1", model="judge", max_concurrency=16)
    >>> judge = GenerativeJudge(engine, load_tokenizer("./LongReward_Qwen3-8B"))
    ```
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        tokenizer=None,
        top_logprobs: int = 20,
        repetition_penalty: float | None = None,
        **kwargs,
    ):
        super().__init__(base_url, model, **kwargs)
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs
        # Sent with every request when set (the judge's checkpoint's generation config), so that a server started
        # with `--generation-config vllm` (its defaults, not the checkpoint's) decodes as the other backends do.
        self.repetition_penalty = repetition_penalty
        self.vllm_fields = True
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)

    def _check_tokenizer(self, tokenizer) -> None:
        """Refuse a server whose tokenizer splits a probe text otherwise than `tokenizer` (the judge renders, cuts
        and reads every prompt with the local one; another checkpoint served would read other tokens). Checked on
        vLLM's `/tokenize`; a server without it is not checked."""
        try:
            served = self.server.request(
                f"{self.server.root}/tokenize",
                {"model": self.model, "prompt": _TOKENIZER_PROBE, "add_special_tokens": False},
            )["tokens"]
        except (_HTTPRefusal, KeyError, TypeError):
            return
        local = tokenizer(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
        if list(served) != list(local):
            raise EngineError(
                f"The server at {self.server.base_url} serves {self.model!r} (checkpoint "
                f"{self.served_checkpoint or 'unknown'}) with a tokenizer other than the local one "
                f"({getattr(tokenizer, 'name_or_path', tokenizer)!r}): the same text gives other token ids. Serve the "
                "judge's checkpoint, or give the tokenizer of the checkpoint served."
            )

    def _complete(self, prompt: list[int], max_new_tokens: int, asked: list[int]) -> Generation:
        payload = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "top_p": 1.0,
        }
        if self.repetition_penalty is not None:
            payload["repetition_penalty"] = self.repetition_penalty
        if asked:
            payload["logprobs"] = self.top_logprobs
        if self.vllm_fields:
            payload.update(return_tokens_as_token_ids=True, return_token_ids=True)
            if asked:
                payload["logprob_token_ids"] = asked
        url = f"{self.server.base_url}/completions"
        try:
            choice = self.server.request(url, payload)["choices"][0]
        except _HTTPRefusal as error:
            if self.vllm_fields and error.status in (400, 422) and any(f in error.body for f in _VLLM_FIELDS):
                self.vllm_fields = False  # not vLLM: ask again without its fields
                return self._complete(prompt, max_new_tokens, asked)
            if error.status in (400, 413, 422):
                # This prompt's own fault (too long, a field refused): the others of the batch go on.
                return Generation(token_ids=[], refusal=f"The server refused a completion request: {error}")
            raise _status_error("The server refused a completion request", error) from None
        return self._generation(choice, asked)

    def _generation(self, choice: dict, asked: list[int]) -> Generation:
        token_ids = choice.get("token_ids")
        steps = (choice.get("logprobs") or {}).get("top_logprobs") or []
        if token_ids is None:
            if self.tokenizer is None:
                raise EngineError(
                    f"The server at {self.server.base_url} returns text, not token ids (not vLLM): give the "
                    "OpenAIGenerator the checkpoint's tokenizer to read it."
                )
            token_ids = self.tokenizer(choice["text"], add_special_tokens=False)["input_ids"]
            pieces = (choice.get("logprobs") or {}).get("tokens")
            # The server's steps are its own tokens; they are read at our re-tokenized ids only where both agree, step
            # by step. Otherwise no step is trusted: the judge reads the verdict with its forced one-token pass, whose
            # single step is unambiguous.
            aligned = len(steps) == len(token_ids) and (
                pieces is None or [self.tokenizer.decode([t]) for t in token_ids] == list(pieces)
            )
            if not aligned:
                steps = [{} for _ in token_ids]
        if not asked:
            return Generation(token_ids=list(token_ids))
        wanted = {token: token for token in asked}
        if steps and not any(str(key).startswith("token_id:") for step in steps for key in step):
            if self.tokenizer is None:
                raise EngineError("Log-probabilities by token string need the checkpoint's tokenizer.")
            wanted = {self.tokenizer.decode([token]): token for token in asked}
        logprobs = []
        for step in steps:
            values = {}
            for key, value in step.items():
                token = int(key[len("token_id:") :]) if str(key).startswith("token_id:") else wanted.get(key)
                if token in asked:
                    values[token] = value
            logprobs.append(values)
        return Generation(token_ids=list(token_ids), logprobs=logprobs)

    def generate(
        self, prompts: Sequence[list[int]], max_new_tokens: int, logprob_token_ids: list[int] | None = None
    ) -> list[Generation]:
        asked = list(logprob_token_ids or [])
        return self._map(lambda prompt: self._complete(prompt, max_new_tokens, asked), list(prompts))

    def identity(self) -> dict:
        return {**super().identity(), "top_logprobs": self.top_logprobs}

    def _sample_one(self, prompt: list[int], max_new_tokens: int, sampling) -> list[Generation]:
        if sampling.greedy and sampling.n > 1:  # vLLM refuses n > 1 at temperature 0: one answer, n times
            return self._sample_one(prompt, max_new_tokens, dataclasses.replace(sampling, n=1)) * sampling.n
        payload = {"model": self.model, "prompt": list(prompt), "max_tokens": max_new_tokens, "n": sampling.n,
                   "temperature": sampling.temperature, "top_p": sampling.top_p}  # fmt: skip
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        if self.vllm_fields:
            payload.update(return_tokens_as_token_ids=True, return_token_ids=True)
        try:
            choices = self.server.request(f"{self.server.base_url}/completions", payload)["choices"]
        except _HTTPRefusal as error:
            if self.vllm_fields and error.status in (400, 422) and any(f in error.body for f in _VLLM_FIELDS):
                self.vllm_fields = False  # not vLLM: ask again without its fields
                return self._sample_one(prompt, max_new_tokens, sampling)
            raise _status_error("The server refused a completion request", error) from None
        return [self._generation(choice, []) for choice in sorted(choices, key=lambda c: c.get("index", 0))]

    def sample(self, prompts: Sequence[list[int]], max_new_tokens: int, sampling) -> list[list[Generation]]:
        """`Sampling.n` continuations of each prompt (`trl_longrm.serving.sampling`): one request per prompt with `n`,
        so the server prefills the prompt once for its samples; requests in parallel, at most `max_concurrency`."""
        from trl_longrm.serving.sampling import per_prompt

        jobs = list(zip(prompts, per_prompt(sampling, len(prompts)), strict=True))
        return self._map(lambda job: self._sample_one(job[0], max_new_tokens, job[1]), jobs)


class OpenAIScorer(_OpenAIEngine):
    """A `ScoringEngine` on a vLLM server started with the pooling runner (`--runner pooling`): each token-id sequence
    posted to `/classify` with `use_activation: false`, so the answer is the classifier's raw logit at the sequence's
    last token (the token training scores), not vLLM's default sigmoid of it. `batch_size` sequences per request.

    Example:
    ```python
    >>> scorer = OpenAIScorer("http://127.0.0.1:8000/v1", model="disrm")
    >>> DiscriminativeJudge(scorer, load_tokenizer("./my_disrm")).judge(requests)
    ```
    """

    def __init__(self, base_url: str, model: str | None = None, *, batch_size: int = 16, **kwargs):
        super().__init__(base_url, model, **kwargs)
        self.batch_size = batch_size

    def _classify(self, batch: list[list[int]]) -> list[float]:
        url = f"{self.server.root}/classify"
        try:
            data = self.server.request(url, {"model": self.model, "input": batch, "use_activation": False})["data"]
        except _HTTPRefusal as error:
            if error.status in (400, 404, 405, 501):
                raise EngineError(
                    f"The server at {self.server.base_url} cannot score sequences ({url} answered {error.status}: "
                    f"{error.body[:300]}). Serve the DisRM with vLLM's pooling runner: `python -m "
                    "vllm.entrypoints.openai.api_server --model PATH --runner pooling`."
                ) from None
            raise EngineError(f"The server refused a classification request: {error}") from None
        return [float(item["probs"][0]) for item in sorted(data, key=lambda item: item["index"])]

    def score(self, sequences: Sequence[list[int]]) -> list[float]:
        batches = [list(map(list, sequences[i : i + self.batch_size])) for i in range(0, len(sequences), self.batch_size)]
        return [score for batch in self._map(self._classify, batches) for score in batch]
