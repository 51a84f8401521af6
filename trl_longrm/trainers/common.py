"""What the three LongRM trainers share: config fields for long-context data, dataset preparation, and the sparse
forward passes (per-token log-probs, last-token scores) that the losses read."""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass, field

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase
from trl.data_utils import get_dataset_column_names

from trl_longrm.data.stock_columns import (
    CPO_COLUMNS,
    GROUP_COLUMNS,
    REWARD_COLUMNS,
    group_of,
    is_group_row,
    with_stock_columns,
)
from trl_longrm.memory.partial_checkpointing import UNCHECKED_KEY, enable_partial_checkpointing
from trl_longrm.memory.selective_checkpointing import SELECTIVE_KEY, enable_selective_checkpointing
from trl_longrm.sequence_parallel.kernels import FlashAttnVarlenOps, is_flash_attn_available


logger = logging.getLogger(__name__)


@dataclass
class LongContextDataArguments:
    """Fields shared by `SimPOGRMConfig`, `SimPODisRMConfig` and `LongSFTConfig` (they mix this class in)."""

    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Lay every sequence of a micro-batch end to end in one row with `position_ids` restarting per "
            "sequence, computing no padding (default True). False gives a padded batch with an attention mask."
        },
    )
    max_tokens_per_row: int | None = field(
        default=None,
        metadata={
            "help": "If set, bin whole preference groups (chosen and all rejected together) or SFT examples into "
            "packed rows of at most this many tokens before training; each packed row is then one dataset example, "
            "so use `per_device_train_batch_size=1`. Default None: a micro-batch is `per_device_train_batch_size` "
            "groups."
        },
    )
    truncation: str = field(
        default="truncate_prompt",
        metadata={
            "help": "What to do with a row longer than `max_length`: 'truncate_prompt' cuts the middle of the "
            "prompt's longest message (keeping its head and tail, as LongRM does at 128K), 'drop' drops the row. "
            "Counts are logged either way. Default 'truncate_prompt'.",
            "choices": ["truncate_prompt", "drop"],
        },
    )
    prompt_key: str | None = field(
        default=None,
        metadata={"help": "Column of the prompt (messages or text). Default None: detected from the data format."},
    )
    chosen_key: str | None = field(
        default=None,
        metadata={"help": "Column of the chosen response. Default None: detected from the data format."},
    )
    rejected_key: str | None = field(
        default=None,
        metadata={
            "help": "Column of the rejected response(s), one or a list (LongRM's `rejects`). Default None: detected."
        },
    )
    mlp_tile_tokens: int | None = field(
        default=None,
        metadata={
            "help": "If set, each decoder layer's MLP and RMSNorms run over slices of at most this many of a rank's "
            "tokens, each recomputed in backward (`trl_longrm.memory.tiled_mlp`, ALST's TiledMLP): the MLP's intermediate "
            "activations (3 x intermediate_size per token) and the norms' float32 copies of the hidden states are "
            "then held for one slice at a time instead of the whole row, for one more MLP forward per step; the same "
            "gradients. Worth it when a rank holds tens of thousands of "
            "tokens (say 8192 for rows past 64K per rank). Default None (off)."
        },
    )
    fused_lora: bool = field(
        default=False,
        metadata={
            "help": "Compute the model's PEFT LoRA layers with fewer, larger kernels (`trl_longrm.fused_lora`): the "
            "scaling folded into B and the adapter added into the base layer's output by the matmul itself, the "
            "down-projections of layers that read the same input (q/k/v, gate/up) as one matmul. The same function "
            "of the same parameters (PEFT's adapters and checkpoints); layers it cannot serve (LoRA variants such as "
            "DoRA, dropout, quantized base layers) keep PEFT's forward, logged. Needs LoRA layers. Default False."
        },
    )
    logprob_chunk_elements: int = field(
        default=2**26,
        metadata={
            "help": "Most logits the sparse LM head holds at once (tokens x vocabulary) when computing per-token "
            "log-probs; chunks are recomputed in backward. Default 2**26 (256 MB in fp32)."
        },
    )


@dataclass
class RejectedCountArguments:
    """The number of rejected responses a preference trainer uses per group (`SimPOGRMConfig` and `SimPODisRMConfig`
    mix this class in)."""

    num_rejected: int | None = field(
        default=None,
        metadata={
            "help": "Rejected responses used per group: the first `num_rejected` of each row's list, as LongRM's trainer "
            "takes its first `num_rejects` (V in the paper's equation 1; the paper trains with V = 2). Voted rows list "
            "the judgments that disagree with the consensus first (`trl-longrm data vote`), so the first ones are the "
            "real disagreements. A row with fewer keeps all of its own. Default None: every rejected response."
        },
    )


def check_num_rejected(args) -> None:
    """Refuse a `num_rejected` below 1, naming the field (called by the configs)."""
    if args.num_rejected is not None and (isinstance(args.num_rejected, bool) or args.num_rejected < 1):
        raise ValueError(f"`num_rejected` must be None (all) or >= 1, got {args.num_rejected!r}.")


def cut_rejected(dataset, num_rejected: int | None, dataset_name: str):
    """Pre-tokenised groups (`rejected_completion_ids`, a list per group) cut to their first `num_rejected` rejected
    responses; text rows are cut as they are read (`load_preference_dataset(num_rejected=...)`). A dataset packed
    already (its groups laid out in rows) is kept where no group has more (one prepared with these settings, passed
    again), and refused otherwise, naming the field."""
    if num_rejected is None or "rejected_completion_ids" not in dataset.column_names:
        return dataset
    if _is_packed(dataset, "prompt_ids"):
        most = max((len(group) for pack in dataset["rejected_completion_ids"] for group in pack), default=0)
        if most > num_rejected:
            raise ValueError(
                f"{dataset_name} dataset: `num_rejected={num_rejected}` cannot cut the groups of a dataset that is "
                f"packed already (a group has {most} rejected responses); pass the unpacked groups, or unset "
                "`num_rejected`."
            )
        return dataset
    return dataset.map(
        lambda ids: {"rejected_completion_ids": [group[:num_rejected] for group in ids]},
        input_columns="rejected_completion_ids",
        batched=True,
        desc=f"Keeping the first {num_rejected} rejected responses",
    )


SHARED_PREFIX_HELP = (
    "Lay each preference group out as its prompt once followed by each response (the responses' position ids "
    "continuing from the prompt's length, each attending to the whole prompt and causally to itself, never to another "
    "response) instead of k + 1 sequences that each repeat the prompt. The log-probs, scores, losses and gradients "
    "equal those of the unshared layout; the prompt's tokens and its attention are computed once. Needs "
    "`padding_free=True` (without it the unshared padded layout is used). Attended in two calls merged by their "
    "log-sum-exp (each piece causally, then each prompt's responses against the prompt's keys, passed once): "
    "PyTorch's fused CPU attention on CPU, the varlen kernel (flash-attn or torch's varlen_attn) on CUDA. "
    "`max_tokens_per_row` then counts the prompt once. Default {default}."
)


def uses_shared_prefix(args) -> bool:
    """Whether the trainer lays groups out with shared prefixes (`shared_prefix` and `padding_free` both set)."""
    return bool(getattr(args, "shared_prefix", False)) and bool(args.padding_free)


def check_shared_prefix_args(args) -> None:
    """Refuse combinations `shared_prefix` cannot honour, naming the fields (called by the configs)."""
    if getattr(args, "shared_prefix", False) and not args.padding_free:
        logger.info("shared_prefix=True needs padding_free=True: groups use the unshared padded layout.")
    if (
        uses_shared_prefix(args)
        and getattr(args, "ring_attn_backend", "auto") == "flash_attn"
        and is_flash_attn_available()
        and FlashAttnVarlenOps.load() is None
    ):
        raise ValueError(
            "shared_prefix=True with ring_attn_backend='flash_attn' needs flash-attn's varlen backward "
            "(flash_attn_interface._flash_attn_varlen_backward taking out and softmax_lse), which this flash-attn "
            "lacks: set shared_prefix=False, or ring_attn_backend='auto' (the pure PyTorch kernel for such rows)."
        )


def keep_heads_under_liger(args, trainer_name: str) -> None:
    """With `use_liger_kernel=True`, `Trainer.train()` applies Liger's kernels to the model, and Liger's fused linear
    cross-entropy (on unless `liger_kernel_config` turns it off) replaces the model's `forward`: that would remove
    our sparse LM head or last-token score head, leaving the full `[L, vocab]` logits (an out-of-memory error at long
    rows) or an error. As TRL's SFTTrainer does for its fused LM head, only Liger's layer kernels (RMSNorm, RoPE,
    SwiGLU, ...) are applied then; asking for the fused cross-entropy is an error naming the field."""
    if not args.use_liger_kernel:
        return
    liger_kernel_config = dict(args.liger_kernel_config or {})
    if liger_kernel_config.get("fused_linear_cross_entropy"):
        raise ValueError(
            f'{trainer_name}: `liger_kernel_config={{"fused_linear_cross_entropy": True}}` with `use_liger_kernel=True` '
            "is not supported: Liger's fused linear cross-entropy replaces the model's forward, which this trainer "
            "patches with its sparse head (it computes only the logits or scores the loss reads). Leave it unset or "
            "False: Liger's other kernels are applied."
        )
    args.liger_kernel_config = {**liger_kernel_config, "fused_linear_cross_entropy": False}


def check_activation_offload_args(args) -> None:
    """Refuse a checkpoint offload that would do nothing (called by the configs, after transformers resolved
    `gradient_checkpointing*` into `activation_checkpointing*`): `{"offload": True}` in the checkpointing kwargs
    offloads the inputs gradient checkpointing saves, and transformers reads it only when checkpointing is on."""
    offload = (args.activation_checkpointing_kwargs or {}).get("offload", False)
    if not isinstance(offload, bool):
        raise ValueError(
            f"gradient_checkpointing_kwargs={{'offload': {offload!r}}}: `offload` must be True or False."
        )
    if offload and not args.activation_checkpointing:
        raise ValueError(
            "gradient_checkpointing_kwargs={'offload': True} offloads the layer inputs that gradient checkpointing "
            "saves, and needs gradient_checkpointing=True. To offload every saved activation without checkpointing, "
            "set activation_offloading=True instead."
        )


@contextlib.contextmanager
def stock_activation_offloading_off(args):
    """TRL's RewardTrainer and SFTTrainer build their own offload context in `__init__` when `activation_offloading`
    is set (CUDA streams: it fails without an accelerator, and it cannot be pointed at another host store); ours
    replaces it (`install_activation_offload`), so TRL sees False while it initialises."""
    value = getattr(args, "activation_offloading", False)
    args.activation_offloading = False
    try:
        yield
    finally:
        args.activation_offloading = value


def install_activation_offload(trainer) -> None:
    """The trainer's activation offload (`trl_longrm.memory.activation_offload`), after TRL's `__init__`:

    - `activation_offloading=True`: `trainer.maybe_activation_offload_context`, which TRL's `training_step` enters
      around forward and backward (SimPOGRMTrainer's does the same), offloads every saved activation: with gradient
      checkpointing, the checkpointed layers' inputs and what is saved outside the layers;
    - `gradient_checkpointing_kwargs={"offload": True}` (transformers' checkpoint offload): the checkpointed layers'
      inputs only, through the same hooks instead of transformers' pinned `save_on_cpu` (which fails on CPU).

    Both hold the host copies in `trainer.activation_offload_store` (None when off; `use_host_store` overrides it)."""
    from trl_longrm.memory.activation_offload import HostStore, OffloadActivations, offload_checkpointed_inputs

    args = trainer.args
    offload_all = bool(getattr(args, "activation_offloading", False))
    offload_inputs = bool(args.activation_checkpointing and (args.activation_checkpointing_kwargs or {}).get("offload"))
    trainer.maybe_activation_offload_context = contextlib.nullcontext()
    trainer.activation_offload_store = HostStore() if offload_all or offload_inputs else None
    device, store = trainer.accelerator.device, trainer.activation_offload_store
    if offload_all:
        # Entered once per step: it reads the model's parameter storages then, to leave views of weights alone.
        trainer.maybe_activation_offload_context = OffloadActivations(device, store, model=trainer.model)
    if offload_inputs:
        # Entered around every checkpointed layer, whose saved inputs are activations, never weights.
        offload_checkpointed_inputs(trainer.model, OffloadActivations(device, store))


def install_checkpointing_switches(trainer) -> None:
    """The keys of `gradient_checkpointing_kwargs` this package adds to the HF Trainer's, after TRL's `__init__`, each
    honoured when the HF Trainer enables checkpointing in `train()`:

    - `selective` (TRL's key, which SFTTrainer alone takes): the checkpointed layers keep their attention kernels'
      outputs (`trl_longrm.memory.selective_checkpointing`). `{"selective": False}` (which TRL takes too) is plain
      checkpointing: the wrapper is installed for it as well, since it is what takes the key out before torch's
      `checkpoint` sees it (which refuses keys it does not know);
    - `unchecked_layers`: the first N decoder layers are not checkpointed (`trl_longrm.memory.partial_checkpointing`).
    """
    kwargs = trainer.args.activation_checkpointing_kwargs or {}
    if SELECTIVE_KEY in kwargs:
        enable_selective_checkpointing(trainer.model)
    if UNCHECKED_KEY in kwargs:
        enable_partial_checkpointing(trainer.model)


@contextlib.contextmanager
def selective_hidden_from_sft_trainer(args):
    """TRL's SFTTrainer would wrap the model with its own selective policy (which misses torch's `varlen_attn` op) and
    drop the key; ours (`install_checkpointing_switches`) replaces it, so SFTTrainer sees no `selective` while it
    initialises."""
    selective = (args.activation_checkpointing_kwargs or {}).get(SELECTIVE_KEY)
    if selective is None:
        yield
        return
    hidden = {k: v for k, v in args.activation_checkpointing_kwargs.items() if k != SELECTIVE_KEY}
    args.activation_checkpointing_kwargs = args.gradient_checkpointing_kwargs = hidden
    try:
        yield
    finally:
        kwargs = {**(args.activation_checkpointing_kwargs or {}), SELECTIVE_KEY: selective}
        args.activation_checkpointing_kwargs = args.gradient_checkpointing_kwargs = kwargs


def resolve_tokenizer(model, processing_class: PreTrainedTokenizerBase | None, trust_remote_code: bool = False):
    """The tokenizer a trainer needs before TRL's `__init__` runs (to tokenise our data formats)."""
    if processing_class is not None:
        return processing_class
    name = model if isinstance(model, str) else model.config._name_or_path
    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)


def pad_token_id_of(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _is_packed(dataset, column: str) -> bool:
    """Whether `dataset` holds packs (rows of several examples, `num_tokens` per pack) rather than examples."""
    if (
        not isinstance(dataset, Dataset)
        or "num_tokens" not in dataset.column_names
        or column not in dataset.column_names
    ):
        return False
    first = dataset[0][column] if len(dataset) else None
    return bool(first) and isinstance(first[0], list)


def _drop_sequences_over(dataset: Dataset, max_length: int | None, dataset_name: str) -> Dataset:
    """Pre-tokenised `chosen_ids` / `rejected_ids` rows (RewardTrainer's format) within `max_length`: as in
    RewardTrainer, a row with a longer sequence is dropped (token ids cannot be cut like text), and counted."""
    if max_length is None or len(dataset) == 0:
        return dataset
    longest = np.maximum(
        pc.list_value_length(dataset.data.column("chosen_ids")).to_numpy(zero_copy_only=False),
        pc.list_value_length(dataset.data.column("rejected_ids")).to_numpy(zero_copy_only=False),
    )
    keep = np.flatnonzero(longest <= max_length)
    if len(keep) == len(dataset):
        return dataset
    if len(keep) == 0:
        raise ValueError(
            f"{dataset_name} dataset: every row is longer than max_length={max_length}; raise max_length."
        )
    logger.warning(
        "%s dataset: dropped %d of %d pre-tokenised rows longer than max_length=%s (as RewardTrainer does).",
        dataset_name,
        len(dataset) - len(keep),
        len(dataset),
        max_length,
    )
    return dataset.select(keep)


def _drop_streamed_sequences_over(stream, max_length: int | None, dataset_name: str):
    """`_drop_sequences_over` for a stream: each dropped row is logged (once) as it is read."""
    if max_length is None:
        return stream
    logged = set()

    def fits(row, index):
        if max(len(row["chosen_ids"]), len(row["rejected_ids"])) <= max_length:
            return True
        if index not in logged:
            logged.add(index)
            logger.warning(
                "%s dataset: dropped streamed pre-tokenised row %d, longer than max_length=%s (as RewardTrainer does).",
                dataset_name,
                index,
                max_length,
            )
        return False

    return stream.filter(fits, with_indices=True)


def _legacy_reward_columns(dataset):
    """RewardTrainer's deprecated `chosen_input_ids` / `rejected_input_ids`, renamed with its FutureWarning."""
    columns = get_dataset_column_names(dataset)
    legacy = ("chosen_input_ids", "rejected_input_ids")
    if all(c in columns for c in legacy) and not any(c in columns for c in (*REWARD_COLUMNS, "prompt_input_ids")):
        warnings.warn(
            # RewardTrainer's own warning, word for word: code that filters it keeps working.
            "Detected legacy dataset columns `chosen_input_ids`/`rejected_input_ids`; they are deprecated and will "
            "not be supported in v1. Please migrate to `chosen_ids`/`rejected_ids`.",
            FutureWarning,
            stacklevel=4,
        )
        dataset = dataset.rename_column("chosen_input_ids", "chosen_ids").rename_column(
            "rejected_input_ids", "rejected_ids"
        )
    return dataset


def _stream_preference_dataset(dataset, tokenizer, args, dataset_name: str, stock_columns: str | None):
    """A streaming dataset's groups, tokenised as they are read (`trl_longrm.data.stream_preference_dataset`)."""
    from trl_longrm.data import stream_preference_dataset

    if args.max_tokens_per_row:
        raise ValueError(
            f"{dataset_name} dataset: `max_tokens_per_row={args.max_tokens_per_row}` bins whole groups of a dataset "
            "into rows before training, which a streaming IterableDataset cannot be. Unset it (each batch is still "
            "laid end to end in one padding-free row), or load the data without streaming."
        )
    if args.world_size > 1:
        # accelerate reads a stream on the main process and splits each batch over the processes along its first
        # dimension; a padding-free batch is one row, which cannot be split.
        raise ValueError(
            f"{dataset_name} dataset: a streaming IterableDataset is supported on one process only ({args.world_size} "
            "here): accelerate splits each streamed batch over the processes, and a padding-free batch is a single "
            "row. Load the data without streaming (a `datasets.Dataset`)."
        )
    if stock_columns == "reward":
        dataset = _legacy_reward_columns(dataset)
    first = next(iter(dataset), None)
    if first is not None and all(c in first for c in REWARD_COLUMNS) and "prompt_ids" not in first:
        return _drop_streamed_sequences_over(dataset, args.max_length, dataset_name)
    if first is not None and is_group_row(first):
        num_rejected = getattr(args, "num_rejected", None)
        if num_rejected is not None and "rejected_completion_ids" in first:
            # tokenised groups already: cut as they are read
            return dataset.map(lambda row: {"rejected_completion_ids": row["rejected_completion_ids"][:num_rejected]})
        return dataset  # tokenised groups already
    groups, _ = stream_preference_dataset(
        dataset,
        tokenizer,
        max_length=args.max_length,
        truncation=args.truncation,
        source_name=f"{dataset_name} dataset",
        prompt_key=args.prompt_key,
        chosen_key=args.chosen_key,
        rejected_key=args.rejected_key,
        stock_columns=stock_columns,
        whole_rendering=stock_columns == "reward",
        num_rejected=getattr(args, "num_rejected", None),
    )
    return groups


def prepare_preference_dataset(dataset, tokenizer, args, dataset_name: str, stock_columns: str | None = None):
    """Normalise (any format of `trl_longrm.data`, or RewardTrainer's pre-tokenised `chosen_ids` / `rejected_ids`),
    tokenise, report truncations, and optionally pack. A streaming `IterableDataset` is tokenised as it is read.

    With `stock_columns` ('reward' or 'cpo'), an unpacked dataset whose groups all have one rejected response gets
    that stock trainer's processed columns (`trl_longrm.data.stock_columns`); a dataset in them is recognised as
    processed. 'reward' (a reward model's data) also keeps each response's whole rendering, where the score is read
    (`whole_rendering` of `trl_longrm.data.tokenize_preference_dataset`).
    """
    from datasets import IterableDataset

    from trl_longrm.data import load_preference_dataset, tokenize_preference_dataset
    from trl_longrm.packing import pack_groups

    if dataset is None:
        return None
    if isinstance(dataset, IterableDataset):
        return _stream_preference_dataset(dataset, tokenizer, args, dataset_name, stock_columns)
    length_column = sampler_length_column(args)
    num_rejected = getattr(args, "num_rejected", None)
    if _is_packed(dataset, "prompt_ids"):
        dataset = cut_rejected(dataset, num_rejected, dataset_name)  # refuses groups it would have to cut
        # packed by `pack_groups` already (a dataset prepared once, passed again)
        return with_sampler_lengths(dataset, length_column, uses_shared_prefix(args))
    if stock_columns == "reward":
        dataset = _legacy_reward_columns(dataset)
    columns = dataset.column_names
    # The user's own lengths for the sampler, as stock reads them: carried to each group (and summed per pack).
    keep = (length_column,) if length_column is not None and length_column in columns else ()
    if all(c in columns for c in REWARD_COLUMNS) and "prompt_ids" not in columns:
        dataset = _drop_sequences_over(dataset, args.max_length, dataset_name)
    elif all(c in columns for c in GROUP_COLUMNS):
        dataset = cut_rejected(dataset, num_rejected, dataset_name)
    elif not all(c in columns for c in CPO_COLUMNS):
        dataset = load_preference_dataset(
            dataset,
            prompt_key=args.prompt_key,
            chosen_key=args.chosen_key,
            rejected_key=args.rejected_key,
            source_name=f"{dataset_name} dataset",
            keep_columns=keep,
            num_rejected=num_rejected,
        )
        dataset, _ = tokenize_preference_dataset(
            dataset,
            tokenizer,
            max_length=args.max_length,
            truncation=args.truncation,
            num_proc=args.dataset_num_proc,
            source_name=dataset_name,
            whole_rendering=stock_columns == "reward",
            keep_columns=keep,
        )
    if args.max_tokens_per_row:
        if "prompt_ids" not in dataset.column_names:  # stock columns: back to groups, which are what is binned
            unused = [c for c in dataset.column_names if c not in ("margin", *keep)]
            dataset = dataset.map(group_of, remove_columns=unused)
        dataset = pack_groups(
            dataset, args.max_tokens_per_row, shared_prefix=uses_shared_prefix(args), keep_columns=keep
        )
        if keep:  # a pack's length: the sum of its groups' lengths
            dataset = dataset.map(lambda pack: {length_column: sum(pack[length_column])})
    else:
        dataset = with_stock_columns(dataset, stock_columns, num_proc=args.dataset_num_proc)
    return with_sampler_lengths(dataset, length_column, uses_shared_prefix(args))


# transformers' samplers that order or batch rows by length (`train_sampling_strategy`). They read the dataset's
# `length_column_name` column, else the length of each row's `input_ids`, which preference rows do not have.
LENGTH_SAMPLING_STRATEGIES = ("group_by_length", "batch_rebalance")


def sampler_length_column(args) -> str | None:
    """The column transformers' Trainer reads the row lengths from (`length_column_name`) when its sampler uses them;
    None otherwise."""
    if getattr(args, "train_sampling_strategy", None) in LENGTH_SAMPLING_STRATEGIES:
        return args.length_column_name
    return None


def with_sampler_lengths(dataset, length_column: str | None, shared_prefix: bool):
    """`dataset` of preference groups (or packs of them) with `length_column`: the tokens each row places in a batch
    (a group's sequences as the collator lays them out, a pack's `num_tokens`), which the length-grouped samplers
    then read. A column of that name already there is the user's and is kept, as stock reads it. Unchanged when
    `length_column` is None."""
    from trl_longrm.packing import group_num_tokens

    if length_column is None or not isinstance(dataset, Dataset) or length_column in dataset.column_names:
        return dataset
    if "num_tokens" in dataset.column_names:
        lengths = list(dataset["num_tokens"])
    else:
        lengths = [group_num_tokens(row, shared_prefix) for row in dataset]
    return dataset.add_column(length_column, lengths)


def model_skeleton(name: str, args):
    """The model the stock trainers would load from `name` (TRL's `create_model_from_path` choice of class), built on the
    meta device from its config: no weights are read, but its modules and config can be checked. None if it cannot
    be built so (the real load then fails, or is checked, as it would be anyway)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs = dict(args.model_init_kwargs or {})
    trust_remote_code = kwargs.get("trust_remote_code", args.trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, revision=kwargs.get("revision"))
        architecture = getattr(transformers, (config.architectures or [""])[0], None)
        if architecture is None:
            auto_map = config.auto_map or {}
            architecture = next(
                (c for c in (AutoModelForImageTextToText, AutoModelForCausalLM) if c.__name__ in auto_map),
                AutoModelForCausalLM,
            )
        with torch.device("meta"):
            if hasattr(architecture, "from_config"):  # an auto class
                return architecture.from_config(config, trust_remote_code=trust_remote_code)
            return architecture(config)
    except Exception:  # noqa: BLE001 - a best-effort look ahead; the real load reports its own errors
        return None


def lm_head_reasons(model, args) -> list[str]:
    """What of `model` (an instance or a `model_skeleton`) our sparse LM head cannot compute as the model's own head:
    an encoder-decoder, or logit transforms (scaling, softcapping)."""
    from trl_longrm.heads import _logit_transform

    if getattr(model.config, "is_encoder_decoder", False) or getattr(args, "is_encoder_decoder", None):
        return [f"{type(model).__name__} is an encoder-decoder model (our sparse head reads a decoder-only backbone)"]
    try:
        _logit_transform(model.config)
    except ValueError as error:
        return [str(error).split(":")[0] + " (logit transforms)"]
    return []


def attention_reasons(model, args) -> list[str]:
    """Why the padding-free packed (ring) attention cannot replace `model`'s attention (sliding windows, softcapping,
    attention outside transformers' interface, ...); empty when it can, or when `padding_free` is off."""
    from trl_longrm.sequence_parallel.validation import validate_ring_attention_model

    if not args.padding_free:
        return []
    try:
        validate_ring_attention_model(model, args)
    except (TypeError, NotImplementedError) as error:  # an architecture, not a setting, the packing cannot run
        return [str(error)]
    return []


def padded_fallback_args(model, args, trainer_name: str):
    """`args` for a model whose attention the padding-free packed layout cannot use: on one process, a copy with
    padded batches (`padding_free=False`, `shared_prefix=False`; the model's own attention, the same losses), said in
    one logged line; with sequence parallelism, an error. `args` itself when the packed attention serves it."""
    import copy

    skeleton = model_skeleton(model, args) if isinstance(model, str) else model
    reasons = attention_reasons(skeleton, args) if skeleton is not None else []
    if not reasons:
        return args
    if args.sequence_parallel_size > 1:
        raise NotImplementedError(
            f"sequence_parallel_size={args.sequence_parallel_size} needs the ring attention, which cannot serve this "
            f"model: {'; '.join(reasons)}"
        )
    logger.warning(
        "%s trains on padded batches (padding_free=False, shared_prefix=False: the model's own attention, the same "
        "losses) because %s",
        trainer_name,
        "; ".join(reasons),
    )
    args = copy.copy(args)
    args.padding_free = False
    if hasattr(args, "shared_prefix"):
        args.shared_prefix = False
    return args


def prepare_sft_dataset(dataset, tokenizer, args, dataset_name: str, packing_budget: int | None,
                        assistant_only_loss: bool | None = None) -> Dataset:
    """SFT counterpart of `prepare_preference_dataset` (columns `input_ids`, `completion_mask`); `assistant_only_loss`
    as the user set it (see `trl_longrm.data.tokenize_sft_record`)."""
    from trl_longrm.data import load_sft_dataset, tokenize_sft_dataset
    from trl_longrm.packing import pack_sft_examples

    if dataset is None:
        return None
    columns = dataset.column_names if isinstance(dataset, Dataset) else None
    if _is_packed(dataset, "input_ids"):
        return dataset  # packed by `pack_sft_examples` already
    if columns is None or "input_ids" not in columns:
        dataset = load_sft_dataset(
            dataset, prompt_key=args.prompt_key, completion_key=args.chosen_key, source_name=f"{dataset_name} dataset"
        )
        dataset, _ = tokenize_sft_dataset(
            dataset,
            tokenizer,
            max_length=args.max_length,
            truncation=args.truncation,
            num_proc=args.dataset_num_proc,
            source_name=dataset_name,
            assistant_only_loss=assistant_only_loss,
        )
    if packing_budget:
        dataset = pack_sft_examples(dataset, packing_budget)
    return dataset


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a collated batch that the model itself takes (not for a shared-prefix batch, whose documents
    the model must receive as attention metadata: see `SequenceParallelMixin._shared_row_inputs`)."""
    if "segment_parents" in batch:
        # With position_ids alone, any attention would let each response see the previous one: refuse.
        raise ValueError("A shared-prefix batch needs its attention metadata; it cannot be passed as plain inputs.")
    return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}


def per_pair_sequence_logps(pair_logps: torch.Tensor, batch: dict[str, torch.Tensor]):
    """Per-sequence sums and counts `[S]` of the log-probs of a shared-prefix batch (one per `logprob_sequence`)."""
    num_sequences = batch["sequence_lengths"].numel()
    owners = batch["logprob_sequence"].to(pair_logps.device)
    sums = pair_logps.new_zeros(num_sequences).index_add(0, owners, pair_logps)
    counts = torch.zeros(num_sequences, device=pair_logps.device).index_add(0, owners, torch.ones_like(pair_logps))
    return sums, counts


def token_sequence_index(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """For each position of `input_ids`, the index of the sequence it belongs to (padding gets its row's)."""
    input_ids = batch["input_ids"]
    if "attention_mask" in batch:  # padded: one sequence per row
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return rows.unsqueeze(1).expand_as(input_ids)
    lengths = batch["sequence_lengths"].to(input_ids.device)
    index = torch.repeat_interleave(torch.arange(lengths.numel(), device=input_ids.device), lengths)
    return index.unsqueeze(0)


def per_sequence_logps(
    token_logps: torch.Tensor, label_mask: torch.Tensor, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of scored log-probs and number of scored tokens of each sequence, both `[S]`."""
    num_sequences = batch["sequence_lengths"].numel()
    index = token_sequence_index(batch)[label_mask]
    sums = token_logps.new_zeros(num_sequences).index_add(0, index, token_logps[label_mask])
    counts = torch.zeros(num_sequences, device=token_logps.device).index_add(
        0, index, torch.ones_like(token_logps[label_mask])
    )
    return sums, counts


def reduce_over_rows(gather, values: dict[str, tuple[torch.Tensor, torch.Tensor]], num_rows: int) -> dict:
    """Mean, min and max of per-group metric values over every group of the global batch, each counted once.

    `values` maps a name to `(values [N], rows [N])`: one value per item (a group, or a rejected response) and the
    dataset row (example or pack) of the micro-batch it belongs to. Reduced to per-row sums, counts, minima and maxima
    (`[num_rows, 4]` per metric, the same shape on every rank), the table goes through `gather` (the trainer's
    `gather_for_metrics`: each row once, also when the ranks of a sequence-parallel group hold the same rows), which
    drops the rows accelerate repeated to even out the last batch; gathering the items themselves would crash across
    data-parallel ranks holding different numbers of groups, and would cut the repeated rows by the wrong count.
    Returns `{name: {"mean", "min", "max"}}` (NaN where no item).
    """
    columns = []
    for item_values, rows in values.values():
        item_values = item_values.detach().float()
        zeros = item_values.new_zeros(num_rows)
        rows = rows.to(item_values.device)
        sums = zeros.index_add(0, rows, item_values)
        counts = zeros.index_add(0, rows, torch.ones_like(item_values))
        lows = zeros.scatter_reduce(0, rows, item_values, "amin", include_self=False)
        highs = zeros.scatter_reduce(0, rows, item_values, "amax", include_self=False)
        columns.append(torch.stack([sums, counts, lows, highs], dim=1))
    table = gather(torch.stack(columns, dim=1))  # [rows of all ranks, metrics, 4]
    reduced = {}
    for i, name in enumerate(values):
        sums, counts, lows, highs = table[:, i].unbind(-1)
        present = counts > 0
        total = counts.sum()
        reduced[name] = {
            "mean": (sums.sum() / total).item() if total > 0 else float("nan"),
            "min": lows[present].min().item() if present.any() else float("nan"),
            "max": highs[present].max().item() if present.any() else float("nan"),
        }
    return reduced
