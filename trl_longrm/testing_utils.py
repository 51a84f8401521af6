"""Offline fixtures: a chat tokenizer and tiny randomly initialised Llama / Qwen3 models.

Nothing here touches the network. Tests, the demo and the benchmarks build their models with these helpers, and
`save_tiny_model` writes a model directory so that code paths taking a model *path* are exercised as a user would use
them.

Example:
```python
>>> from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model
>>> tokenizer = build_chat_tokenizer()
>>> model = build_tiny_model("qwen3", "causal-lm", tokenizer)
>>> ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
```
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
)


PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]

# A ChatML template (the Qwen family's layout) with `{% generation %}` markers, so that
# `return_assistant_tokens_mask=True` works as it does for TRL's assistant-only loss. Unknown roles raise.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The same ChatML layout with the newline written *before* each message instead of after it: a conversation's rendering
# ends at its last `<|im_end|>` (as Llama-3's ends at `<|eot_id|>`), so a reward model's last token is its EOS. Between
# messages the tokens are ChatML's.
CHAT_TEMPLATE_ENDING_AT_EOS = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{% if messages %}{{ '\n' }}{% endif %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is was for on that with as by at from it an be this which or are have has had not but "
    "were one all their been there would can will more when who what about out up into them some could other "
    "than then its only over also after first two new time these may such like any well most where between "
    "context question answer response judge score analysis evidence passage document key value fact claim "
    "correct incorrect consistent contradicts supports reference summary code math safety citation long short "
    "model reward chosen rejected better worse helpful harmless accurate faithful relevant complete city river "
    "number name year color animal planet country capital language author book price height weight distance"
).split()


def _training_corpus(seed: int = 0, n_lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if i % 3 == 0:
            words.append(str(rng.randint(0, 9999)))
        if i % 5 == 0:
            words.append(f"[[{rng.choice('ABCD')}]] [Score: {rng.randint(1, 10)}]")
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ":", ","]))
    return lines


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int, corpus: tuple[str, ...] = ()) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus() + list(corpus), trainer)
    return tokenizer.to_str()


def build_chat_tokenizer(
    vocab_size: int = 512, corpus: tuple[str, ...] | list[str] = (), chat_template: str = CHAT_TEMPLATE
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text round-trips) with a ChatML chat template (`CHAT_TEMPLATE`, or
    `CHAT_TEMPLATE_ENDING_AT_EOS`), EOS and pad tokens.

    The BPE merges are learnt in code from a fixed word list, plus the lines of `corpus` when given (the demo passes
    text of its synthetic suite, so that its words become single tokens and its sequences get shorter), so the
    tokenizer is the same on every call and machine.
    """
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size, tuple(corpus))),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        model_max_length=1_000_000,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_config(arch: str, tokenizer: PreTrainedTokenizerFast, **overrides):
    """Config of a 2-layer model with grouped-query attention (4 query heads, 2 KV heads)."""
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
        return Qwen3Config(**common)
    raise ValueError(f"Unknown tiny architecture {arch!r}; expected 'llama' or 'qwen3'.")


def build_tiny_model(
    arch: str = "llama",
    task: str = "causal-lm",
    tokenizer: PreTrainedTokenizerFast | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> PreTrainedModel:
    """A randomly initialised tiny model. `task` is `"causal-lm"` or `"seq-cls"` (one score label)."""
    tokenizer = tokenizer or build_chat_tokenizer()
    config = tiny_config(arch, tokenizer, **config_overrides)
    torch.manual_seed(seed)
    if task == "causal-lm":
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif task == "seq-cls":
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    else:
        raise ValueError(f"Unknown task {task!r}; expected 'causal-lm' or 'seq-cls'.")
    if hasattr(model, "generation_config") and model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny_model(
    path: str | Path,
    arch: str = "llama",
    task: str = "causal-lm",
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    **config_overrides,
) -> str:
    """Build a tiny model and its tokenizer (default `build_chat_tokenizer()`) and `save_pretrained` both into `path`;
    returns the path as a string."""
    path = Path(path)
    tokenizer = tokenizer or build_chat_tokenizer()
    model = build_tiny_model(arch, task, tokenizer, seed=seed, **config_overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def steer_generation(model: PreTrainedModel, script: list[int], bias: float = 1000.0) -> PreTrainedModel:
    """Make greedy `model.generate` write the token ids `script` first, then go on freely: a random model that writes
    a chosen opening (e.g. a judgment up to its verdict) with real forward passes, for tests and benchmarks.

    Inside `generate` only, the logits of `script[i]` get `bias` added at the i-th generated step; a plain forward
    (teacher forcing) is untouched. Works for decoder models whose backbone is `model.model` and head `model.lm_head`.

    Example:
    ```python
    >>> script = tokenizer("Both fine.\n[[", add_special_tokens=False)["input_ids"]
    >>> steer_generation(model, script)
    >>> tokenizer.decode(model.generate(ids, max_new_tokens=len(script) + 1)[0, ids.shape[1]:])  # 'Both fine.\n[[' + 1
    ```
    """
    state = {"active": False, "step": 0}

    def count(module, args, kwargs):
        if state["active"]:
            # A prompt (several tokens) starts a generation; each later call adds one token.
            state["step"] = 0 if kwargs["input_ids"].shape[1] > 1 else state["step"] + 1

    def steer(module, args, output):
        if state["active"] and state["step"] < len(script):
            output = output.clone()
            output[..., script[state["step"]]] += bias
            return output
        return output

    model.model.register_forward_pre_hook(count, with_kwargs=True)
    model.lm_head.register_forward_hook(steer)
    generate = model.generate

    def steered_generate(*args, **kwargs):
        state["active"] = True
        try:
            return generate(*args, **kwargs)
        finally:
            state["active"] = False

    model.generate = steered_generate
    return model
