"""The chat route of OpenAI-compatible servers (`/v1/chat/completions`): conversations sent as messages, rendered by
the server with its model's chat template. For hosted judges and responders whose tokenizer is not on this machine
(the token-id route, `OpenAIGenerator`, needs it); the data steps of `trl_longrm.datagen` use either.

Example:
```python
>>> from trl_longrm.serving import OpenAIChatGenerator, Sampling
>>> engine = OpenAIChatGenerator("https://api.example.com/v1", model="judge-70b", max_concurrency=16)
>>> [[answer]] = engine.chat([[{"role": "user", "content": "Rate this response ..."}]], max_new_tokens=1024)
>>> answer.text, answer.completion_tokens
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from trl_longrm.serving.base import EngineError
from trl_longrm.serving.openai_engine import _HTTPRefusal, _OpenAIEngine
from trl_longrm.serving.sampling import Sampling, per_prompt


GREEDY = Sampling(temperature=0.0)


@dataclass(frozen=True)
class ChatCompletion:
    """One answer of the chat route: its `text`, the tokens the server counted (`prompt_tokens` once per request,
    whatever `n`; None where the server does not say) and why it stopped (`finish_reason`: `stop`, `length`)."""

    text: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


class OpenAIChatGenerator(_OpenAIEngine):
    """Chat completions from an OpenAI-compatible server (vLLM, SGLang, a hosted API): each conversation one request
    with `n` answers, at most `max_concurrency` requests in flight, retried politely on a dropped connection, a 429
    or a 5xx (`trl_longrm.serving.openai_engine`). A server down, too slow or refusing gives one `EngineError`
    naming it. The answers' `completion_tokens` are the server's `usage` shared out evenly over the `n` answers
    where it counts only the whole request's.

    Args:
        base_url: the server's `/v1` address.
        model: the served model (default: the only one it serves).
        api_key, max_concurrency, timeout, max_retries: as for `OpenAIGenerator`.
    """

    def chat(
        self,
        conversations: Sequence[list[dict]],
        max_new_tokens: int,
        sampling: Sampling | Sequence[Sampling] = GREEDY,
    ) -> list[list[ChatCompletion]]:
        """For each conversation in order, its `n` answers."""
        jobs = list(zip(conversations, per_prompt(sampling, len(conversations)), strict=True))
        return self._map(lambda job: self._chat_one(job[0], max_new_tokens, job[1]), jobs)

    def _chat_one(self, messages: list[dict], max_new_tokens: int, sampling: Sampling) -> list[ChatCompletion]:
        if sampling.greedy and sampling.n > 1:  # vLLM refuses n > 1 at temperature 0: one answer, n times
            return self._chat_one(messages, max_new_tokens, dataclasses.replace(sampling, n=1)) * sampling.n
        payload = {"model": self.model, "messages": list(messages), "max_tokens": max_new_tokens, "n": sampling.n,
                   "temperature": sampling.temperature, "top_p": sampling.top_p}  # fmt: skip
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        if messages and messages[-1].get("role") == "assistant":
            # A prefilled answer to continue: vLLM's (and SGLang's) chat parameters; a server without them refuses.
            payload.update(add_generation_prompt=False, continue_final_message=True)
        url = f"{self.server.base_url}/chat/completions"
        try:
            answer = self.server.request(url, payload)
        except _HTTPRefusal as error:
            raise EngineError(f"The server refused a chat request: {error}") from None
        choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != sampling.n:
            raise EngineError(f"{url} answered {len(choices)} choices for n={sampling.n}: {str(answer)[:300]}")
        usage = answer.get("usage") or {}
        prompt_tokens = usage.get("prompt_tokens")
        generated = usage.get("completion_tokens")
        share = None if generated is None else generated / len(choices)
        return [
            ChatCompletion(
                text=(choice.get("message") or {}).get("content") or "",
                prompt_tokens=prompt_tokens,
                completion_tokens=None if share is None else round(share),
                finish_reason=choice.get("finish_reason"),
            )
            for choice in choices
        ]

    def identity(self) -> dict:
        return {**super().identity(), "route": "chat"}
