"""One scoring convention for a trained DisRM, the ecosystem's: every reader scores a conversation at the last token of
its rendering. A tiny DisRM is trained one step by `SimPODisRMTrainer` and saved, for three chat templates (ChatML,
which writes a newline after its EOS; a template ending at its EOS with pad == EOS; a Llama-3-style one with no pad
token), then scored by: the trainer itself (`sequence_scores` on its own packed batch), our evaluator
(`DiscriminativeJudge`, shared prefix and padded), plain `AutoModelForSequenceClassification` with the chat template
(left and right padding, mixed lengths), TRL's `GRPOTrainer` reward-model path (`_calculate_rewards`) and
`LongRMReward` in it (with and without `as_trained`). All agree within 1e-4.

Plain-text rows, where GRPO reads another token (the completion without the trained EOS): training, the evaluator,
`trl-longrm score` and `LongRMReward(as_trained=True)` agree; GRPO's path and `LongRMReward`'s default agree with each
other, and differ from them."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from datasets import Dataset
from trainer_helpers import cpu_args
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from trl_longrm import LongRMReward, SimPODisRMConfig, SimPODisRMTrainer
from trl_longrm.evaluation.judges import DiscriminativeJudge, JudgeRequest
from trl_longrm.scoring import unused_special_token
from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model


PROMPTS = [
    [{"role": "system", "content": "You judge answers."}, {"role": "user", "content": "Which city has the long river?"}],
    [{"role": "user", "content": "Name the capital of the country with the red planet book."}],
]
RESPONSES = [
    ["The city of the river.", "A planet.", "the name of the city has a long river and a capital"],
    ["The capital.", "It is the author of the book with the price and the height of the animal", "No."],
]

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|finetune_right_pad_id|>"]  # fmt: skip
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def template_tokenizer(name: str):
    tokenizer = build_chat_tokenizer()
    if name == "chatml":  # `<|im_end|>`, then a newline; pad `<|endoftext|>`
        return tokenizer
    if name == "ends_at_eos_pad_is_eos":
        ends = copy.deepcopy(tokenizer)
        ends.chat_template = tokenizer.chat_template.replace("{% endgeneration %}{{ '\\n' }}", "{% endgeneration %}")
        ends.pad_token = ends.eos_token
        return ends
    tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
    tokenizer.eos_token = "<|eot_id|>"
    tokenizer.pad_token = None
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


def conversation(prompt, response):
    return [*prompt, {"role": "assistant", "content": response}]


@pytest.fixture(scope="module", params=["chatml", "ends_at_eos_pad_is_eos", "llama3"])
def trained(request, tmp_path_factory):
    """(template name, trainer, saved DisRM directory)."""
    root = tmp_path_factory.mktemp(request.param)
    tokenizer = template_tokenizer(request.param)
    base = save_tiny_model(root / "base", task="seq-cls", tokenizer=tokenizer, seed=3)
    if request.param != "chatml":  # saved with pad == EOS (or none), as such checkpoints come
        saved = AutoTokenizer.from_pretrained(base)
        assert saved.pad_token is None or saved.pad_token == saved.eos_token
    rows = [{"prompt": p, "chosen": r[0], "rejected": r[1:]} for p, r in zip(PROMPTS, RESPONSES)]
    args = SimPODisRMConfig(**cpu_args(root / "run", max_steps=1, learning_rate=1e-2, bf16=False))
    trainer = SimPODisRMTrainer(model=base, args=args, train_dataset=Dataset.from_list(rows * 2))
    trainer.train()
    trainer.save_model(str(root / "disrm"))
    return request.param, trainer, str(root / "disrm")


def test_saved_checkpoint_pads_with_a_token_other_than_eos(trained):
    name, _, path = trained
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    assert tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    expected = {"chatml": "<|endoftext|>", "ends_at_eos_pad_is_eos": "<|endoftext|>",
                "llama3": "<|finetune_right_pad_id|>"}  # fmt: skip
    assert tokenizer.pad_token == expected[name]


def stock_scores(path, padding_side):
    """Plain transformers: the conversation rendered by the chat template, batched with padding."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    texts = [tokenizer.apply_chat_template(conversation(p, r), tokenize=False) for p, rs in zip(PROMPTS, RESPONSES)
             for r in rs]  # fmt: skip
    batch = tokenizer(texts, padding=True, padding_side=padding_side, add_special_tokens=False, return_tensors="pt")
    assert len(set(batch["attention_mask"].sum(-1).tolist())) > 1  # mixed lengths: padding is exercised
    with torch.no_grad():
        return model(**batch).logits[:, 0].tolist()


def evaluator_scores(path, shared_prefix, prompts=PROMPTS, responses=RESPONSES):
    judge = DiscriminativeJudge.from_pretrained(path, device="cpu", batch_size=2, shared_prefix=shared_prefix)
    requests = [JudgeRequest(f"x/{i}", p, "task", list(r), ranking=True) for i, (p, r) in
                enumerate(zip(prompts, responses))]  # fmt: skip
    return [s for output in judge.judge(requests) for s in output.scores]


def trainer_scores(trainer, prompts=PROMPTS, responses=RESPONSES):
    """The trainer's own reading: its packed batch of the groups, scored by `sequence_scores`."""
    rows = [{"prompt": p, "chosen": r[0], "rejected": r[1:]} for p, r in zip(prompts, responses)]
    dataset = trainer._prepare_dataset(Dataset.from_list(rows), trainer.processing_class, trainer.args, "eval")
    batch = trainer._prepare_inputs(trainer.data_collator([dataset[i] for i in range(len(dataset))]))
    trainer.model.eval()
    with torch.no_grad():
        scores = trainer.sequence_scores(trainer.model, batch)
    order = sorted(range(len(scores)), key=lambda i: (int(batch["group_index"][i]), int(batch["response_index"][i])))
    return [float(scores[i]) for i in order]


def grpo_scores(path, tmp_path, prompts=PROMPTS, responses=RESPONSES, reward_funcs=()):
    """TRL's GRPO with the DisRM path as `reward_funcs` (its own loading and reward computation), and `reward_funcs`
    beside it: each function's rewards, by TRL's `_calculate_rewards`."""
    from trl import GRPOConfig, GRPOTrainer

    policy = save_tiny_model(tmp_path / "policy", tokenizer=AutoTokenizer.from_pretrained(path))
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[path, *reward_funcs],
        args=GRPOConfig(output_dir=str(tmp_path / "grpo"), use_cpu=True, bf16=False, report_to=[],
                        per_device_train_batch_size=2, num_generations=2, max_completion_length=4),  # fmt: skip
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
    )
    plain = isinstance(prompts[0], str)
    flat = [p for p, rs in zip(prompts, responses) for _ in rs]
    completions = [r if plain else [{"role": "assistant", "content": r}] for rs in responses for r in rs]
    rewards = trainer._calculate_rewards([{"prompt": p} for p in flat], flat, completions, [[0]] * len(flat))
    return rewards.T.tolist()


def test_every_reader_scores_the_same_token(trained, tmp_path):
    _, trainer, path = trained
    reference = stock_scores(path, "right")
    stock_grpo, long_rm_reward, as_trained = grpo_scores(path, tmp_path, reward_funcs=[
        LongRMReward(path, device="cpu"), LongRMReward(path, device="cpu", as_trained=True, name="as_trained")])  # fmt: skip
    readers = {
        "stock, left padding": stock_scores(path, "left"),
        "trainer": trainer_scores(trainer),
        "evaluator, shared prefix": evaluator_scores(path, True),
        "evaluator, padded": evaluator_scores(path, False),
        "GRPO reward model": stock_grpo,
        "LongRMReward in GRPO": long_rm_reward,
        "LongRMReward(as_trained=True) in GRPO": as_trained,
    }
    assert max(reference) - min(reference) > 1e-3  # the scores differ between responses: a wrong token would show
    for name, scores in readers.items():
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(reference), atol=1e-4, rtol=0, msg=name)


PLAIN_PROMPTS = ["Which city has the long river? Answer:", "Name the capital of the country with the red planet book:"]
PLAIN_RESPONSES = [[" " + response for response in responses] for responses in RESPONSES]


@pytest.fixture(scope="module")
def trained_plain(tmp_path_factory):
    """(trainer, saved DisRM directory) of a DisRM trained one step on plain-text rows."""
    root = tmp_path_factory.mktemp("plain")
    base = save_tiny_model(root / "base", task="seq-cls", tokenizer=template_tokenizer("chatml"), seed=3)
    rows = [{"prompt": p, "chosen": r[0], "rejected": r[1:]} for p, r in zip(PLAIN_PROMPTS, PLAIN_RESPONSES)]
    args = SimPODisRMConfig(**cpu_args(root / "run", max_steps=1, learning_rate=1e-2, bf16=False))
    trainer = SimPODisRMTrainer(model=base, args=args, train_dataset=Dataset.from_list(rows * 2))
    trainer.train()
    trainer.save_model(str(root / "disrm"))
    return trainer, str(root / "disrm")


def test_plain_text_grpo_reads_the_token_before_the_trained_eos(trained_plain, tmp_path):
    """Plain-text rows: training, `trl-longrm eval` and `trl-longrm score` read prompt + response + EOS, and so does
    `LongRMReward(as_trained=True)` in GRPO; GRPO's own path (and `LongRMReward`'s default, equal to it) reads the
    decoded completion, which has no EOS: another token, another score."""
    from trl_longrm.data import scoring_ids
    from trl_longrm.evaluation.score import ScoreConfig, score

    trainer, path = trained_plain
    reference = trainer_scores(trainer, PLAIN_PROMPTS, PLAIN_RESPONSES)
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completions": r}) + "\n"
                            for p, r in zip(PLAIN_PROMPTS, PLAIN_RESPONSES)))  # fmt: skip
    scored = score(ScoreConfig(model_path=path, data_path=str(data), output=str(tmp_path / "out.jsonl"), device="cpu"))
    stock_grpo, long_rm_reward, as_trained = grpo_scores(path, tmp_path, PLAIN_PROMPTS, PLAIN_RESPONSES, [
        LongRMReward(path, device="cpu"), LongRMReward(path, device="cpu", as_trained=True, name="as_trained")])  # fmt: skip
    readers = {
        "evaluator, shared prefix": evaluator_scores(path, True, PLAIN_PROMPTS, PLAIN_RESPONSES),
        "evaluator, padded": evaluator_scores(path, False, PLAIN_PROMPTS, PLAIN_RESPONSES),
        "trl-longrm score": [s for row in scored for s in row["scores"]],
        "LongRMReward(as_trained=True) in GRPO": as_trained,
    }
    assert max(reference) - min(reference) > 1e-3
    for name, scores in readers.items():
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(reference), atol=1e-4, rtol=0, msg=name)
    torch.testing.assert_close(torch.tensor(long_rm_reward), torch.tensor(stock_grpo), atol=1e-4, rtol=0)
    assert (torch.tensor(stock_grpo) - torch.tensor(reference)).abs().max() > 1e-3
    # What differs, for this tokenizer (no BOS; completions start at a word boundary): the EOS alone.
    tokenizer = AutoTokenizer.from_pretrained(path)
    for prompt, responses in zip(PLAIN_PROMPTS, PLAIN_RESPONSES):
        grpo_ids = tokenizer([prompt + r for r in responses], add_special_tokens=False)["input_ids"]
        assert scoring_ids(tokenizer, prompt, responses) == [ids + [tokenizer.eos_token_id] for ids in grpo_ids]


def test_pad_choice_prefers_unused_pad_like_tokens_and_refuses_eos():
    from trl_longrm.scoring import ensure_distinct_pad_token
    from trl_longrm.testing_utils import build_tiny_model

    tokenizer = template_tokenizer("llama3")
    assert unused_special_token(tokenizer) == "<|finetune_right_pad_id|>"
    model = build_tiny_model(task="seq-cls", tokenizer=tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    with pytest.raises(ValueError, match="pad_token='<\\|eot_id\\|>' is the EOS token"):
        ensure_distinct_pad_token(tokenizer, model, user_pad_token=tokenizer.eos_token)
    # No unused special token: a new pad token is added and the embeddings grow by one row.
    bare = build_chat_tokenizer()
    bare.chat_template += "{{ '<|endoftext|>' }}"  # the template writes the only candidate
    bare.pad_token = bare.eos_token
    model = build_tiny_model(task="seq-cls", tokenizer=bare)
    rows = model.get_input_embeddings().weight.shape[0]
    assert ensure_distinct_pad_token(bare, model) == "<|pad|>"
    assert model.get_input_embeddings().weight.shape[0] == rows + 1 == len(bare)
    assert model.config.pad_token_id == bare.pad_token_id != bare.eos_token_id
