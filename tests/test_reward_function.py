"""`LongRMReward` against TRL's own reward-model path (`GRPOTrainer(reward_funcs="<path>")._calculate_rewards`), and
in two real GRPO steps."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from trl_longrm import LongRMReward
from trl_longrm.evaluation.judges import plan_shared_rows
from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model


_WORDS = "the city river number name year color animal planet capital author book price height".split()


def sentence(seed: int, n: int) -> str:
    return " ".join(_WORDS[(seed * 7 + 3 * i) % len(_WORDS)] for i in range(n))


CONVERSATIONAL = [
    [{"role": "system", "content": "Answer."}, {"role": "user", "content": sentence(1, 40)}],
    [{"role": "user", "content": sentence(2, 25)}],
]
PLAIN = [sentence(3, 30) + " Answer:", sentence(4, 12) + " Answer:"]
GENERATIONS = 4

# ChatML with tool calls, tool answers, a `tools` schema and a template variable (`style`, set through
# `chat_template_kwargs`): what GRPO passes to the template, or leaves out, changes the tokens and so the rewards.
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\ntools: ' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
    "{% if style is defined %}{{ '<|im_start|>system\\nstyle: ' + style + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>' + call['function']['name'] + ' ' + (call['function']['arguments'] | tojson) + '</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                           "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_function")
    tokenizer = build_chat_tokenizer(chat_template=TOOL_TEMPLATE)
    return {
        "disrm": save_tiny_model(root / "disrm", task="seq-cls", tokenizer=tokenizer, seed=5),
        "policy": save_tiny_model(root / "policy", tokenizer=tokenizer, seed=6),
        "root": root,
    }


def grpo_trainer(paths, reward_funcs, tmp_path, prompts, **overrides):
    args = dict(output_dir=str(tmp_path / "grpo"), use_cpu=True, bf16=False, report_to=[], logging_steps=1,
                per_device_train_batch_size=GENERATIONS, num_generations=GENERATIONS, max_completion_length=6)  # fmt: skip
    args.update(overrides)
    return GRPOTrainer(model=paths["policy"], reward_funcs=reward_funcs, args=GRPOConfig(**args),
                       train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))  # fmt: skip


def batch(prompts, conversational, tool_calls=False):
    """GRPO's layout: each prompt's generations consecutive, completions of mixed lengths; with `tool_calls`, a
    multi-turn completion (a tool call, the tool's answer, the reply) for every other generation."""
    ps, cs = [], []
    for i, prompt in enumerate(prompts):
        for g in range(GENERATIONS):
            text = sentence(10 * i + g, 2 + 5 * g)
            ps.append(prompt)
            if not conversational:
                cs.append(" " + text)
            elif tool_calls and g % 2:
                call = {"type": "function", "function": {"name": "lookup", "arguments": {"word": sentence(g, 1)}}}
                cs.append([{"role": "assistant", "content": "", "tool_calls": [call]},
                           {"role": "tool", "name": "lookup", "content": sentence(i + g, 6)},
                           {"role": "assistant", "content": text}])  # fmt: skip
            else:
                cs.append([{"role": "assistant", "content": text}])
    return ps, cs


def calculate_rewards(trainer, prompts, completions, **columns):
    """`GRPOTrainer._calculate_rewards` on a batch, each dataset column in `columns` given one value per row."""
    inputs = [{"prompt": p, **columns} for p in prompts]
    return trainer._calculate_rewards(inputs, prompts, completions, [[0]] * len(prompts))


CASES = {
    "conversational": dict(prompts=CONVERSATIONAL),
    "plain": dict(prompts=PLAIN),
    # The trainer's `chat_template_kwargs` reach the reward model's template, a dataset's `tools` column does not.
    "tools_and_chat_template_kwargs": dict(prompts=CONVERSATIONAL, tool_calls=True,
                                           args={"chat_template_kwargs": {"style": "brief"}}, columns={"tools": TOOLS}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("budget", [None, 64], ids=["one_row", "64_tokens_per_forward"])
def test_rewards_equal_the_stock_reward_model_path(paths, tmp_path, case, budget):
    """One GRPOTrainer with both reward functions: the DisRM path (stock, column 0) and `LongRMReward` (column 1),
    each computed by TRL's own `_calculate_rewards`."""
    spec = CASES[case]
    conversational = spec["prompts"] is CONVERSATIONAL
    ps, cs = batch(spec["prompts"], conversational, spec.get("tool_calls", False))
    reward = LongRMReward(paths["disrm"], max_tokens_per_forward=budget, device="cpu")
    assert reward.__name__ == "LongRMReward"
    trainer = grpo_trainer(paths, [paths["disrm"], reward], tmp_path, spec["prompts"], **spec.get("args", {}))
    rewards = calculate_rewards(trainer, ps, cs, **spec.get("columns", {}))
    expected, got = rewards[:, 0], rewards[:, 1]
    assert expected.std() > 1e-3  # the completions get different rewards: a wrong token or order would show
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    if "args" in spec:  # the setting changes the rewards: without it (a direct call) they differ
        direct = torch.tensor(reward(prompts=ps, completions=cs))
        assert (direct - expected).abs().max() > 1e-3
    # Shuffled (equal prompts not consecutive): same rewards per completion.
    order = torch.randperm(len(ps), generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = calculate_rewards(trainer, [ps[i] for i in order], [cs[i] for i in order], **spec.get("columns", {}))
    torch.testing.assert_close(shuffled[:, 1], got[order], atol=1e-5, rtol=0)


def test_own_chat_template_kwargs_update_the_trainers(paths, tmp_path):
    """`LongRMReward(chat_template_kwargs=...)` renders as stock does with the trainer's kwargs updated by those."""
    ps, cs = batch(CONVERSATIONAL, True)
    stock = grpo_trainer(paths, paths["disrm"], tmp_path, CONVERSATIONAL, chat_template_kwargs={"style": "long"})
    expected = calculate_rewards(stock, ps, cs)[:, 0]
    reward = LongRMReward(paths["disrm"], device="cpu", chat_template_kwargs={"style": "long"})
    ours = grpo_trainer(paths, reward, tmp_path, CONVERSATIONAL, chat_template_kwargs={"style": "brief"})
    torch.testing.assert_close(calculate_rewards(ours, ps, cs)[:, 0], expected, atol=1e-4, rtol=0)
    # Outside a trainer: its own kwargs only.
    torch.testing.assert_close(torch.tensor(reward(prompts=ps, completions=cs)), expected, atol=1e-4, rtol=0)


def test_each_prompt_is_encoded_once_per_row(paths):
    """The forward sees each prompt's tokens once: one row holding each prompt, then each completion's own tokens."""
    from trl_longrm.evaluation.judges import _common_prefix_length

    reward = LongRMReward(paths["disrm"], device="cpu")
    ps, cs = batch(CONVERSATIONAL, True)
    seen = []
    hook = reward.judge.model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    try:
        reward(prompts=ps, completions=cs)
    finally:
        hook.remove()
    sequences = reward.sequences(ps, cs)
    groups = [sequences[i : i + GENERATIONS] for i in range(0, len(sequences), GENERATIONS)]
    shared = [_common_prefix_length(g) for g in groups]
    expected = sum(p + sum(len(s) - p for s in g) for p, g in zip(shared, groups))
    # (GENERATIONS - 1) copies of each prompt are not encoded
    assert seen == [expected] == [sum(map(len, sequences)) - (GENERATIONS - 1) * sum(shared)] and min(shared) > 20
    assert plan_shared_rows(groups, 8, 10**6) == [groups]


def test_two_grpo_steps_with_longrm_reward(paths, tmp_path):
    calls = []

    class Counting(LongRMReward):
        def __call__(self, prompts, completions, completion_ids=None, **kwargs):
            rewards = super().__call__(prompts, completions, completion_ids, **kwargs)
            calls.append(len(rewards))
            return rewards

    reward = Counting(paths["disrm"], device="cpu")
    trainer = grpo_trainer(paths, [reward], tmp_path, CONVERSATIONAL * 4, max_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2 and calls and all(n == GENERATIONS for n in calls)
    logged = [log for log in trainer.state.log_history if "rewards/LongRMReward/mean" in log]
    assert logged and all(torch.isfinite(torch.tensor(log["rewards/LongRMReward/mean"])) for log in logged)


def test_instance_needs_its_tokenizer(paths):
    model = AutoModelForSequenceClassification.from_pretrained(paths["disrm"])
    with pytest.raises(ValueError, match="needs the reward model's tokenizer"):
        LongRMReward(model)
    reward = LongRMReward(model, AutoTokenizer.from_pretrained(paths["disrm"]))
    assert reward(prompts=PLAIN[:1], completions=[" a river"])[0] == pytest.approx(
        LongRMReward(paths["disrm"], device="cpu")(prompts=PLAIN[:1], completions=[" a river"])[0], abs=1e-5
    )


def test_instance_goes_to_the_accelerator_device(paths, monkeypatch):
    """Without `device`, a model instance goes where GRPOTrainer puts a reward model: the process's accelerator device
    (`PartialState().device`; the meta device stands in for a GPU here)."""
    import accelerate

    class State:
        device = torch.device("meta")

    model = AutoModelForSequenceClassification.from_pretrained(paths["disrm"])
    monkeypatch.setattr(accelerate, "PartialState", State)
    assert LongRMReward(model, AutoTokenizer.from_pretrained(paths["disrm"])).judge.model.device.type == "meta"
    assert LongRMReward(paths["disrm"]).judge.model.device.type == "meta"
    assert LongRMReward(paths["disrm"], device="cpu").judge.model.device.type == "cpu"


@pytest.mark.parametrize("position", [0, 1])
def test_an_empty_sequence_is_refused_naming_its_row(paths, position):
    """An empty prompt + completion has no token to score (stock fails on it alone); it is refused, not given the
    other completion's score."""
    ps, cs = [PLAIN[0], PLAIN[0]], [" a river", " the city"]
    ps[position], cs[position] = "", ""
    reward = LongRMReward(paths["disrm"], device="cpu")
    with pytest.raises(ValueError, match=f"row {position} \\(prompt '', completion ''\\) has no token to score"):
        reward(prompts=ps, completions=cs)
    with pytest.raises(ValueError, match="row 0 .* has no token to score"):
        reward(prompts=[""], completions=[""])
