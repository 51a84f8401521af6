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


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_function")
    tokenizer = build_chat_tokenizer()
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


def batch(prompts, conversational):
    """GRPO's layout: each prompt's generations consecutive, completions of mixed lengths."""
    ps, cs = [], []
    for i, prompt in enumerate(prompts):
        for g in range(GENERATIONS):
            text = sentence(10 * i + g, 2 + 5 * g)
            ps.append(prompt)
            cs.append([{"role": "assistant", "content": text}] if conversational else " " + text)
    return ps, cs


@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "plain"])
@pytest.mark.parametrize("budget", [None, 64], ids=["one_row", "64_tokens_per_forward"])
def test_rewards_equal_the_stock_reward_model_path(paths, tmp_path, conversational, budget):
    prompts = CONVERSATIONAL if conversational else PLAIN
    ps, cs = batch(prompts, conversational)
    stock = grpo_trainer(paths, paths["disrm"], tmp_path, prompts)
    expected = stock._calculate_rewards([{"prompt": p} for p in ps], ps, cs, [[0]] * len(ps))[:, 0]
    reward = LongRMReward(paths["disrm"], max_tokens_per_forward=budget, device="cpu")
    assert reward.__name__ == "LongRMReward"
    got = torch.tensor(reward(prompts=ps, completions=cs, completion_ids=None))
    assert expected.std() > 1e-3  # the completions get different rewards: a wrong token or order would show
    torch.testing.assert_close(got, expected.float(), atol=1e-4, rtol=0)
    # Shuffled (equal prompts not consecutive): same rewards per completion.
    order = torch.randperm(len(ps), generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = reward(prompts=[ps[i] for i in order], completions=[cs[i] for i in order])
    torch.testing.assert_close(torch.tensor(shuffled), got[order], atol=1e-5, rtol=0)


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
