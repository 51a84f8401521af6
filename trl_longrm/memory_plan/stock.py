"""Stock TRL's trainers traced the same way as ours (`trace_step(..., stock=True)`), for the side-by-side plans of
`bench/memory_plan.py`: what a user who keeps `RewardTrainer`, `CPOTrainer` or `SFTTrainer` needs on the same model,
the same group and the same training arguments.

Stock has neither shared prefixes nor several rejected responses per row nor sequence parallelism: a group of a prompt
and `1 + k` responses is `k` pairs (chosen, rejected_i), each a padded batch of two sequences of the whole prompt and a
response (SFT: one example), and every process holds whole rows (`sequence_parallel_size` 1, all ranks data
parallel). Its training arguments are TRL's defaults for the stage plus the user's `TrainingArguments` fields
(precision, gradient checkpointing and transformers' checkpoint offload, batch sizes, optimizer, ...) and TRL's
`activation_offloading` where the stock config has it (RewardConfig, SFTConfig), with the lengths set so that the group
is admitted whole. Our `mlp_tile_tokens`, shared prefixes, sparse heads and sequence parallelism are not stock's.
"""

from __future__ import annotations

import dataclasses

from transformers import TrainingArguments


# stage -> (module, trainer class, config class) of the stock TRL trainer our stage's trainer extends.
STOCK_TRAINERS = {
    "simpo_disrm": ("trl", "RewardTrainer", "RewardConfig"),
    "simpo_grm": ("trl.experimental.cpo", "CPOTrainer", "CPOConfig"),
    "sft": ("trl", "SFTTrainer", "SFTConfig"),
}

# Characters that the test tokenizer (`trl_longrm.testing_utils.build_chat_tokenizer`, byte-level BPE) reads as one
# token each, so that a text of n of them is n tokens: stock CPOTrainer tokenizes text itself.
ONE_TOKEN_CHARACTER = "~"


def stock_classes(stage: str):
    """`(trainer class, config class)` of the stock TRL trainer of `stage`."""
    import importlib

    module, trainer, config = STOCK_TRAINERS[stage]
    module = importlib.import_module(module)
    return getattr(module, trainer), getattr(module, config)


def stock_args(stage: str, training_args, shape, **overrides):
    """The stock config of `stage`: TRL's defaults, the user's `TrainingArguments` fields from `training_args`, and
    lengths that admit the group of `shape` whole."""
    _, config_cls = stock_classes(stage)
    # A stock config given as it is (e.g. `bench/gpu_plan_vs_measured.py` planning a stock run) keeps all its fields;
    # from one of ours, only the `TrainingArguments` fields carry over.
    source = config_cls if type(training_args) is config_cls else TrainingArguments
    fields = {f.name for f in dataclasses.fields(source) if f.init}
    values = {name: getattr(training_args, name) for name in fields if hasattr(training_args, name)}
    longest = shape.prompt_tokens + shape.response_tokens
    values["max_length"] = longest
    if stage == "simpo_grm":
        values["max_completion_length"] = shape.response_tokens
        values["loss_type"] = getattr(training_args, "loss_type", "sigmoid")
    for name in ("activation_offloading",):
        if name in {f.name for f in dataclasses.fields(config_cls)} and hasattr(training_args, name):
            values[name] = getattr(training_args, name)
    values.update(overrides)
    return config_cls(**values)


def stock_dataset(stage: str, shape, num_groups: int, vocab_size: int, eos_token_id: int):
    """`num_groups` groups of `shape` as stock's rows: `num_rejected` pairs per group, tokenized as the stock trainer
    accepts them (RewardTrainer: `chosen_ids`/`rejected_ids`; CPOTrainer tokenizes text itself: a text of n one-token
    characters). SFT examples are the same for stock as for ours (`trace.synthetic_dataset`)."""
    from datasets import Dataset

    if stage == "sft":
        raise ValueError("stock SFTTrainer takes the same examples as ours: use trace.synthetic_dataset")

    def ids(n, offset):
        return [3 + (offset + i) % max(vocab_size - 3, 1) for i in range(n)]

    # As in real preference data, the rejected response is not as long as the chosen one (here one token shorter), so
    # the pair is padded and stock's attention takes a mask: a CUDA run converts it to an additive `queries x keys`
    # tensor (`cuda_paths`), a cost of stock's padded layout that equal lengths would hide.
    rows = []
    for g in range(num_groups):
        for _ in range(max(shape.num_rejected, 1)):
            if stage == "simpo_grm":
                # CPOTrainer appends EOS to each response.
                rows.append(
                    {
                        "prompt": ONE_TOKEN_CHARACTER * shape.prompt_tokens,
                        "chosen": ONE_TOKEN_CHARACTER * (shape.response_tokens - 1),
                        "rejected": ONE_TOKEN_CHARACTER * (shape.response_tokens - 2),
                    }
                )
                continue
            prompt = ids(shape.prompt_tokens, g)
            response = ids(shape.response_tokens - 1, g + 7) + [eos_token_id]
            rows.append({"chosen_ids": prompt + response, "rejected_ids": prompt + response[1:]})
    return Dataset.from_list(rows)
