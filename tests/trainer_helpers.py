"""Shared builders for the trainer tests: tokenised preference groups and configs that run on CPU."""

import random

from datasets import Dataset


def cpu_args(output_dir, **overrides):
    """Arguments every TRL config needs on this CPU-only machine, plus quiet, deterministic defaults."""
    args = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to=[],
        gradient_checkpointing=False,
        per_device_train_batch_size=4,
        disable_tqdm=True,
        save_strategy="no",
        dataloader_drop_last=False,
        seed=0,
    )
    args.update(overrides)
    return args


def random_groups(tokenizer, num_groups, num_rejected, seed=0, prompt_len=(8, 24), completion_len=(2, 9)):
    """Tokenised preference groups of random ordinary tokens, each completion ending with EOS."""
    rng = random.Random(seed)
    specials = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in specials]

    def ids(lo_hi):
        return [rng.choice(vocab) for _ in range(rng.randint(*lo_hi))]

    groups = []
    for _ in range(num_groups):
        k = num_rejected if isinstance(num_rejected, int) else rng.randint(*num_rejected)
        groups.append(
            {
                "prompt_ids": ids(prompt_len),
                "chosen_completion_ids": ids(completion_len) + [tokenizer.eos_token_id],
                "rejected_completion_ids": [ids(completion_len) + [tokenizer.eos_token_id] for _ in range(k)],
            }
        )
    return Dataset.from_list(groups)


def learnable_groups(tokenizer, num_groups, num_rejected, seed=0):
    """Groups whose chosen completion is always the same short judgment and whose rejected ones are random:
    a pattern a tiny model learns in a few steps."""
    groups = random_groups(tokenizer, num_groups, num_rejected, seed=seed).to_list()
    verdict = tokenizer("[[A]] [Score: 9]", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for group in groups:
        group["chosen_completion_ids"] = verdict
    return Dataset.from_list(groups)
