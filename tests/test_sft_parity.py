"""LongSFTTrainer as a drop-in for TRL's SFTTrainer: each dataset format and config field, ours and stock side by
side on the same data (processed dataset, loss and gradients of the same batch)."""

import dataclasses
import logging

import pytest
import torch
from datasets import Dataset, IterableDataset
from test_trainers_equivalence import assert_same_grads, first_batch, grads_of
from trainer_helpers import cpu_args
from transformers import TrainingArguments
from trl import SFTConfig, SFTTrainer

from trl_longrm import LongSFTConfig, LongSFTTrainer
from trl_longrm.testing_utils import build_tiny_model


WORDS = "the city river number name year color animal planet capital author book price height".split()


def sentence(i, n):
    return " ".join(WORDS[(3 * i + 5 * j) % len(WORDS)] for j in range(n))


def text_rows(n=4):
    return [{"text": sentence(i, 6 + 3 * i)} for i in range(n)]


def model_for(tokenizer):
    return build_tiny_model("qwen3", "causal-lm", tokenizer, seed=1)


def whole_batch_loss_and_grads(trainer):
    """Loss and gradients of one batch holding the whole (small) train dataset."""
    trainer.model.zero_grad()
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, first_batch(trainer))
    loss.backward()
    return loss.detach(), grads_of(trainer.model)


def stock_and_ours(tmp_path, tokenizer, data, stock_overrides=None, ours_overrides=None, **common):
    """The stock trainer (padded batches) and ours (packed padding-free by default) on the same data."""
    common = cpu_args(tmp_path, max_length=common.pop("max_length", 64), **common)
    stock = SFTTrainer(
        model=model_for(tokenizer),
        args=SFTConfig(**common, **(stock_overrides or {})),
        train_dataset=data() if callable(data) else data,
        processing_class=tokenizer,
    )
    ours_args = dict(packing=True, max_tokens_per_row=512, **(ours_overrides or {}))
    ours = LongSFTTrainer(
        model=model_for(tokenizer),
        args=LongSFTConfig(**{**common, **ours_args}),
        train_dataset=data() if callable(data) else data,
        processing_class=tokenizer,
    )
    return stock, ours


def assert_same_step(stock, ours):
    stock_loss, stock_grads = whole_batch_loss_and_grads(stock)
    loss, grads = whole_batch_loss_and_grads(ours)
    torch.testing.assert_close(loss, stock_loss, atol=1e-5, rtol=0)
    assert_same_grads(grads, stock_grads)
    for key in ("mean_token_accuracy", "entropy"):  # logged by the training step, as stock
        assert ours._metrics["train"][key][-1] == pytest.approx(stock._metrics["train"][key][-1], abs=1e-5), key
    return loss


def unpacked_ours(tmp_path, tokenizer, data, **overrides):
    args = LongSFTConfig(**cpu_args(tmp_path, **{"max_length": 64, "padding_free": False, **overrides}))
    return LongSFTTrainer(model=model_for(tokenizer), args=args, train_dataset=data, processing_class=tokenizer)


def trained_masks(dataset):
    """Which tokens of each processed row are trained (its `labels`, stock SFTTrainer's column, are not -100)."""
    return [[int(label != -100) for label in labels] for labels in dataset["labels"]]


# ---------------------------------------------------------------- 1. language modeling (`text`)


def test_text_rows_processed_as_stock(tmp_path, tokenizer):
    data = Dataset.from_list(text_rows())
    stock = SFTTrainer(
        model=model_for(tokenizer),
        args=SFTConfig(**cpu_args(tmp_path, max_length=12)),
        train_dataset=data,
        processing_class=tokenizer,
    )
    ours = unpacked_ours(tmp_path, tokenizer, data, max_length=12)
    assert not ours._stock_path
    assert ours.train_dataset["input_ids"] == stock.train_dataset["input_ids"]  # EOS appended, cut at max_length
    assert ours.train_dataset["labels"] == stock.train_dataset["labels"]
    assert max(len(ids) for ids in ours.train_dataset["input_ids"]) == 12  # max_length enforced


def test_text_rows_train_as_stock_packed(tmp_path, tokenizer):
    stock, ours = stock_and_ours(tmp_path, tokenizer, Dataset.from_list(text_rows()))
    batch = first_batch(ours)
    assert batch["input_ids"].shape[0] == 1 and batch["sequence_lengths"].numel() == 4  # one packed row
    assert_same_step(stock, ours)


def test_text_rows_with_lora_and_gradient_checkpointing_as_stock(tmp_path, tokenizer):
    from peft import LoraConfig

    data = Dataset.from_list(text_rows())
    common = cpu_args(tmp_path, max_length=64, gradient_checkpointing=True)
    lora = dict(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    stock = SFTTrainer(
        model=model_for(tokenizer),
        args=SFTConfig(**common),
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=LoraConfig(**lora),
    )
    ours = LongSFTTrainer(
        model=model_for(tokenizer),
        args=LongSFTConfig(**common, packing=True),
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=LoraConfig(**lora),
    )
    assert not ours._stock_path
    assert_same_step(stock, ours)
    assert all("lora_" in name for name in grads_of(ours.model))


def test_dft_loss_as_stock(tmp_path, tokenizer):
    stock, ours = stock_and_ours(
        tmp_path, tokenizer, Dataset.from_list(text_rows()), loss_type="dft", ours_overrides={"padding_free": True}
    )
    dft = assert_same_step(stock, ours)
    ours.args.loss_type = "nll"
    nll, _ = whole_batch_loss_and_grads(ours)
    assert not torch.allclose(dft, nll)  # the weighting is applied, not ignored


# ---------------------------------------------------------------- 2. pre-tokenized rows


def pretokenized_rows(tokenizer, column):
    rows = []
    for i in range(4):
        prompt = tokenizer(sentence(i, 5 + i), add_special_tokens=False)["input_ids"]
        completion = tokenizer(sentence(i + 7, 3 + i), add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        row = {"input_ids": prompt + completion}
        mask = [0] * len(prompt) + [1] * len(completion)
        if column == "labels":
            row["labels"] = [t if m else -100 for t, m in zip(row["input_ids"], mask)]
        elif column is not None:
            row[column] = mask
        rows.append(row)
    return Dataset.from_list(rows)


@pytest.mark.parametrize(
    "column, completion_only_loss",
    [("labels", None), ("completion_mask", True), ("completion_mask", False), ("assistant_masks", None), (None, None)],
)
def test_pretokenized_rows_as_stock(tmp_path, tokenizer, column, completion_only_loss):
    data = pretokenized_rows(tokenizer, column)
    overrides = dict(max_length=14, completion_only_loss=completion_only_loss)
    stock = SFTTrainer(
        model=model_for(tokenizer),
        args=SFTConfig(**cpu_args(tmp_path, **overrides)),
        train_dataset=data,
        processing_class=tokenizer,
    )
    ours = unpacked_ours(tmp_path, tokenizer, data, **overrides)
    assert ours.train_dataset["input_ids"] == stock.train_dataset["input_ids"]  # truncated to max_length
    assert max(len(ids) for ids in ours.train_dataset["input_ids"]) == 14
    assert ours.train_dataset["labels"] == stock.train_dataset["labels"]
    packed_stock, packed_ours = stock_and_ours(tmp_path, tokenizer, data, **overrides)
    assert_same_step(packed_stock, packed_ours)


def test_completion_mask_trained_by_default(tmp_path, tokenizer):
    """Documented difference: with `completion_only_loss=None` a `completion_mask` column is applied (stock trains
    every token of pre-tokenized rows), which equals stock with `completion_only_loss=True`."""
    data = pretokenized_rows(tokenizer, "completion_mask")
    stock, ours = stock_and_ours(tmp_path, tokenizer, data, stock_overrides={"completion_only_loss": True})
    assert ours.args.completion_only_loss is None
    assert_same_step(stock, ours)


@pytest.mark.parametrize("completion_only_loss", [None, True, False])
def test_prompt_completion_as_stock(tmp_path, tokenizer, completion_only_loss):
    data = Dataset.from_list([{"prompt": sentence(i, 6), "completion": " " + sentence(i + 3, 3)} for i in range(4)])
    stock, ours = stock_and_ours(tmp_path, tokenizer, data, completion_only_loss=completion_only_loss)
    assert_same_step(stock, ours)
    masks = unpacked_ours(tmp_path, tokenizer, data, completion_only_loss=completion_only_loss).train_dataset
    assert all((0 in m) == (completion_only_loss is not False) for m in trained_masks(masks))


@pytest.mark.parametrize("assistant_only_loss", [None, True])
def test_conversational_prompt_completion_as_stock(tmp_path, tokenizer, assistant_only_loss):
    """TRL's conversational prompt/completion rows: stock trains the whole rendering after the prompt (ChatML's newline
    after `<|im_end|>` too); with `assistant_only_loss=True` the completion's assistant turns only."""
    rows = [
        {
            "prompt": [{"role": "user", "content": sentence(i, 5)}],
            "completion": [{"role": "assistant", "content": sentence(i + 1, 3 + i)}],
        }
        for i in range(4)
    ]
    data = Dataset.from_list(rows)
    flags = dict(max_length=256, assistant_only_loss=assistant_only_loss)
    stock = SFTTrainer(
        model=model_for(tokenizer),
        args=SFTConfig(**cpu_args(tmp_path, **{**flags, "assistant_only_loss": bool(assistant_only_loss)})),
        train_dataset=data,
        processing_class=tokenizer,
    )
    ours = unpacked_ours(tmp_path, tokenizer, data, **flags)
    assert ours.train_dataset["input_ids"] == stock.train_dataset["input_ids"]
    assert ours.train_dataset["labels"] == stock.train_dataset["labels"]
    trained = [t for t, label in zip(ours.train_dataset[0]["input_ids"], ours.train_dataset[0]["labels"]) if label != -100]
    assert tokenizer.decode(trained).endswith("<|im_end|>" + ("" if assistant_only_loss else "\n"))
    packed_stock, packed_ours = stock_and_ours(
        tmp_path,
        tokenizer,
        data,
        max_length=256,
        stock_overrides={"assistant_only_loss": bool(assistant_only_loss)},
        ours_overrides={"assistant_only_loss": assistant_only_loss},
    )
    assert_same_step(packed_stock, packed_ours)


def test_packed_dataset_has_stock_seq_lengths(tmp_path, tokenizer):
    """Stock's packed datasets carry `seq_lengths` (each pack's sequence lengths); ours too, for the same sequences
    in packs of at most `max_length` tokens."""
    data = Dataset.from_list(text_rows(8))
    common = cpu_args(tmp_path, max_length=40, packing=True)
    stock = SFTTrainer(
        model=model_for(tokenizer), args=SFTConfig(**common), train_dataset=data, processing_class=tokenizer
    )
    ours = LongSFTTrainer(
        model=model_for(tokenizer), args=LongSFTConfig(**common), train_dataset=data, processing_class=tokenizer
    )
    ours_lengths = ours.train_dataset["seq_lengths"]
    assert ours_lengths == [[len(ids) for ids in pack] for pack in ours.train_dataset["input_ids"]]
    assert all(sum(pack) <= 40 for pack in ours_lengths)
    assert sorted(sum(ours_lengths, [])) == sorted(sum(stock.train_dataset["seq_lengths"], []))
    assert len(ours_lengths) == len(stock.train_dataset["seq_lengths"])


@pytest.mark.parametrize("packing_field", ["packing", "eval_packing"])
def test_packing_without_a_row_size_refused_as_stock(tmp_path, tokenizer, packing_field):
    """`packing=True` with `max_length=None` (and no `max_tokens_per_row`) has no row size: stock SFTTrainer refuses
    it, and so does LongSFTConfig, at once, naming the fields (it must not train unpacked instead)."""
    data = Dataset.from_list(text_rows(4))
    common = cpu_args(tmp_path, max_length=None, **{packing_field: True})
    with pytest.raises(ValueError, match="When packing is enabled, `max_length` can't be `None`"):
        SFTTrainer(
            model=model_for(tokenizer),
            args=SFTConfig(**common),
            train_dataset=data,
            eval_dataset=data,
            processing_class=tokenizer,
        )
    with pytest.raises(ValueError, match=f"{packing_field}=True needs a row size: set max_length .* max_tokens_per_row"):
        LongSFTConfig(**common)
    # A row size from `max_tokens_per_row` alone is enough: the rows are packed to it.
    args = LongSFTConfig(**common, max_tokens_per_row=40)
    ours = LongSFTTrainer(
        model=model_for(tokenizer), args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer
    )
    packed = ours.eval_dataset if packing_field == "eval_packing" else ours.train_dataset
    assert "num_tokens" in packed.column_names and max(packed["num_tokens"]) <= 40


def conversations():
    return Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": sentence(i, 5 + i)},
                    {"role": "assistant", "content": sentence(i + 1, 3)},
                    {"role": "user", "content": sentence(i + 2, 4)},
                    {"role": "assistant", "content": sentence(i + 3, 2 + i)},
                ]
            }
            for i in range(4)
        ]
    )


@pytest.mark.parametrize("ours_setting, stock_setting", [(True, True), (False, False), (None, True)])
def test_conversations_as_stock(tmp_path, tokenizer, ours_setting, stock_setting):
    """`assistant_only_loss=True` / False as stock; None (our default) trains assistant turns, i.e. stock's True."""
    data = conversations()
    stock = SFTTrainer(
        model=model_for(tokenizer),
        args=SFTConfig(**cpu_args(tmp_path, max_length=256, assistant_only_loss=stock_setting)),
        train_dataset=data,
        processing_class=tokenizer,
    )
    # (no row is cut: over `max_length` ours cuts the middle of the prompt, stock the end of the conversation)
    ours = unpacked_ours(tmp_path, tokenizer, data, max_length=256, assistant_only_loss=ours_setting)
    assert ours.train_dataset["input_ids"] == stock.train_dataset["input_ids"]
    assert ours.train_dataset["labels"] == stock.train_dataset["labels"]
    packed_stock, packed_ours = stock_and_ours(
        tmp_path,
        tokenizer,
        data,
        max_length=256,
        stock_overrides={"assistant_only_loss": stock_setting},
        ours_overrides={"assistant_only_loss": ours_setting},
    )
    assert_same_step(packed_stock, packed_ours)


def test_assistant_only_loss_on_longrm_conversations_and_refused_for_text(tmp_path, tokenizer):
    rows = [
        {"chat_template": [{"role": "user", "content": sentence(i, 6)}], "golden": sentence(i + 1, 3)}
        for i in range(4)
    ]
    default = unpacked_ours(tmp_path, tokenizer, Dataset.from_list(rows))
    explicit = unpacked_ours(tmp_path, tokenizer, Dataset.from_list(rows), assistant_only_loss=True)
    assert trained_masks(explicit.train_dataset) == trained_masks(default.train_dataset)
    assert all(0 in m for m in trained_masks(default.train_dataset))
    for setting in ("assistant_only_loss", "completion_only_loss"):  # LongRM rows are a prompt and a completion
        every = unpacked_ours(tmp_path, tokenizer, Dataset.from_list(rows), **{setting: False})
        assert all(set(m) == {1} for m in trained_masks(every.train_dataset)), setting
        assert every.train_dataset["input_ids"] == default.train_dataset["input_ids"]
    for data in (Dataset.from_list(text_rows()), pretokenized_rows(tokenizer, None)):
        with pytest.raises(ValueError, match="assistant_only_loss=True needs conversations"):
            unpacked_ours(tmp_path, tokenizer, data, assistant_only_loss=True)


def test_truncation_mode_refused_for_conversations(tmp_path, tokenizer):
    data = Dataset.from_list([{"prompt": sentence(i, 6), "completion": sentence(i + 3, 3)} for i in range(4)])
    with pytest.raises(ValueError, match="truncation_mode='keep_end'"):
        unpacked_ours(tmp_path, tokenizer, data, truncation_mode="keep_end")


# ---------------------------------------------------------------- 3. what goes through stock SFTTrainer's path


def tool_rows():
    tools = '[{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]'
    return [
        {
            "messages": [
                {"role": "user", "content": sentence(i, 5)},
                {"role": "assistant", "content": sentence(i + 2, 3)},
            ],
            "tools": tools,
        }
        for i in range(4)
    ]


def iterable_text():
    return IterableDataset.from_generator(lambda: iter(text_rows()))


@pytest.mark.parametrize("case", ["formatting_func", "iterable", "tools", "chat_template_kwargs", "data_collator"])
def test_fallback_to_stock_path(tmp_path, tokenizer, caplog, case):
    kwargs = {}
    if case == "formatting_func":
        data = Dataset.from_list([{"question": sentence(i, 5), "answer": sentence(i + 1, 3)} for i in range(4)])
        kwargs["formatting_func"] = lambda row: f"Q: {row['question']} A: {row['answer']}"
    elif case == "iterable":
        data = iterable_text
    elif case == "data_collator":
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        data = Dataset.from_list(text_rows())
        kwargs["data_collator"] = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)
    elif case == "tools":
        data = Dataset.from_list(tool_rows())
    else:
        data = Dataset.from_list(
            [{"messages": r["messages"], "chat_template_kwargs": {"flag": True}} for r in tool_rows()]
        )
    common = cpu_args(tmp_path, max_length=64, max_steps=1)
    stock = SFTTrainer(
        model=model_for(tokenizer),
        args=SFTConfig(**common),
        train_dataset=data() if callable(data) else data,
        processing_class=tokenizer,
        **kwargs,
    )
    with caplog.at_level(logging.WARNING, logger="trl_longrm.trainers.long_sft"):
        ours = LongSFTTrainer(
            model=model_for(tokenizer),
            args=LongSFTConfig(**common),
            train_dataset=data() if callable(data) else data,
            processing_class=tokenizer,
            **kwargs,
        )
    assert ours._stock_path
    lines = [r.getMessage() for r in caplog.records if "stock TRL SFTTrainer" in r.getMessage()]
    assert len(lines) == 1
    assert_same_step(stock, ours)


def test_stock_path_reasons_name_what_our_path_cannot_serve(tmp_path, tokenizer):
    from trl_longrm.trainers.long_sft import stock_path_reasons

    args = LongSFTConfig(**cpu_args(tmp_path))
    plain = Dataset.from_list(tool_rows()).remove_columns("tools")
    assert stock_path_reasons(None, args, plain, None, None, None) == []
    calls = [
        {
            "messages": [
                {"role": "user", "content": "add 1 and 2"},
                {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add"}}]},
            ]
        }
    ]
    assert "tool_calls" in " ".join(stock_path_reasons(None, args, Dataset.from_list(calls), None, None, None))
    reasons = stock_path_reasons(None, args, plain, {"held_out": iterable_text()}, None, None)
    assert len(reasons) == 1 and "eval 'held_out'" in reasons[0] and "IterableDataset" in reasons[0]
    relabelled = Dataset.from_list([{"input_ids": [5, 6, 7], "labels": [-100, 9, 7]}])
    assert "labels" in " ".join(stock_path_reasons(None, args, relabelled, None, None, None))
    # (stock SFTTrainer itself fails on this tiny T5 without decoder inputs; ours routes it there all the same)
    assert "encoder-decoder" in " ".join(stock_path_reasons(t5_model(tokenizer), args, plain, None, None, None))
    scaled = build_tiny_model("qwen3", "causal-lm", tokenizer, seed=1, logit_scale=0.5)  # as Cohere's
    assert "logit_scale" in " ".join(stock_path_reasons(scaled, args, plain, None, None, None))
    args.label_smoothing_factor = 0.1
    assert "label_smoothing_factor" in " ".join(stock_path_reasons(None, args, plain, None, None, None))


def test_fallback_cases_refused_with_sequence_parallelism(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="sequence_parallel_size=2.*formatting_func"):
        LongSFTTrainer(
            model=model_for(tokenizer),
            args=LongSFTConfig(**cpu_args(tmp_path, sequence_parallel_size=2)),
            train_dataset=Dataset.from_list(text_rows()),
            processing_class=tokenizer,
            formatting_func=lambda row: row["text"],
        )


def test_plain_training_arguments(tmp_path, tokenizer):
    args = TrainingArguments(**cpu_args(tmp_path, learning_rate=3e-4, max_steps=1))
    ours = LongSFTTrainer(
        model=model_for(tokenizer), args=args, train_dataset=Dataset.from_list(text_rows()), processing_class=tokenizer
    )
    assert isinstance(ours.args, LongSFTConfig) and ours.args.learning_rate == 3e-4 and ours.args.max_steps == 1
    ours.train()
    assert ours.state.global_step == 1


# ---------------------------------------------------------------- 4. evaluation and metrics


def test_evaluate_predict_and_metrics_as_stock(tmp_path, tokenizer):
    data = Dataset.from_list(text_rows())
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction.predictions.shape)
        return {"seen": 1.0}

    common = cpu_args(tmp_path, max_length=64, per_device_eval_batch_size=4)
    stock = SFTTrainer(
        model=model_for(tokenizer),
        args=SFTConfig(**common),
        train_dataset=data,
        eval_dataset=data,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    ours = LongSFTTrainer(
        model=model_for(tokenizer),
        args=LongSFTConfig(**common),
        train_dataset=data,
        eval_dataset=data,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    stock_metrics, metrics = stock.evaluate(), ours.evaluate()
    for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy"):
        assert metrics[key] == pytest.approx(stock_metrics[key], abs=1e-5), key
    assert metrics["eval_seen"] == 1.0 and len(seen) == 2
    prediction, stock_prediction = ours.predict(ours.eval_dataset), stock.predict(stock.eval_dataset)
    assert prediction.predictions.shape[-1] == stock_prediction.predictions.shape[-1]  # logits over the vocabulary
    assert prediction.metrics["test_loss"] == pytest.approx(stock_prediction.metrics["test_loss"], abs=1e-5)
    # A raw dataset given to `evaluate()` is prepared as at construction; one our path cannot serve is refused.
    held_out = Dataset.from_list(text_rows(3))
    assert ours.evaluate(held_out)["eval_loss"] == pytest.approx(stock.evaluate(held_out)["eval_loss"], abs=1e-5)
    with pytest.raises(ValueError, match="column\\(s\\) \\['tools'\\]"):
        ours.evaluate(Dataset.from_list(tool_rows()))
    # `metric_for_best_model` reads the logged accuracy
    ours.args.metric_for_best_model = "eval_mean_token_accuracy"
    assert "eval_mean_token_accuracy" in ours.evaluate()


# ---------------------------------------------------------------- 5. every field SFTConfig adds, classified

# field -> the test above (or the reason) that shows it honoured as stock
HONOURED = {
    "max_length": "test_text_rows_processed_as_stock, test_pretokenized_rows_as_stock",
    "packing": "test_text_rows_train_as_stock_packed",
    "padding_free": "test_text_rows_train_as_stock_packed (layout only; same loss)",
    "completion_only_loss": "test_pretokenized_rows_as_stock, test_prompt_completion_as_stock",
    "loss_type": "test_dft_loss_as_stock",
    "dataset_text_field": "read by stock preparation, which ours calls for text rows",
    "truncation_mode": "text/pre-tokenized: as stock; conversations: test_truncation_mode_refused_for_conversations",
    "packing_strategy": "'bfd' ours; others go through stock SFTTrainer's path",
    "dataset_kwargs": "skip_prepare_dataset goes through stock SFTTrainer's path",
    "router_aux_loss_coef": "a Mixture-of-Experts router loss goes through stock SFTTrainer's path",
    "model_init_kwargs": "stock SFTTrainer.__init__ (ours calls it)",
    "trust_remote_code": "stock SFTTrainer.__init__",
    "chat_template_path": "stock SFTTrainer.__init__ sets the template before ours tokenises",
    "eos_token": "stock SFTTrainer.__init__ sets the tokenizer's EOS before ours tokenises",
    "pad_token": "stock SFTTrainer.__init__ sets the tokenizer's pad token, which our collator reads",
    "dataset_num_proc": "passed to tokenisation",
    "shuffle_dataset": "the prepared dataset is shuffled",
    "pad_to_multiple_of": "passed to our collator",
    "eval_packing": "stock SFTTrainer.__init__ passes it to `_prepare_dataset`",
    "assistant_only_loss": "test_conversations_as_stock",
    "activation_offloading": "SFTTrainer.training_step enters our offload context (tests/test_activation_offload.py)",
}
REFUSED: dict[str, object] = {}  # field -> a non-default value that raises an error naming the field


def test_every_sft_config_field_is_classified(tmp_path, tokenizer):
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    added = {f.name for f in dataclasses.fields(SFTConfig)} - base
    unclassified = added - HONOURED.keys() - REFUSED.keys()
    assert not unclassified, f"SFTConfig fields neither honoured nor refused by LongSFTTrainer: {unclassified}"
    assert not (HONOURED.keys() | REFUSED.keys()) - added  # no stale entry
    cited = {word.strip(",()") for how in HONOURED.values() for word in how.split() if word.startswith("test_")}
    assert cited and all(callable(globals().get(name)) for name in cited), cited - set(globals())
    for name, value in REFUSED.items():
        with pytest.raises(ValueError, match=name):
            unpacked_ours(tmp_path, tokenizer, Dataset.from_list(text_rows()), **{name: value})


@pytest.mark.parametrize("rows", ["text", "pretokenized"])
def test_evaluate_takes_a_raw_stream_as_a_dataset(tmp_path, tokenizer, rows):
    """A `text` or pre-tokenized stream given to `evaluate()` (as TRL's evaluate prepares what it is given) scores as
    the same rows as a `Dataset`: stock preparation, then our `max_length` cut, applied as rows are read."""
    data = Dataset.from_list(text_rows()) if rows == "text" else pretokenized_rows(tokenizer, "completion_mask")
    args = LongSFTConfig(**cpu_args(tmp_path, max_length=12, per_device_eval_batch_size=8, eval_packing=False))
    ours = LongSFTTrainer(model=model_for(tokenizer), args=args, train_dataset=data, processing_class=tokenizer)
    assert not ours._stock_path
    mapped = ours.evaluate(eval_dataset=data)
    streamed = ours.evaluate(eval_dataset=data.to_iterable_dataset())
    assert streamed["eval_loss"] == pytest.approx(mapped["eval_loss"], rel=1e-6)
    assert streamed["eval_mean_token_accuracy"] == pytest.approx(mapped["eval_mean_token_accuracy"], rel=1e-6)


# ---------------------------------------------------------------- architectures our packed path cannot run


def sliding_window_model(tokenizer):
    return build_tiny_model(
        "qwen3",
        "causal-lm",
        tokenizer,
        seed=1,
        use_sliding_window=True,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )


def moe_model(tokenizer):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        router_aux_loss_coef=0.5,
        output_router_logits=True,
    )
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config)


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
    )
    torch.manual_seed(1)
    return AutoModelForSeq2SeqLM.from_config(config)


def prompt_tuning():
    from peft import PromptTuningConfig

    return {"peft_config": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)}


@pytest.mark.parametrize(
    "build, extra, reason",
    [
        (sliding_window_model, dict, "sliding"),
        (moe_model, dict, "Mixture-of-Experts"),
        (model_for, prompt_tuning, "PromptTuningConfig"),
    ],
)
def test_architecture_fallback_to_stock_path(tmp_path, tokenizer, caplog, build, extra, reason):
    data = Dataset.from_list(text_rows())
    common = cpu_args(tmp_path, max_length=64)
    stock = SFTTrainer(
        model=build(tokenizer), args=SFTConfig(**common), train_dataset=data, processing_class=tokenizer, **extra()
    )
    with caplog.at_level(logging.WARNING, logger="trl_longrm.trainers.long_sft"):
        ours = LongSFTTrainer(
            model=build(tokenizer),
            args=LongSFTConfig(**common),
            train_dataset=data,
            processing_class=tokenizer,
            **extra(),
        )
    assert ours._stock_path and reason in caplog.text
    assert_same_step(stock, ours)
    with pytest.raises(ValueError, match=f"sequence_parallel_size=2.*{reason}"):
        LongSFTTrainer(
            model=build(tokenizer),
            args=LongSFTConfig(**cpu_args(tmp_path, sequence_parallel_size=2)),
            train_dataset=data,
            processing_class=tokenizer,
            **extra(),
        )


@pytest.mark.parametrize("case", ["sliding_window_model_path", "peft_prompt_tuning_model"])
def test_architecture_fallback_for_a_model_path_or_peft_model(tmp_path, tokenizer, caplog, case):
    """As TRL's tests pass them: a model path (checked as SFTTrainer will load it, before loading) and a PEFT model
    with virtual tokens take the stock path, and give the stock step."""
    data = Dataset.from_list(text_rows())
    common = cpu_args(tmp_path, max_length=64)
    if case == "sliding_window_model_path":
        path = tmp_path / "sliding"
        sliding_window_model(tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path)

        def make():
            return str(path)

        reason = "sliding"
    else:
        from peft import PromptTuningConfig, get_peft_model

        def make():
            return get_peft_model(model_for(tokenizer), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))

        reason = "virtual tokens"
    stock = SFTTrainer(model=make(), args=SFTConfig(**common), train_dataset=data, processing_class=tokenizer)
    with caplog.at_level(logging.WARNING, logger="trl_longrm.trainers.long_sft"):
        ours = LongSFTTrainer(model=make(), args=LongSFTConfig(**common), train_dataset=data, processing_class=tokenizer)
    assert ours._stock_path and reason in caplog.text
    assert_same_step(stock, ours)


def test_qwen3_multi_turn_masked_with_training_template(tmp_path, caplog):
    """Qwen3's template drops past reasoning, so a conversation's rendering is not a prefix of its continuation; as
    stock SFTTrainer with `assistant_only_loss=True`, TRL's training template masks the assistant turns."""
    from pathlib import Path

    import trl

    from trl_longrm.testing_utils import build_chat_tokenizer

    qwen3 = build_chat_tokenizer()
    qwen3.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    data = conversations()
    stock = SFTTrainer(
        model=model_for(qwen3),
        args=SFTConfig(**cpu_args(tmp_path, max_length=256, assistant_only_loss=True)),
        train_dataset=data,
        processing_class=qwen3,
    )
    with caplog.at_level(logging.WARNING, logger="trl_longrm.trainers.long_sft"):
        ours = unpacked_ours(tmp_path, qwen3, data, max_length=256)
    assert "prefix-stable" in caplog.text
    assert ours.train_dataset["input_ids"] == stock.train_dataset["input_ids"]
    assert ours.train_dataset["labels"] == stock.train_dataset["labels"]

    # Conversational prompt/completion rows (a completion of several turns) with `assistant_only_loss=True`: as
    # stock, masked with the training template, and trained on the completion's assistant turns only.
    rows = [
        {
            "prompt": [{"role": "user", "content": sentence(i, 5)}],
            "completion": [
                {"role": "assistant", "content": sentence(i + 1, 3)},
                {"role": "user", "content": sentence(i + 2, 4)},
                {"role": "assistant", "content": sentence(i + 3, 2)},
            ],
        }
        for i in range(3)
    ]
    flags = dict(max_length=256, assistant_only_loss=True, completion_only_loss=True)
    stock = SFTTrainer(
        model=model_for(qwen3),
        args=SFTConfig(**cpu_args(tmp_path, **flags)),
        train_dataset=Dataset.from_list(rows),
        processing_class=qwen3,
    )
    ours = unpacked_ours(tmp_path, qwen3, Dataset.from_list(rows), **flags)
    assert ours.train_dataset["input_ids"] == stock.train_dataset["input_ids"]
    assert ours.train_dataset["labels"] == stock.train_dataset["labels"]
    user_turn = qwen3(sentence(2, 4), add_special_tokens=False)["input_ids"]
    trained = [t for t, label in zip(ours.train_dataset[0]["input_ids"], ours.train_dataset[0]["labels"]) if label != -100]
    assert not set(user_turn) <= set(trained)  # the user turn inside the completion is not trained
