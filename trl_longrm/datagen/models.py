"""The models a data step asks (responders, judges, a policy): any engine of `trl_longrm.serving`, behind one call.

A `ModelSpec` names a model and how to reach it:
- `transformers`: a local checkpoint, generated from in this process;
- `vllm`: a local checkpoint in an in-process `vllm.LLM` (prefix caching on);
- `openai`: an OpenAI-compatible server's `/v1/completions` (`vllm serve`, SGLang), prompts sent as token ids
  rendered with the checkpoint's tokenizer (`tokenizer`, else `model`), so the server sees the tokens a local run would;
- `chat`: a server's `/v1/chat/completions` (a hosted judge), messages rendered by the server;
- `python`: a function `module:name` (or `path/to/file.py:name`) called as `function(messages, n=..., seed=...)`
  and returning `n` texts: a scripted or rule-based judge.

`ChatModel.answer(conversations, max_new_tokens, samplings)` returns each conversation's `n` answers with their token
counts; requests go out together (vLLM and servers batch them, at most `max_concurrency` in flight on a server).

Example:
```python
>>> spec = ModelSpec(name="judge-a", backend="openai", base_url="http://127.0.0.1:8000/v1", tokenizer="./judge-a")
>>> model = build_chat_model(spec)
>>> [[answer]] = model.answer([[{"role": "user", "content": "..."}]], 512, [Sampling(temperature=0.0)])
```
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trl_longrm.data.errors import RunConfigError
from trl_longrm.serving.sampling import Sampling


BACKENDS = ("transformers", "vllm", "openai", "chat", "python")


@dataclass
class ModelSpec:
    """How to reach one model of a data step (see the module's docstring for the backends).

    Example:
    ```python
    >>> ModelSpec(name="qwen-small", backend="vllm", model="./Qwen3-0.6B")
    ```
    """

    name: str = field(metadata={"help": "The model's name in the records (a response's `model`, a judge's name)."})
    backend: str = field(
        default="transformers",
        metadata={"help": f"One of {', '.join(BACKENDS)}. Default transformers.", "choices": list(BACKENDS)},
    )
    model: str | None = field(
        default=None, metadata={"help": "Local checkpoint (transformers, vllm; the tokenizer of openai)."}
    )
    base_url: str | None = field(default=None, metadata={"help": "The server's `/v1` address (openai, chat)."})
    served_model: str | None = field(
        default=None, metadata={"help": "The served model's name (openai, chat). Default: the only one served."}
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer of the openai backend, if not `model`'s."}
    )
    function: str | None = field(
        default=None, metadata={"help": "`module:name` or `file.py:name` of the python backend."}
    )
    api_key_env: str | None = field(
        default=None,
        metadata={
            "help": "Environment variable holding the server's API key (never the key itself in a recipe). Default "
            "None: OPENAI_API_KEY where set."
        },
    )
    max_concurrency: int = field(default=8, metadata={"help": "Requests in flight on a server at most. Default 8."})
    request_timeout: float = field(
        default=600.0, metadata={"help": "Seconds a server may take to answer. Default 600."}
    )
    max_retries: int = field(
        default=3, metadata={"help": "Retries of a request a server dropped or refused for now (429, 5xx). Default 3."}
    )
    dtype: str = field(default="auto", metadata={"help": "dtype of a local checkpoint. Default auto."})
    engine_kwargs: dict = field(
        default_factory=dict, metadata={"help": "Other arguments of the engine (e.g. vLLM's `max_model_len`)."}
    )

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a model needs a `name`, got {self.name!r}")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"model {self.name!r}: `backend` {self.backend!r} unknown; expected one of {list(BACKENDS)}"
            )
        needs = {
            "transformers": ("model",), "vllm": ("model",), "openai": ("base_url",), "chat": ("base_url",),
            "python": ("function",),
        }[self.backend]  # fmt: skip
        for key in needs:
            if not getattr(self, key):
                raise ValueError(f"model {self.name!r}: the {self.backend} backend needs `{key}`")
        if self.backend == "openai" and not (self.tokenizer or self.model):
            raise ValueError(
                f"model {self.name!r}: the openai backend sends token ids and needs the checkpoint's tokenizer "
                "(`tokenizer` or `model`); for a server whose tokenizer is not here, use backend `chat`"
            )

    @classmethod
    def from_dict(cls, raw, where: str) -> ModelSpec:
        """A spec from a recipe's mapping; an unknown or bad key is a `RunConfigError` naming `where` and the key."""
        if isinstance(raw, ModelSpec):
            return raw
        if not isinstance(raw, Mapping):
            raise RunConfigError(f"{where}: a model must be a mapping with `name`, `backend`, ..., got {raw!r:.100}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise RunConfigError(f"{where}: unknown key(s) {unknown} of a model; expected some of {sorted(known)}")
        try:
            return cls(**raw)
        except (TypeError, ValueError) as error:
            raise RunConfigError(f"{where}: {error}") from None

    def identity(self) -> dict:
        """What decides the model's answers (for caches and a step's settings): not its address or key."""
        keys = {"transformers": ("model", "dtype"), "vllm": ("model", "dtype"), "openai": ("served_model", "tokenizer"),
                "chat": ("served_model",), "python": ("function",)}[self.backend]  # fmt: skip
        values = {key: getattr(self, key) for key in keys}
        if self.backend == "openai":
            values["tokenizer"] = self.tokenizer or self.model
        if self.backend in ("transformers", "vllm", "openai") and values.get("model"):
            values["model"] = os.path.abspath(values["model"])
        return {"name": self.name, "backend": self.backend, **values}


@dataclass(frozen=True)
class Answer:
    """One answer: its `text`, the request's `prompt_tokens` (the same for the `n` answers of one request; None
    where unknown) and its `generated_tokens`."""

    text: str
    prompt_tokens: int | None = None
    generated_tokens: int | None = None


def continues(messages: Sequence[dict]) -> bool:
    """Whether a conversation ends with an assistant turn to continue (a prefilled answer, as TRL reads a prompt
    ending with an assistant message): the model writes the rest of that turn, not a new one."""
    return bool(messages) and messages[-1].get("role") == "assistant"


class ChatModel:
    """A model of a data step: `answer(conversations, max_new_tokens, samplings)` -> each conversation's answers."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.name = spec.name

    @property
    def remote(self) -> bool:
        """Whether the model runs elsewhere (a server), so that asking it does not use this machine's cores."""
        return self.spec.backend in ("openai", "chat")

    def answer(
        self, conversations: Sequence[list[dict]], max_new_tokens: int, samplings: Sequence[Sampling]
    ) -> list[list[Answer]]:
        raise NotImplementedError


class TokenChatModel(ChatModel):
    """A sampling engine on token ids (`TransformersGenerator`, `VLLMGenerator`, `OpenAIGenerator`) with the
    checkpoint's tokenizer: conversations rendered with its chat template, answers decoded without special tokens."""

    def __init__(self, spec: ModelSpec, engine, tokenizer):
        super().__init__(spec)
        self.engine = engine
        self.tokenizer = tokenizer

    def answer(self, conversations, max_new_tokens, samplings):
        from trl_longrm.evaluation.judges import _chat_ids

        prompts = [
            _chat_ids(self.tokenizer, messages, not continues(messages), continue_final_message=continues(messages))
            for messages in conversations
        ]
        groups = self.engine.sample(prompts, max_new_tokens, list(samplings))
        return [
            [
                Answer(self.tokenizer.decode(g.token_ids, skip_special_tokens=True), len(prompt), len(g.token_ids))
                for g in group
            ]
            for prompt, group in zip(prompts, groups, strict=True)
        ]


class ServerChatModel(ChatModel):
    """A server's chat route (`OpenAIChatGenerator`)."""

    def __init__(self, spec: ModelSpec, engine):
        super().__init__(spec)
        self.engine = engine

    def answer(self, conversations, max_new_tokens, samplings):
        groups = self.engine.chat(list(conversations), max_new_tokens, list(samplings))
        return [[Answer(c.text, c.prompt_tokens, c.completion_tokens) for c in group] for group in groups]


class PythonChatModel(ChatModel):
    """A Python function `function(messages, n=..., seed=...) -> list[str]` (a scripted judge)."""

    def __init__(self, spec: ModelSpec, function: Callable):
        super().__init__(spec)
        self.function = function

    def answer(self, conversations, max_new_tokens, samplings):
        groups = []
        for messages, sampling in zip(conversations, samplings, strict=True):
            texts = self.function(messages, n=sampling.n, seed=sampling.seed)
            if (
                not isinstance(texts, (list, tuple))
                or len(texts) != sampling.n
                or not all(isinstance(t, str) for t in texts)
            ):
                raise RunConfigError(
                    f"model {self.name!r}: {self.spec.function} must return a list of {sampling.n} texts, got "
                    f"{texts!r:.200}"
                )
            groups.append([Answer(text) for text in texts])
        return groups


def load_function(reference: str, name: str) -> Callable:
    """The function `module:attr` or `path/to/file.py:attr`; a reference that does not resolve is a
    `RunConfigError` naming the model."""
    module_name, _, attr = reference.rpartition(":")
    if not module_name or not attr:
        raise RunConfigError(f"model {name!r}: `function` must be `module:name` or `file.py:name`, got {reference!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser()
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or not path.is_file():
                raise FileNotFoundError(f"no such file {path} (resolved against {Path.cwd()})")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError, FileNotFoundError, SyntaxError) as error:
        raise RunConfigError(f"model {name!r}: cannot load the function {reference!r}: {error}") from None


def build_chat_model(spec: ModelSpec) -> ChatModel:
    """The `ChatModel` of `spec`, loading or reaching it now: a checkpoint that cannot be read is a `RunConfigError`
    naming it, a server that does not answer an `EngineError` naming the server."""
    from trl_longrm.evaluation.runner import model_error

    if spec.backend == "python":
        return PythonChatModel(spec, load_function(spec.function, spec.name))
    api_key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
    if spec.api_key_env and api_key is None:
        raise RunConfigError(f"model {spec.name!r}: the environment variable {spec.api_key_env} is not set")
    if spec.backend == "chat":
        from trl_longrm.serving.chat import OpenAIChatGenerator

        engine = OpenAIChatGenerator(spec.base_url, spec.served_model, api_key=api_key,
                                     max_concurrency=spec.max_concurrency, timeout=spec.request_timeout,
            max_retries=spec.max_retries)  # fmt: skip
        return ServerChatModel(spec, engine)
    from trl_longrm.evaluation.judges import load_tokenizer

    source = spec.tokenizer or spec.model
    try:
        tokenizer = load_tokenizer(source)
    except (OSError, ValueError) as error:
        raise model_error(source, error) from None
    if spec.backend == "openai":
        from trl_longrm.serving.openai_engine import OpenAIGenerator

        engine = OpenAIGenerator(spec.base_url, spec.served_model, tokenizer=tokenizer, api_key=api_key,
                                 max_concurrency=spec.max_concurrency, timeout=spec.request_timeout,
            max_retries=spec.max_retries)  # fmt: skip
        return TokenChatModel(spec, engine, tokenizer)
    try:
        if spec.backend == "vllm":
            from trl_longrm.evaluation.runner import _user_import_vllm
            from trl_longrm.serving.vllm_engine import VLLMGenerator

            _user_import_vllm()
            engine = VLLMGenerator(spec.model, dtype=spec.dtype, **spec.engine_kwargs)
        else:
            import torch
            from transformers import AutoModelForCausalLM

            from trl_longrm.evaluation.judges import _load_checked
            from trl_longrm.serving.transformers_engine import TransformersGenerator

            model = _load_checked(AutoModelForCausalLM, spec.model, spec.dtype, "causal-lm")
            model = model.to("cuda" if torch.cuda.is_available() else "cpu")
            engine = TransformersGenerator(model, tokenizer)
    except (OSError, ValueError) as error:
        raise model_error(spec.model, error) from None
    return TokenChatModel(spec, engine, tokenizer)
