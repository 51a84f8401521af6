"""Our trainers against stock TRL, padded against packed, and multi-reject losses against a hand reference."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from trainer_helpers import cpu_args, random_groups
from trl import RewardConfig, RewardTrainer
from trl.experimental.cpo import CPOConfig, CPOTrainer

from trl_longrm import (
    LongSFTConfig,
    LongSFTTrainer,
    SimPODisRMConfig,
    SimPODisRMTrainer,
    SimPOGRMConfig,
    SimPOGRMTrainer,
)
from trl_longrm.data import DataFormatError
from trl_longrm.testing_utils import build_tiny_model


def first_batch(trainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_and_grads(trainer):
    trainer.model.zero_grad()
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, first_batch(trainer))
    loss.backward()
    return loss.detach(), grads_of(trainer.model)


def assert_same_grads(a, b, atol=1e-5):
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-4, msg=name)


# ---------------------------------------------------------------- stock TRL equivalence (k = 1, padded)


@pytest.mark.parametrize(
    "padding_free, cpo",
    [
        (False, dict(loss_type="simpo", cpo_alpha=0.0)),
        (True, dict(loss_type="simpo", cpo_alpha=0.0)),
        (True, dict(loss_type="sigmoid", cpo_alpha=0.0)),
        (True, dict(loss_type="hinge", cpo_alpha=0.0)),
        (True, dict(loss_type="ipo", cpo_alpha=0.0)),
        (True, dict(loss_type="simpo", cpo_alpha=0.0, alpha=0.25)),  # AlphaPO rewards
        (True, dict(loss_type="alphapo", alpha=0.25)),
        (True, dict(loss_type="sigmoid", cpo_alpha=1.0, label_smoothing=0.1)),  # TRL's CPO defaults: NLL weight 1
        (True, dict(loss_type="simpo", cpo_alpha=0.3)),
    ],
)
def test_grm_matches_stock_cpo(tmp_path, tokenizer, padding_free, cpo):
    words = "the city river number name year color animal planet capital".split()
    rows = [
        {
            "prompt": " ".join(words[(i + j) % 10] for j in range(12 + i)),
            "chosen": " ".join(words[(3 * i + j) % 10] for j in range(3 + i)),
            "rejected": " ".join(words[(5 * i + j) % 10] for j in range(6 - i)),
        }
        for i in range(4)
    ]
    model = build_tiny_model("llama", "causal-lm", tokenizer, seed=1)
    common = cpu_args(tmp_path, max_length=256, beta=2.0, simpo_gamma=0.3)
    stock = CPOTrainer(
        model=model,
        args=CPOConfig(**cpo, **common),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    stock_batch = first_batch(stock)
    stock_loss, stock_metrics = stock.get_batch_loss_metrics(stock.model, stock_batch)

    # The same token ids as the stock trainer's processed rows, as our tokenised groups.
    groups = []
    for row in stock.train_dataset:
        n = len(row["prompt_input_ids"])
        groups.append(
            {
                "prompt_ids": row["prompt_input_ids"],
                "chosen_completion_ids": row["chosen_input_ids"][n:],
                "rejected_completion_ids": [row["rejected_input_ids"][n:]],
            }
        )
    # The same fields as for the stock config, only the class changes (TRL's names: cpo_alpha, not nll_loss_weight).
    ours = SimPOGRMTrainer(
        model=model,
        args=SimPOGRMConfig(padding_free=padding_free, **cpo, **common),
        train_dataset=Dataset.from_list(groups),
        processing_class=tokenizer,
    )
    assert ours.args.nll_loss_weight == stock.args.cpo_alpha and ours.args.loss_type == stock.args.loss_type
    loss, metrics = ours.get_batch_loss_metrics(ours.model, first_batch(ours))
    torch.testing.assert_close(loss, stock_loss, atol=1e-5, rtol=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert metrics[key] == pytest.approx(stock_metrics[key], abs=1e-5, rel=1e-5), key
    # Our processed dataset has CPOTrainer's columns, and CPOTrainer's processed dataset is read as processed.
    assert ours.train_dataset.column_names == ["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"]
    for name in ours.train_dataset.column_names:
        assert ours.train_dataset[name] == stock.train_dataset[name], name
    again = SimPOGRMTrainer(
        model=model,
        args=SimPOGRMConfig(padding_free=padding_free, **cpo, **common),
        train_dataset=stock.train_dataset,
        processing_class=tokenizer,
    )
    torch.testing.assert_close(again.get_batch_loss_metrics(again.model, first_batch(again))[0], stock_loss)


@pytest.mark.parametrize("padding_free, stock_format", [(False, False), (True, False), (True, True)])
def test_disrm_matches_stock_reward_trainer(tmp_path, tokenizer, padding_free, stock_format):
    groups = random_groups(tokenizer, 4, 1, seed=2)
    stock_rows = [
        {
            "chosen_ids": g["prompt_ids"] + g["chosen_completion_ids"],
            "rejected_ids": g["prompt_ids"] + g["rejected_completion_ids"][0],
            "margin": 0.1 * i,
        }
        for i, g in enumerate(groups)
    ]
    model = build_tiny_model("qwen3", "seq-cls", tokenizer, seed=1)
    common = cpu_args(tmp_path, center_rewards_coefficient=0.01)
    stock = RewardTrainer(
        model=model,
        args=RewardConfig(**common),
        train_dataset=Dataset.from_list(stock_rows),
        processing_class=tokenizer,
    )
    stock_loss, stock_grads = loss_and_grads(stock)
    # Our tokenised groups, or (stock_format) the very rows the stock trainer got: pre-tokenised chosen_ids/rejected_ids.
    ours = SimPODisRMTrainer(
        model=model,
        args=SimPODisRMConfig(padding_free=padding_free, **common),
        train_dataset=Dataset.from_list(stock_rows) if stock_format else groups.add_column("margin", [0.1 * i for i in range(4)]),
        processing_class=tokenizer,
    )
    loss, grads = loss_and_grads(ours)
    torch.testing.assert_close(loss, stock_loss, atol=1e-5, rtol=0)
    assert_same_grads(grads, stock_grads)


# ---------------------------------------------------------------- packed == padded


def sft_examples(tokenizer, n, seed=0):
    groups = random_groups(tokenizer, n, 1, seed=seed)
    return Dataset.from_list(
        [
            {
                "input_ids": g["prompt_ids"] + g["chosen_completion_ids"],
                "completion_mask": [0] * len(g["prompt_ids"]) + [1] * len(g["chosen_completion_ids"]),
            }
            for g in groups
        ]
    )


def build_trainer(kind, tmp_path, tokenizer, padding_free, num_rejected, **overrides):
    common = cpu_args(tmp_path, padding_free=padding_free, **overrides)
    if kind == "grm":
        model = build_tiny_model("llama", "causal-lm", tokenizer, seed=3)
        data = random_groups(tokenizer, 4, num_rejected, seed=4)
        return SimPOGRMTrainer(
            model=model, args=SimPOGRMConfig(**common), train_dataset=data, processing_class=tokenizer
        )
    if kind == "disrm":
        model = build_tiny_model("qwen3", "seq-cls", tokenizer, seed=3)
        data = random_groups(tokenizer, 4, num_rejected, seed=4)
        return SimPODisRMTrainer(
            model=model, args=SimPODisRMConfig(**common), train_dataset=data, processing_class=tokenizer
        )
    model = build_tiny_model("qwen3", "causal-lm", tokenizer, seed=3)
    return LongSFTTrainer(
        model=model, args=LongSFTConfig(**common), train_dataset=sft_examples(tokenizer, 4), processing_class=tokenizer
    )


@pytest.mark.parametrize("kind", ["grm", "disrm", "sft"])
@pytest.mark.parametrize("num_rejected", [1, 3])
def test_packed_equals_padded(tmp_path, tokenizer, kind, num_rejected):
    if kind == "sft" and num_rejected > 1:
        pytest.skip("SFT has no rejected responses")
    padded_loss, padded_grads = loss_and_grads(build_trainer(kind, tmp_path, tokenizer, False, num_rejected))
    packed = build_trainer(kind, tmp_path, tokenizer, True, num_rejected)
    batch = first_batch(packed)
    assert batch["input_ids"].shape[0] == 1 and batch["sequence_lengths"].numel() >= 4  # several groups per row
    packed_loss, packed_grads = loss_and_grads(packed)
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-5, rtol=0)
    assert_same_grads(packed_grads, padded_grads)


# ---------------------------------------------------------------- multi-reject losses by hand


def reference_mean_logps(model, prompt, completion):
    """Length-normalised log-prob of `completion` after `prompt`, from one stock forward with full logits."""
    ids = torch.tensor([prompt + completion])
    logps = F.log_softmax(model(ids, use_cache=False).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    token_logps = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)[len(prompt) - 1 :]
    return token_logps.mean(), token_logps.sum(), token_logps.numel()


def test_grm_multi_reject_matches_hand_reference(tmp_path, tokenizer):
    beta, gamma, nll_weight = 2.5, 0.5, 0.05
    trainer = build_trainer("grm", tmp_path, tokenizer, True, (2, 4), beta=beta, simpo_gamma=gamma)
    trainer.args.nll_loss_weight = nll_weight
    model = trainer.model
    losses, nll_sum, nll_count = [], 0.0, 0
    for group in trainer.train_dataset:
        chosen, chosen_sum, chosen_n = reference_mean_logps(model, group["prompt_ids"], group["chosen_completion_ids"])
        rejected = [reference_mean_logps(model, group["prompt_ids"], r)[0] for r in group["rejected_completion_ids"]]
        z = beta * (chosen - torch.stack(rejected).mean()) - gamma
        losses.append(-F.logsigmoid(z))
        nll_sum, nll_count = nll_sum - chosen_sum, nll_count + chosen_n
    expected = torch.stack(losses).mean() + nll_weight * nll_sum / nll_count
    loss, _ = trainer.get_batch_loss_metrics(model, first_batch(trainer))
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("aggregation", ["mean", "pairwise"])
def test_disrm_multi_reject_matches_hand_reference(tmp_path, tokenizer, aggregation):
    trainer = build_trainer("disrm", tmp_path, tokenizer, True, (2, 4), gamma=0.3, reject_aggregation=aggregation)
    model = trainer.model

    def score(prompt, completion):
        return model(torch.tensor([prompt + completion]), use_cache=False).logits[0, 0]

    losses = []
    for group in trainer.train_dataset:
        chosen = score(group["prompt_ids"], group["chosen_completion_ids"])
        rejected = torch.stack([score(group["prompt_ids"], r) for r in group["rejected_completion_ids"]])
        if aggregation == "mean":
            losses.append(-F.logsigmoid(chosen - rejected.mean() - 0.3))
        else:
            losses.append((-F.logsigmoid(chosen - rejected - 0.3)).mean())
    loss = trainer.compute_loss(model, first_batch(trainer))
    torch.testing.assert_close(loss, torch.stack(losses).mean(), atol=1e-5, rtol=0)


def test_sft_loss_matches_hand_reference(tmp_path, tokenizer):
    trainer = build_trainer("sft", tmp_path, tokenizer, True, 1)
    total, count = 0.0, 0
    for example in trainer.train_dataset:
        prompt_len = next(i for i, label in enumerate(example["labels"]) if label != -100)
        ids = example["input_ids"]
        _, s, n = reference_mean_logps(trainer.model, ids[:prompt_len], ids[prompt_len:])
        total, count = total - s, count + n
    loss = trainer.compute_loss(trainer.model, first_batch(trainer))
    torch.testing.assert_close(loss, total / count, atol=1e-5, rtol=0)


def test_nll_weight_has_one_value_under_either_name(tmp_path):
    common = cpu_args(tmp_path)
    assert SimPOGRMConfig(**common).nll_loss_weight == 0.05  # LongRM's default when neither name is set
    assert SimPOGRMConfig(cpo_alpha=0.0, **common).nll_loss_weight == 0.0  # TRL's pure SimPO is honoured
    assert SimPOGRMConfig(nll_loss_weight=0.2, **common).cpo_alpha == 0.2
    with pytest.raises(ValueError, match="nll_loss_weight=0.2 and cpo_alpha=0.0"):
        SimPOGRMConfig(nll_loss_weight=0.2, cpo_alpha=0.0, **common)
    with pytest.raises(ValueError, match="alphapo"):
        SimPOGRMConfig(loss_type="alphapo", nll_loss_weight=0.1, **common)


def test_pre_tokenized_sequences_become_groups(caplog):
    """RewardTrainer's pre-tokenised rows: those over max_length are dropped and counted (as RewardTrainer does), the
    rest are kept as they are and read as groups split at the sequences' longest common prefix."""
    from trl_longrm.data.stock_columns import group_of
    from trl_longrm.trainers.common import _drop_sequences_over

    rows = Dataset.from_list(
        [
            {"chosen_ids": [1, 2, 3, 4], "rejected_ids": [1, 2, 5], "margin": 0.5},
            {"chosen_ids": [7, 8], "rejected_ids": [7, 8, 9], "margin": None},  # chosen is a prefix of rejected
            {"chosen_ids": list(range(10)), "rejected_ids": [1], "margin": 1.0},  # over max_length: dropped
        ]
    )
    with caplog.at_level("WARNING"):
        kept = _drop_sequences_over(rows, max_length=6, dataset_name="train")
    assert kept.to_list() == rows.to_list()[:2]
    groups = [group_of(row) for row in kept]
    assert [(g["prompt_ids"], g["chosen_completion_ids"], g["rejected_completion_ids"]) for g in groups] == [
        ([1, 2], [3, 4], [[5]]),
        ([7], [8], [[8, 9]]),
    ]
    assert groups[0]["margin"] == 0.5 and "margin" not in groups[1]
    assert "dropped 1 of 3" in caplog.text
    with pytest.raises(ValueError, match="every row is longer than max_length=1"):
        _drop_sequences_over(rows, max_length=1, dataset_name="train")


def test_legacy_pre_tokenized_columns_are_read_as_stock(tmp_path, tokenizer):
    """RewardTrainer's deprecated `chosen_input_ids` / `rejected_input_ids` are renamed with its FutureWarning, and
    both trainers' processed datasets have the same `chosen_ids` / `rejected_ids`."""
    rows = [{"chosen_input_ids": [5, 6, 7, 2], "rejected_input_ids": [5, 6, 8, 9, 2]}] * 2
    model = build_tiny_model("llama", "seq-cls", tokenizer, seed=1)
    trainers = {}
    for name, trainer_cls, config_cls in [
        ("stock", RewardTrainer, RewardConfig),
        ("ours", SimPODisRMTrainer, SimPODisRMConfig),
    ]:
        with pytest.warns(FutureWarning, match="will not be supported in v1"):
            trainers[name] = trainer_cls(
                model=model,
                args=config_cls(**cpu_args(tmp_path)),
                train_dataset=Dataset.from_list(rows),
                processing_class=tokenizer,
            )
    stock, ours = trainers["stock"].train_dataset, trainers["ours"].train_dataset
    assert "chosen_input_ids" not in ours.column_names
    assert ours["chosen_ids"] == stock["chosen_ids"] == [[5, 6, 7, 2]] * 2
    assert ours["rejected_ids"] == stock["rejected_ids"]


# Every field TRL's CPOConfig / RewardConfig add over TrainingArguments, as our configs treat it: honoured (as stock,
# tests above and in test_trainers_training.py) or refused by name when set away from its default. A field a future
# TRL adds fails this test until it is classified.
CPO_FIELDS = {
    "honoured": {
        "max_length", "beta", "label_smoothing", "loss_type", "disable_dropout", "cpo_alpha", "simpo_gamma", "alpha",
        "model_init_kwargs", "trust_remote_code", "dataset_num_proc",
        "is_encoder_decoder",  # stock CPOTrainer's path (test_grm_models_our_lm_head_cannot_serve_train_as_stock)
    },
    "refused": {"max_completion_length": 64, "generate_during_eval": True},
}
REWARD_FIELDS = {
    "honoured": {
        "model_init_kwargs", "trust_remote_code", "chat_template_path", "disable_dropout", "dataset_num_proc",
        "eos_token", "max_length", "pad_to_multiple_of", "center_rewards_coefficient", "activation_offloading",
        "pad_token",
    },
    "refused": {},
}


@pytest.mark.parametrize(
    "stock, ours, classified",
    [(CPOConfig, SimPOGRMConfig, CPO_FIELDS), (RewardConfig, SimPODisRMConfig, REWARD_FIELDS)],
)
def test_every_stock_config_field_is_honoured_or_refused(tmp_path, stock, ours, classified):
    import dataclasses

    from transformers import TrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    added = {f.name for f in dataclasses.fields(stock)} - base
    assert added == classified["honoured"] | set(classified["refused"]), "classify TRL's new config fields"
    for name, value in classified["refused"].items():
        with pytest.raises(ValueError, match=f"`{name}"):
            ours(**cpu_args(tmp_path), **{name: value})


def test_reward_tokenizer_fields_are_applied_as_stock(tmp_path, tokenizer):
    """`chat_template_path` and `eos_token` change the sequences exactly as they change RewardTrainer's."""
    tokenizer = copy.deepcopy(tokenizer)  # both trainers set the template and EOS on it: keep the session's intact
    template = tmp_path / "template.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>{{ m['content'] }}<|im_end|>"
        "{% else %}[{{ m['role'] }}] {{ m['content'] }}<|im_end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>{% endif %}"
    )
    rows = [
        {
            "prompt": [{"role": "user", "content": f"question {i} about the river"}],
            "chosen": [{"role": "assistant", "content": f"the answer is {i}"}],
            "rejected": [{"role": "assistant", "content": "no idea"}],
        }
        for i in range(3)
    ]
    common = cpu_args(tmp_path, chat_template_path=str(template), eos_token="<|im_end|>", max_length=512)
    model = build_tiny_model("qwen3", "seq-cls", tokenizer, seed=1)
    stock = RewardTrainer(
        model=model, args=RewardConfig(**common), train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    ours = SimPODisRMTrainer(
        model=model,
        args=SimPODisRMConfig(**common),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    # RewardTrainer's processed columns, token for token.
    assert ours.train_dataset.column_names == ["chosen_ids", "rejected_ids"]
    assert ours.train_dataset["chosen_ids"] == stock.train_dataset["chosen_ids"]
    assert ours.train_dataset["rejected_ids"] == stock.train_dataset["rejected_ids"]
    assert ours.processing_class.decode(ours.train_dataset[0]["chosen_ids"]).startswith("[user] question 0")


TOOLS_TEMPLATE = (
    "{% if tools %}[tools] {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<|im_end|>{% endif %}"
    "{% if terse %}[terse]<|im_end|>{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>{{ m['content'] }}<|im_end|>"
    "{% else %}[{{ m['role'] }}] {{ m['content'] }}<|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>{% endif %}"
)


def tool_preference_rows():
    """Conversational preference rows with TRL's per-row `tools` (JSON text) and `chat_template_kwargs`."""
    tool = '[{"type": "function", "function": {"name": "lookup_%d", "parameters": {"type": "object"}}}]'
    return [
        {
            "prompt": [{"role": "user", "content": f"question {i} about the river"}],
            "chosen": [{"role": "assistant", "content": f"the answer is {i}"}],
            "rejected": [{"role": "assistant", "content": "no idea"}],
            "tools": tool % i if i != 1 else "[]",
            "chat_template_kwargs": {"terse": i % 2 == 0},
        }
        for i in range(3)
    ]


TOOL_CALL_TEMPLATE = (
    "{% if tools %}[tools] {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<|im_end|>{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}call {{ c['function']['name'] }}"
    "({{ c['function']['arguments']['minutes'] }}){% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool_call_rows():
    """TRL's tool-call preference rows: completions of several messages (a call without content, the tool's answer,
    the reply); one row's rejected response is a plain answer, and one row has no tool call at all."""
    tools = '[{"type": "function", "function": {"name": "start_timer", "parameters": {"type": "object"}}}]'

    def call(minutes, answer, reply):
        return [
            {"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "start_timer", "arguments": {"minutes": minutes}}}]},
            {"role": "tool", "content": answer, "tool_calls": None},
            {"role": "assistant", "content": reply, "tool_calls": None},
        ]

    return [
        {
            "prompt": [{"role": "user", "content": "set a timer for 10 minutes"}],
            "chosen": call(10, "600", "Timer set for 10 minutes."),
            "rejected": call(1, "60", "Timer set for 1 minute."),
            "tools": tools,
        },
        {
            "prompt": [{"role": "user", "content": "set a timer for 3 minutes"}],
            "chosen": call(3, "180", "Done, 3 minutes."),
            "rejected": [{"role": "assistant", "content": "I cannot set timers.", "tool_calls": None}],
            "tools": tools,
        },
        {
            "prompt": [{"role": "user", "content": "what is a timer"}],
            "chosen": [{"role": "assistant", "content": "A clock that counts down.", "tool_calls": None}],
            "rejected": [{"role": "assistant", "content": "A fruit.", "tool_calls": None}],
            "tools": tools,
        },
    ]


def test_tool_call_completions_tokenised_as_stock(tmp_path, tokenizer):
    """Completions of several messages with tool calls (TRL's tool-call format) are rendered whole with the row's
    tools, as RewardTrainer renders them: the same `chosen_ids` / `rejected_ids`, and the same first-batch loss."""
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = TOOL_CALL_TEMPLATE
    data = Dataset.from_list(tool_call_rows())
    common = cpu_args(tmp_path, eos_token="<|im_end|>", max_length=512)
    model = build_tiny_model("qwen3", "seq-cls", templated, seed=1)
    stock = RewardTrainer(model=model, args=RewardConfig(**common), train_dataset=data, processing_class=templated)
    ours = SimPODisRMTrainer(
        model=model,
        args=SimPODisRMConfig(**common, shared_prefix=False),
        train_dataset=data,
        processing_class=templated,
    )
    assert ours.train_dataset["chosen_ids"] == stock.train_dataset["chosen_ids"]
    assert ours.train_dataset["rejected_ids"] == stock.train_dataset["rejected_ids"]
    assert templated.decode(ours.train_dataset[0]["chosen_ids"]).endswith(
        "assistant\ncall start_timer(10)<|im_end|><|im_start|>tool\n600<|im_end|>"
        "<|im_start|>assistant\nTimer set for 10 minutes.<|im_end|>"
    )
    loss_stock, _ = loss_and_grads(stock)
    loss_ours, _ = loss_and_grads(ours)
    torch.testing.assert_close(loss_ours, loss_stock, atol=1e-5, rtol=1e-5)

    # The records: only the rows with such completions keep their messages (as JSON); a plain prompt cannot have them.
    from trl_longrm.data import load_preference_dataset

    records = load_preference_dataset(data)
    assert records["completion_messages"] == [True, True, False]
    assert json.loads(records[1]["rejected"][0]) == [{"role": "assistant", "content": "I cannot set timers."}]
    assert records[2]["chosen"] == "A clock that counts down."
    plain = [{**row, "prompt": "set a timer", "tools": None} for row in tool_call_rows()[:1]]
    with pytest.raises(DataFormatError, match="row 0, key 'prompt': a completion of several messages"):
        load_preference_dataset(plain)


@pytest.mark.parametrize("tools_as", ["json", "structured"])
def test_preference_rows_with_tools_and_template_kwargs_tokenised_as_stock(tmp_path, tokenizer, tools_as):
    """Each row's `tools` and `chat_template_kwargs` reach the chat template as in RewardTrainer (and, for
    `chat_template_kwargs`, as in CPOTrainer, which does not read `tools`). `tools` as JSON text, or as a list of
    dicts made by `Dataset.map` from it as TRL's `test_train_toolcall_data_as_json` makes them (Arrow then fills the
    keys one row lacks with None)."""
    import copy
    import json

    templated = copy.deepcopy(tokenizer)
    templated.chat_template = TOOLS_TEMPLATE
    rows = tool_preference_rows()
    if tools_as == "structured":
        rows[0]["tools"] = rows[0]["tools"].replace('"type": "object"', '"type": "object", "required": ["q"]')
        structured = Dataset.from_list(rows).map(lambda row: {"tools": json.loads(row["tools"])})
        assert structured[2]["tools"][0]["function"]["parameters"]["required"] is None  # filled by Arrow
        rows = structured.to_list()
    common = cpu_args(tmp_path, eos_token="<|im_end|>", max_length=512)
    model = build_tiny_model("qwen3", "seq-cls", templated, seed=1)
    stock = RewardTrainer(
        model=model, args=RewardConfig(**common), train_dataset=Dataset.from_list(rows), processing_class=templated
    )
    ours = SimPODisRMTrainer(
        model=model, args=SimPODisRMConfig(**common), train_dataset=Dataset.from_list(rows), processing_class=templated
    )
    assert ours.train_dataset["chosen_ids"] == stock.train_dataset["chosen_ids"]
    assert ours.train_dataset["rejected_ids"] == stock.train_dataset["rejected_ids"]
    prompts = [templated.decode(row["chosen_ids"]) for row in ours.train_dataset]
    assert prompts[0].startswith("[tools] lookup_0 <|im_end|>[terse]<|im_end|>[user] question 0")
    assert prompts[1].startswith("[user] question 1")  # no tools, terse=False: nothing added
    assert prompts[2].startswith("[tools] lookup_2 <|im_end|>[terse]")

    # CPOTrainer passes a row's `chat_template_kwargs` (not its `tools`) to the template: ours gives the same prompts.
    cpo_rows = [{k: v for k, v in row.items() if k != "tools"} for row in rows]
    causal = build_tiny_model("llama", "causal-lm", templated, seed=1)
    cpo_args = cpu_args(tmp_path, max_length=512)
    stock_cpo = CPOTrainer(
        model=causal, args=CPOConfig(**cpo_args), train_dataset=Dataset.from_list(cpo_rows), processing_class=templated
    )
    ours_grm = SimPOGRMTrainer(
        model=causal,
        args=SimPOGRMConfig(**cpo_args),
        train_dataset=Dataset.from_list(cpo_rows),
        processing_class=templated,
    )
    for s, o in zip(stock_cpo.train_dataset, ours_grm.train_dataset):
        assert templated.decode(o["prompt_input_ids"]) == s["prompt"]
        assert o["prompt_input_ids"] == s["prompt_input_ids"]
        assert o["chosen_input_ids"][: len(s["prompt_input_ids"])] == s["prompt_input_ids"]
    assert [templated.decode(o["prompt_input_ids"]).startswith("[terse]") for o in ours_grm.train_dataset] == [
        True,
        False,
        True,
    ]


def streamable_preference_rows():
    """Conversational rows with 1-2 rejected responses; row 2's prompt is too long for max_length=64 and row 4's
    responses alone are (dropped under truncate_prompt), so streaming must cut one and drop the other."""
    words = "the city river number name year color animal planet capital".split()
    rows = []
    for i in range(8):
        length = 120 if i == 2 else 6 + i
        rows.append(
            {
                "prompt": [{"role": "user", "content": " ".join(words[(i + j) % 10] for j in range(length))}],
                "chosen": [{"role": "assistant", "content": " ".join(words[(3 * i + j) % 10] for j in range(3))}],
                "rejected": [
                    [{"role": "assistant", "content": " ".join(words[(5 * i + j + r) % 10] for j in range(2 + r))}]
                    for r in range(1 + i % 2)
                ],
            }
        )
    rows[4]["chosen"] = [{"role": "assistant", "content": " ".join(words * 8)}]
    return rows


def sequences_of(row):
    """The whole token sequences (prompt + response) of a processed row, in any of its layouts."""
    from trl_longrm.data.stock_columns import group_of

    group = group_of(row)
    return [group["prompt_ids"] + c for c in [group["chosen_completion_ids"], *group["rejected_completion_ids"]]]


def test_disrm_streamed_dataset_trains_as_map_style(tmp_path, tokenizer, caplog):
    """A streaming IterableDataset is tokenised as it is read, with the same groups, cuts and drops as the map-style
    dataset: the first batch gives the same loss and gradients, and dropped/truncated rows are logged."""
    import logging

    rows = streamable_preference_rows()
    # A stream is read in order (the Trainer does not shuffle an IterableDataset): so is the map-style dataset here.
    common = cpu_args(
        tmp_path,
        max_length=64,
        truncation="truncate_prompt",
        max_steps=2,
        learning_rate=1e-3,
        train_sampling_strategy="sequential",
    )
    model = build_tiny_model("llama", "seq-cls", tokenizer, seed=1)
    mapped = SimPODisRMTrainer(
        model=model,
        args=SimPODisRMConfig(**common),
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    with caplog.at_level(logging.INFO, logger="trl_longrm.data.streaming"):
        streamed = SimPODisRMTrainer(
            model=copy.deepcopy(model),
            args=SimPODisRMConfig(**common),
            train_dataset=Dataset.from_list(rows).to_iterable_dataset(),
            eval_dataset=Dataset.from_list(rows).to_iterable_dataset(),
            processing_class=tokenizer,
        )
        # Row 4 dropped, row 2 cut. A stream has no schema: its one-rejected groups come in RewardTrainer's columns,
        # where the map-style dataset, whose groups have 1 or 2 rejected responses, keeps ours for all.
        assert [sequences_of(r) for r in streamed.train_dataset] == [sequences_of(r) for r in mapped.train_dataset]
        assert len(mapped.train_dataset) == 7
        assert "chosen_ids" in next(iter(streamed.train_dataset))  # row 0: one rejected response
        assert [sequences_of(r) for r in streamed.train_dataset] == [sequences_of(r) for r in mapped.train_dataset]
        messages = [r.getMessage() for r in caplog.records if r.name == "trl_longrm.data.streaming"]
    assert messages == [
        "train dataset: streamed row 2 truncated (middle of the prompt's longest message cut); so far 3 rows read, 0 "
        "dropped, 1 truncated.",
        "train dataset: streamed row 4 dropped (responses alone fill max_length (only the prompt is ever cut)); so far "
        "5 rows read, 1 dropped, 1 truncated.",
    ]

    loss_m, grads_m = loss_and_grads(mapped)
    loss_s, grads_s = loss_and_grads(streamed)
    torch.testing.assert_close(loss_s, loss_m, atol=1e-6, rtol=1e-6)
    assert_same_grads(grads_s, grads_m)
    assert streamed.evaluate()["eval_loss"] == pytest.approx(mapped.evaluate()["eval_loss"], rel=1e-6)
    before = {n: p.detach().clone() for n, p in streamed.model.named_parameters()}
    streamed.train()
    assert streamed.state.global_step == 2
    assert any(not torch.equal(before[n], p) for n, p in streamed.model.named_parameters())


def test_disrm_evaluate_takes_a_raw_stream(tmp_path, tokenizer):
    """`evaluate(eval_dataset=stream)` (RewardTrainer prepares what `evaluate` is given) scores every group of the
    stream: accelerate's one-process batch dispatch must not cut a padding-free batch to its first sequence."""
    rows = [r for i, r in enumerate(streamable_preference_rows()) if i not in (2, 4)]  # nothing cut or dropped
    trainer = SimPODisRMTrainer(
        model=build_tiny_model("llama", "seq-cls", tokenizer, seed=1),
        args=SimPODisRMConfig(**cpu_args(tmp_path, per_device_eval_batch_size=8)),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    mapped = trainer.evaluate(eval_dataset=Dataset.from_list(rows))
    streamed = trainer.evaluate(eval_dataset=Dataset.from_list(rows).to_iterable_dataset())
    assert streamed["eval_loss"] == pytest.approx(mapped["eval_loss"], rel=1e-6)
    assert streamed["eval_margin"] == pytest.approx(mapped["eval_margin"], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("case", ["packing", "grm"])
def test_streams_we_cannot_serve_are_refused_by_name(tmp_path, tokenizer, case):
    data = Dataset.from_list(streamable_preference_rows()).to_iterable_dataset()
    if case == "grm":
        model = build_tiny_model("llama", "causal-lm", tokenizer, seed=1)
        with pytest.raises(ValueError, match="train dataset: SimPOGRMTrainer, like CPOTrainer, needs a map-style"):
            SimPOGRMTrainer(
                model=model, args=SimPOGRMConfig(**cpu_args(tmp_path)), train_dataset=data, processing_class=tokenizer
            )
        return
    model = build_tiny_model("llama", "seq-cls", tokenizer, seed=1)
    args = SimPODisRMConfig(**cpu_args(tmp_path, max_tokens_per_row=256))
    with pytest.raises(ValueError, match="`max_tokens_per_row=256` bins"):
        SimPODisRMTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)


def test_disrm_pre_tokenized_stream_as_map_style(tmp_path, tokenizer, caplog):
    """RewardTrainer's pre-tokenised rows streamed: a row over max_length is dropped (and logged) as in the map-style
    dataset, and the rest score as they do there."""
    rows = [
        {"chosen_ids": [5, 6, 7, 9, 2], "rejected_ids": [5, 6, 8, 2]},
        {"chosen_ids": list(range(5, 40)), "rejected_ids": [5, 6, 2]},  # over max_length=16: dropped
        {"chosen_ids": [11, 12, 13, 2], "rejected_ids": [11, 14, 15, 16, 2]},
    ]
    model = build_tiny_model("llama", "seq-cls", tokenizer, seed=1)
    args = SimPODisRMConfig(**cpu_args(tmp_path, max_length=16, max_steps=1))
    mapped = SimPODisRMTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    with caplog.at_level("WARNING"):
        streamed = SimPODisRMTrainer(
            model=copy.deepcopy(model),
            args=args,
            train_dataset=Dataset.from_list(rows).to_iterable_dataset(),
            processing_class=tokenizer,
        )
        assert list(streamed.train_dataset) == mapped.train_dataset.to_list() == [rows[0], rows[2]]
    assert "dropped streamed pre-tokenised row 1, longer than max_length=16" in caplog.text
    loss_m, grads_m = loss_and_grads(mapped)
    loss_s, grads_s = loss_and_grads(streamed)
    torch.testing.assert_close(loss_s, loss_m, atol=1e-6, rtol=1e-6)
    assert_same_grads(grads_s, grads_m)


# ---------------------------------------------------------------- models our packed path cannot serve


def sliding_window_model(tokenizer, task):
    return build_tiny_model(
        "qwen3",
        task,
        tokenizer,
        seed=1,
        use_sliding_window=True,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )


def t5_model(tokenizer):
    from transformers import AutoModelForSeq2SeqLM, T5Config

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_ff=64,
        d_kv=16,
        num_layers=1,
        num_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        dropout_rate=0.0,  # deterministic steps to compare
    )
    torch.manual_seed(1)
    return AutoModelForSeq2SeqLM.from_config(config)


def text_preference_rows():
    words = "the city river number name year color animal planet capital".split()
    return [
        {
            "prompt": " ".join(words[(i + j) % 10] for j in range(12 + i)),
            "chosen": " ".join(words[(3 * i + j) % 10] for j in range(3 + i)),
            "rejected": " ".join(words[(5 * i + j) % 10] for j in range(6 - i)),
        }
        for i in range(4)
    ]


@pytest.mark.parametrize("given_as", ["instance", "path"])
@pytest.mark.parametrize("kind", ["disrm", "grm"])
def test_models_with_attention_the_ring_cannot_run_train_padded(tmp_path, tokenizer, caplog, kind, given_as):
    """A sliding-window model (given as an instance, or as a path as TRL's tests give it) trains on padded batches
    with its own attention, said in one logged line: the same loss and gradients as the stock trainer."""
    task = "seq-cls" if kind == "disrm" else "causal-lm"
    model = sliding_window_model(tokenizer, task)
    path = tmp_path / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    data = Dataset.from_list(text_preference_rows())
    common = cpu_args(tmp_path, max_length=256)
    if kind == "grm":  # the same loss as CPOTrainer's defaults aside
        common.update(loss_type="simpo", beta=2.0, simpo_gamma=0.3, cpo_alpha=0.3)
    stock_cls, stock_config, ours_cls, ours_config = (
        (RewardTrainer, RewardConfig, SimPODisRMTrainer, SimPODisRMConfig)
        if kind == "disrm"
        else (CPOTrainer, CPOConfig, SimPOGRMTrainer, SimPOGRMConfig)
    )
    stock = stock_cls(
        model=copy.deepcopy(model), args=stock_config(**common), train_dataset=data, processing_class=tokenizer
    )
    with caplog.at_level("WARNING"):
        ours = ours_cls(
            model=copy.deepcopy(model) if given_as == "instance" else str(path),
            args=ours_config(**common),
            # GRM: CPOTrainer's processed rows (its tokenisation of text rows adds no EOS where ours does).
            train_dataset=data if kind == "disrm" else stock.train_dataset,
            processing_class=tokenizer,
        )
    assert "trains on padded batches" in caplog.text and "sliding_attention" in caplog.text
    assert ours.args.padding_free is False and ours.args.shared_prefix is False
    if kind == "disrm":
        (stock_loss, stock_grads), (loss, grads) = loss_and_grads(stock), loss_and_grads(ours)
        torch.testing.assert_close(loss, stock_loss, atol=1e-5, rtol=1e-5)
        assert_same_grads(grads, stock_grads)
    else:
        stock_loss, _ = stock.get_batch_loss_metrics(stock.model, first_batch(stock))
        loss, _ = ours.get_batch_loss_metrics(ours.model, first_batch(ours))
        torch.testing.assert_close(loss, stock_loss, atol=1e-5, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="sequence_parallel_size=2 needs the ring attention"):
        ours_cls(
            model=copy.deepcopy(model),
            args=ours_config(**cpu_args(tmp_path, sequence_parallel_size=2)),
            train_dataset=data,
            processing_class=tokenizer,
        )


def test_grm_moe_router_loss_added_as_stock(tmp_path, tokenizer, caplog):
    """A Mixture-of-Experts model whose config asks for the router loss: stock CPOTrainer adds
    `router_aux_loss_coef * aux_loss`; ours trains it through that path (logged), so the loss is stock's, router
    term included (it differs from the loss without it)."""
    from test_sft_parity import moe_model

    data = Dataset.from_list(text_preference_rows())
    common = cpu_args(tmp_path, max_length=256, beta=0.1, cpo_alpha=1.0, loss_type="simpo", simpo_gamma=0.5)
    common["train_sampling_strategy"] = "sequential"
    stock = CPOTrainer(
        model=moe_model(tokenizer), args=CPOConfig(**common), train_dataset=data, processing_class=tokenizer
    )
    with caplog.at_level("WARNING"):
        ours = SimPOGRMTrainer(
            model=moe_model(tokenizer), args=SimPOGRMConfig(**common), train_dataset=data, processing_class=tokenizer
        )
    assert "stock TRL CPOTrainer's path" in caplog.text and "router loss" in caplog.text
    stock_loss, stock_metrics = stock.get_batch_loss_metrics(stock.model, first_batch(stock))
    loss, metrics = ours.get_batch_loss_metrics(ours.model, first_batch(ours))
    torch.testing.assert_close(loss, stock_loss)
    assert metrics == stock_metrics
    stock.aux_loss_enabled = False  # not vacuous: the router term is part of that loss
    without_router, _ = stock.get_batch_loss_metrics(stock.model, first_batch(stock))
    assert abs(without_router.item() - stock_loss.item()) > 1e-4
    # A router loss switched off (coefficient 0) is no reason to leave our path.
    model = moe_model(tokenizer)
    model.config.router_aux_loss_coef = 0.0
    ours = SimPOGRMTrainer(model=model, args=SimPOGRMConfig(**common), train_dataset=data, processing_class=tokenizer)
    assert not ours._stock_path


def test_grm_models_our_lm_head_cannot_serve_train_as_stock(tmp_path, tokenizer, caplog):
    """An encoder-decoder (TRL's CPO tests use T5) trains through stock CPOTrainer's whole path, said in one logged
    line, with the stock loss; LongRM rows, which that path cannot read, and sequence parallelism are errors."""
    data = Dataset.from_list(text_preference_rows())
    common = cpu_args(tmp_path, max_length=256, beta=0.1, cpo_alpha=1.0, loss_type="simpo", simpo_gamma=0.5)
    common["train_sampling_strategy"] = "sequential"  # the same first batch for both
    stock = CPOTrainer(
        model=t5_model(tokenizer), args=CPOConfig(**common), train_dataset=data, processing_class=tokenizer
    )
    with caplog.at_level("WARNING"):
        ours = SimPOGRMTrainer(
            model=t5_model(tokenizer), args=SimPOGRMConfig(**common), train_dataset=data, processing_class=tokenizer
        )
    assert "stock TRL CPOTrainer's path" in caplog.text and "encoder-decoder" in caplog.text
    assert ours.train_dataset.column_names == stock.train_dataset.column_names
    stock_loss, stock_metrics = stock.get_batch_loss_metrics(stock.model, first_batch(stock))
    loss, metrics = ours.get_batch_loss_metrics(ours.model, first_batch(ours))
    torch.testing.assert_close(loss, stock_loss)
    assert metrics == stock_metrics
    longrm = Dataset.from_list(
        [{"chat_template": [{"role": "user", "content": "q"}], "chosen": "a", "rejects": ["b", "c"]}]
    )
    with pytest.raises(ValueError, match="LongRM's `chat_template` / `rejects` rows need our path"):
        SimPOGRMTrainer(model=t5_model(tokenizer), args=SimPOGRMConfig(**common), train_dataset=longrm, processing_class=tokenizer)
    with pytest.raises(NotImplementedError, match="sequence_parallel_size=2 needs SimPOGRMTrainer's sparse LM head"):
        SimPOGRMTrainer(
            model=t5_model(tokenizer),
            args=SimPOGRMConfig(**cpu_args(tmp_path, sequence_parallel_size=2)),
            train_dataset=data,
            processing_class=tokenizer,
        )
