"""Stage I of the generative reward model: supervised fine-tuning of a judge on long-context judging data."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch
from datasets import Dataset, IterableDataset
from transformers import AutoConfig, TrainingArguments
from trl import SFTConfig, SFTTrainer
from trl.chat_template_utils import get_training_chat_template

from trl_longrm.data.errors import DataFormatError
from trl_longrm.data.records import resolve_sft_layout
from trl_longrm.data.sources import holds_json_feature
from trl_longrm.fused_lora import apply_fused_lora
from trl_longrm.heads import add_token_logprob_head
from trl_longrm.memory.lora_input_cast import skip_lora_input_casts_under_autocast
from trl_longrm.memory.partial_checkpointing import check_partial_checkpointing_args
from trl_longrm.memory.selective_checkpointing import (
    check_selective_checkpointing_args,
    check_selective_checkpointing_setup,
)
from trl_longrm.memory.tiled_mlp import apply_tiled_mlp
from trl_longrm.packing import SFTCollator
from trl_longrm.sequence_parallel import SequenceParallelConfig
from trl_longrm.trainers.common import (
    LongContextDataArguments,
    attention_reasons,
    check_activation_offload_args,
    install_activation_offload,
    install_checkpointing_switches,
    lm_head_reasons,
    model_skeleton,
    pad_token_id_of,
    prepare_sft_dataset,
    sampler_length_column,
    selective_hidden_from_sft_trainer,
    with_sampler_lengths,
)
from trl_longrm.trainers.parallel import SequenceParallelMixin


logger = logging.getLogger(__name__)

# Columns that only stock TRL's dataset preparation understands (tool schemas, per-row template arguments, images).
STOCK_ONLY_COLUMNS = ("tools", "chat_template_kwargs", "image", "images", "conversations")


@dataclass
class LongSFTConfig(SFTConfig, LongContextDataArguments, SequenceParallelConfig):
    """Configuration of [`LongSFTTrainer`]: TRL's `SFTConfig` plus long-context data fields.

    `max_length` bounds one example (longer ones are truncated in the middle of the prompt's longest message, or
    dropped, per `truncation`, and counted). With `packing=True` examples are binned into rows of
    `max_tokens_per_row` tokens (default: `max_length`), as TRL's BFD packing does.

    Example:
    ```python
    >>> from trl_longrm import LongSFTConfig
    >>> args = LongSFTConfig(output_dir="sft", max_length=131072)
    ```
    """

    max_length: int | None = field(
        default=131072,
        metadata={
            "help": "Most tokens of one example. Default 131072 (LongRM). Conversations and prompt/completion rows "
            "over it follow `truncation`; `text` and pre-tokenized rows are cut per `truncation_mode` (or dropped "
            "with `truncation='drop'`)."
        },
    )
    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Lay every sequence of a micro-batch end to end in one row with `position_ids` restarting per "
            "sequence, computing no padding (default True). False gives a padded batch with an attention mask."
        },
    )
    completion_only_loss: bool | None = field(
        default=None,
        metadata={
            "help": "Train only on completion tokens. Default None: True for prompt/completion rows and for "
            "pre-tokenized rows with a `completion_mask` column (stock TRL trains every token of the latter), "
            "False for `text` rows. False trains on the prompt too (for LongRM rows as well)."
        },
    )
    assistant_only_loss: bool | None = field(
        default=None,
        metadata={
            "help": "Train only on assistant turns of conversations. Default None: True for conversations "
            "(`messages`, LongRM's `chat_template`; stock TRL trains every token of `messages` by default). False "
            "trains every token of a conversation, as stock TRL."
        },
    )
    learning_rate: float = field(default=2e-6, metadata={"help": "Initial AdamW learning rate. Default 2e-6."})

    def __post_init__(self):
        super().__post_init__()
        SequenceParallelConfig.__post_init__(self)
        check_activation_offload_args(self)
        check_selective_checkpointing_args(self)
        check_partial_checkpointing_args(self)
        if (self.packing or self.eval_packing) and self.max_length is None and self.max_tokens_per_row is None:
            # Packing bins examples into rows of `max_tokens_per_row` (default `max_length`): with neither there is no
            # row size, and training unpacked instead would ignore `packing`. Stock SFTTrainer refuses it too.
            field_name = "packing" if self.packing else "eval_packing"
            raise ValueError(
                f"{field_name}=True needs a row size: set max_length (packed rows hold up to max_length tokens) or "
                "max_tokens_per_row; both are None. (Stock SFTTrainer: when packing is enabled, `max_length` can't "
                "be `None`.)"
            )


def _has_feature(feature, name: str) -> bool:
    """Whether a (nested) `datasets` feature holds a field called `name`, e.g. messages with `tool_calls`."""
    if isinstance(feature, dict):
        return name in feature or any(_has_feature(value, name) for value in feature.values())
    if isinstance(feature, (list, tuple)):
        return any(_has_feature(value, name) for value in feature)
    inner = getattr(feature, "feature", None)
    return inner is not None and _has_feature(inner, name)


def _json_values_have_key(dataset: Dataset, name: str) -> bool:
    """Whether a value of a column stored with datasets' `Json` feature (TRL's tool-call data keeps its messages so)
    holds a mapping with a non-None `name`: its schema, unlike a struct's, does not list the keys."""
    columns = [column for column, feature in dataset.features.items() if holds_json_feature(feature)]

    def found(value) -> bool:
        if isinstance(value, dict):
            return value.get(name) is not None or any(found(v) for v in value.values())
        return isinstance(value, list) and any(found(v) for v in value)

    for column in columns:
        for batch in dataset.select_columns([column]).iter(batch_size=256):  # bounded memory
            if found(batch[column]):
                return True
    return False


def _labels_differ_from_inputs(dataset: Dataset) -> bool:
    """Whether some `labels` are neither the input token nor -100 (our collator derives labels from a mask)."""
    for batch in dataset.select_columns(["input_ids", "labels"]).iter(batch_size=256):  # bounded memory
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            if len(ids) != len(labels) or any(label != -100 and label != tok for tok, label in zip(ids, labels)):
                return True
    return False


def _as_stock_labels(dataset: Dataset) -> Dataset:
    """Our `completion_mask` as stock SFTTrainer's processed column, `labels`: the token where it is trained, -100
    elsewhere (per sequence of a pack too). The collator reads either."""
    if "completion_mask" not in dataset.column_names:
        return dataset

    def labels(row):
        ids, masks = row["input_ids"], row["completion_mask"]
        if ids and isinstance(ids[0], list):  # a pack
            return {"labels": [[t if m else -100 for t, m in zip(s, k)] for s, k in zip(ids, masks)]}
        return {"labels": [t if m else -100 for t, m in zip(ids, masks)]}

    return dataset.map(labels, remove_columns=["completion_mask"], desc="SFTTrainer's `labels` column")


def _moe_aux_loss_enabled(model, args) -> bool:
    """Stock TRL adds a Mixture-of-Experts router's load-balancing loss; our sparse head does not return it."""
    config = (
        AutoConfig.from_pretrained(model, trust_remote_code=args.trust_remote_code)
        if isinstance(model, str)
        else model.config
    )
    text_config = config.get_text_config()
    coef = args.router_aux_loss_coef
    coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    return hasattr(text_config, "output_router_logits") and bool(coef)


def _architecture_reasons(model, args, peft_config) -> list[str]:
    """What of the model (an instance, or a name loaded as SFTTrainer loads it) our sparse head or (padding-free)
    packed attention cannot run."""
    if getattr(peft_config, "is_prompt_learning", False):
        return [f"PEFT {type(peft_config).__name__} adds virtual tokens that our packed rows do not hold"]
    if getattr(getattr(model, "peft_config", {}).get("default"), "is_prompt_learning", False):
        return [f"the PEFT model's {type(model.peft_config['default']).__name__} adds virtual tokens"]
    if isinstance(model, str):
        model = model_skeleton(model, args)
    if model is None:  # checked once loaded, with a clear error (`_init_long_context`)
        return []
    return lm_head_reasons(model, args) or attention_reasons(model, args)


def dataset_reasons(name: str, dataset) -> list[str]:
    """What of one dataset our packed path cannot serve (see [`stock_path_reasons`])."""
    if isinstance(dataset, IterableDataset):
        return [f"the {name} dataset is an `IterableDataset` (packing needs the whole dataset)"]
    if not isinstance(dataset, Dataset) or "num_tokens" in dataset.column_names:  # None, or already packed by us
        return []
    columns = dataset.column_names
    reasons = []
    stock_only = [c for c in STOCK_ONLY_COLUMNS if c in columns]
    if stock_only:
        reasons.append(f"the {name} dataset has the column(s) {stock_only}")
    if "input_ids" not in columns and (
        _has_feature(dataset.features, "tool_calls") or _json_values_have_key(dataset, "tool_calls")
    ):
        reasons.append(f"the {name} dataset has assistant `tool_calls`")
    if "input_ids" in columns and "labels" in columns and _labels_differ_from_inputs(dataset):
        reasons.append(f"the {name} dataset's `labels` differ from its `input_ids`")
    return reasons


def stock_path_reasons(
    model, args, train_dataset, eval_dataset, formatting_func, compute_loss_func, peft_config=None, data_collator=None
) -> list[str]:
    """What in this setup our packed path cannot serve, each said in words; empty when it serves all of it."""
    reasons = _architecture_reasons(model, args, peft_config)
    if data_collator is not None and not isinstance(data_collator, SFTCollator):
        reasons.append(f"a `data_collator` ({type(data_collator).__name__}) is given")
    if formatting_func is not None:
        reasons.append("a `formatting_func` is given")
    if compute_loss_func is not None:
        reasons.append("a `compute_loss_func` is given (it needs the full logits)")
    if args.label_smoothing_factor > 0:
        reasons.append(f"`label_smoothing_factor={args.label_smoothing_factor}` (it needs the full logits)")
    if args.packing and args.packing_strategy != "bfd":
        reasons.append(f"`packing_strategy={args.packing_strategy!r}` (ours packs whole examples, BFD)")
    if (args.dataset_kwargs or {}).get("skip_prepare_dataset"):
        reasons.append("`dataset_kwargs={'skip_prepare_dataset': True}`")
    if model is not None and _moe_aux_loss_enabled(model, args):
        reasons.append(
            "the model's Mixture-of-Experts router loss needs the model's own forward (`router_aux_loss_coef=0.0` "
            "trains without it)"
        )
    datasets = {"train": train_dataset}
    if isinstance(eval_dataset, dict):
        datasets.update({f"eval {key!r}": value for key, value in eval_dataset.items()})
    elif eval_dataset is not None:
        datasets["eval"] = eval_dataset
    for name, dataset in datasets.items():
        reasons += dataset_reasons(name, dataset)
    return reasons


class LongSFTTrainer(SequenceParallelMixin, SFTTrainer):
    """SFT for long conversations; a drop-in for TRL's `SFTTrainer`.

    Accepts LongRM's SFT format (`chat_template` + `golden`, trained on the judgment) and TRL's formats: `messages`
    (trained on assistant turns), `prompt`+`completion`, language modeling (`text`, every token, EOS appended as TRL
    does) and pre-tokenized `input_ids` (with `labels`, `assistant_masks` or `completion_mask`). Packs padding-free
    with the same collator layout as the preference trainers, and computes log-probs only at the trained tokens.

    What the packed path cannot serve (a `formatting_func` or `data_collator`, an `IterableDataset`, tool-call rows, per-row
    `chat_template_kwargs`, `compute_loss_func`, label smoothing, other packing strategies, a Mixture-of-Experts
    router loss) goes through stock `SFTTrainer` instead, said in one logged line; with `sequence_parallel_size > 1`
    it is an error.

    Example:
    ```python
    >>> from trl_longrm import LongSFTConfig, LongSFTTrainer
    >>> trainer = LongSFTTrainer(model="Qwen/Qwen3-8B", args=LongSFTConfig(output_dir="sft"), train_dataset=data)
    >>> trainer.train()
    ```
    """

    _tag_names = ["trl", "trl-longrm", "sft"]

    def __init__(
        self,
        model,
        args: LongSFTConfig | TrainingArguments | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_loss_func=None,
        *pargs,
        formatting_func=None,
        **kwargs,
    ):
        if args is None:
            args = LongSFTConfig(output_dir="long-sft")
        elif not isinstance(args, LongSFTConfig):
            # Like SFTTrainer with a plain `TrainingArguments` (or an `SFTConfig`): every field the user set carries
            # over, the fields it lacks take LongSFTConfig's defaults.
            values = args.to_dict()
            # `to_dict` hides every `*_token` field ("<EOS_TOKEN>"): SFTConfig's eos_token / pad_token too.
            values.update({name: getattr(args, name) for name in values if name.endswith("_token")})
            # `to_dict` drops the ParallelismConfig object too: without it accelerate's sp_size would be lost.
            values["parallelism_config"] = getattr(args, "parallelism_config", None)
            args = LongSFTConfig(**values)
        reasons = stock_path_reasons(
            model,
            args,
            train_dataset,
            eval_dataset,
            formatting_func,
            compute_loss_func,
            kwargs.get("peft_config"),
            data_collator,
        )
        if reasons and args.sequence_parallel_size > 1:
            raise ValueError(
                f"sequence_parallel_size={args.sequence_parallel_size} needs LongSFTTrainer's packed path, which "
                f"cannot serve this setup: {'; '.join(reasons)}."
            )
        self._stock_path = bool(reasons)
        if self._stock_path:
            logger.warning(
                "LongSFTTrainer trains through stock TRL SFTTrainer's path (no sequence parallelism, TRL's collator "
                "and loss) because %s.",
                "; ".join(reasons),
            )
        # SFTTrainer refuses a custom collator in padding-free mode, and refuses padding-free without its own packing
        # because it would not enforce `max_length`; our dataset preparation enforces it, and our collator replaces
        # its collator after `__init__`. So TRL sees `padding_free=False` while it initialises (on the stock path it
        # keeps TRL's padded batches, which give the same loss). On our path TRL also need not see
        # `assistant_only_loss`: it would refuse LongRM's conversations (a `chat_template` column it does not know)
        # and templates it has no training version of, while our tokenisation masks assistant turns itself.
        self._assistant_only_loss = args.assistant_only_loss
        evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        self._checked_datasets = [d for d in (train_dataset, *evals) if d is not None]  # by identity
        # TRL's own activation offload context (CUDA only) is replaced by ours after `__init__` on either path.
        hidden = {
            "padding_free": False,
            "activation_offloading": False,
            **({} if self._stock_path else {"assistant_only_loss": None}),
        }
        saved = {name: getattr(args, name) for name in hidden}
        for name, value in hidden.items():
            setattr(args, name, value)
        check_selective_checkpointing_setup(args, model, kwargs.get("peft_config"))
        try:
            with selective_hidden_from_sft_trainer(args):
                super().__init__(
                    model,
                    args,
                    data_collator if self._stock_path else None,
                    train_dataset,
                    eval_dataset,
                    processing_class,
                    compute_loss_func,
                    *pargs,
                    formatting_func=formatting_func,
                    **kwargs,
                )
        finally:
            for name, value in saved.items():
                setattr(args, name, value)
        self._pad_token_id = pad_token_id_of(self._tokenizer)
        install_activation_offload(self)
        install_checkpointing_switches(self)
        if self._stock_path:
            apply_tiled_mlp(self.model, args.mlp_tile_tokens)  # a model-level setting: stock's forward is tiled too
            skip_lora_input_casts_under_autocast(self.model)
            if args.fused_lora:
                apply_fused_lora(self.model)
            return
        self.data_collator = data_collator or SFTCollator(
            pad_token_id=self._pad_token_id,
            padding_free=args.padding_free,
            pad_to_multiple_of=args.pad_to_multiple_of,
        )
        add_token_logprob_head(self.model, chunk_elements=args.logprob_chunk_elements)
        self._init_long_context(self._pad_token_id)

    # ------------------------------------------------------------------ data

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        if self._stock_path:
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        if not any(dataset is d for d in self._checked_datasets):  # e.g. given to `evaluate()` after construction
            if isinstance(dataset, IterableDataset) and formatting_func is None and self._is_plain_stream(dataset, args):
                return self._prepare_stream(dataset, processing_class, args, dataset_name)
            reasons = dataset_reasons(dataset_name, dataset)
            reasons += ["a `formatting_func` is given"] if formatting_func is not None else []
            if reasons:
                raise ValueError(
                    f"LongSFTTrainer's packed path (chosen at construction from the train and eval datasets) cannot "
                    f"serve this: {'; '.join(reasons)}. Pass the dataset when constructing the trainer, so that it "
                    "trains through stock SFTTrainer's path."
                )
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        budget = (args.max_tokens_per_row or args.max_length) if packing else args.max_tokens_per_row
        columns = dataset.column_names
        if "num_tokens" in columns:
            return dataset
        layout = None
        if "input_ids" not in columns and not (
            args.dataset_text_field in columns and not {"messages", "prompt", "chat_template", "golden"} & set(columns)
        ):
            layout = resolve_sft_layout(columns, prompt_key=args.prompt_key, completion_key=args.chosen_key)
        assistant_only_loss = self._assistant_only_loss  # as the user set it (TRL's __init__ sees None)
        if layout is None and assistant_only_loss:
            raise ValueError(
                f"assistant_only_loss=True needs conversations, but the {dataset_name} dataset holds "
                f"{'pre-tokenized' if 'input_ids' in columns else 'language-modeling text'} rows (as stock SFTTrainer)."
            )
        if layout is None or (
            layout.data_format == "trl" and layout.messages_key == "messages" and assistant_only_loss is False
        ):
            # Language modeling (`text`), pre-tokenized rows, and whole conversations trained on every token: TRL's
            # own preparation, then our truncation and packing.
            dataset = self._tokenize_as_stock(dataset, processing_class, args, dataset_name)
        else:
            if args.truncation_mode != "keep_start":
                raise ValueError(
                    f"truncation_mode={args.truncation_mode!r} applies to `text` and pre-tokenized rows; the "
                    f"{dataset_name} dataset holds conversations or prompt/completion rows, whose over-long prompts "
                    "are cut per `truncation` ('truncate_prompt' keeps the head and tail, or 'drop')."
                )
            try:
                dataset = prepare_sft_dataset(dataset, tokenizer, args, dataset_name, None, assistant_only_loss)
            except DataFormatError as error:
                # Stock masks with TRL's training template TRL conversations (`messages`, which we mask by assistant
                # turn by default) and conversational prompt/completion rows when `assistant_only_loss=True`.
                conversations = layout.data_format == "trl" and (
                    layout.messages_key == "messages" or assistant_only_loss is True
                )
                if "prefix-stable" not in str(error) or not conversations:
                    raise
                dataset = self._tokenize_with_training_template(dataset, processing_class, args, dataset_name, error)
            if layout.messages_key is None:  # prompt/completion
                every_token = args.completion_only_loss is False
            elif layout.data_format == "longrm":  # a prompt (`chat_template`) and a completion (`golden`)
                every_token = assistant_only_loss is False or args.completion_only_loss is False
            else:  # TRL `messages`: stock has no completion there, only assistant turns
                every_token = assistant_only_loss is False
            if every_token:
                dataset = dataset.map(lambda row: {"completion_mask": [1] * len(row["input_ids"])})
        dataset = _as_stock_labels(
            prepare_sft_dataset(dataset, tokenizer, args, dataset_name, budget, assistant_only_loss)
        )
        length_column = sampler_length_column(args)
        if length_column is not None and "num_tokens" in dataset.column_names:
            # A packed row's `input_ids` are its sequences, whose count the length-grouped samplers would read instead
            # of its tokens (stock's packed rows are flat): they read this column.
            dataset = dataset.remove_columns([c for c in (length_column,) if c in dataset.column_names])
            dataset = with_sampler_lengths(dataset, length_column, shared_prefix=False)
        if args.shuffle_dataset:
            dataset = dataset.shuffle(seed=args.seed)
        return dataset

    @staticmethod
    def _is_plain_stream(dataset, args) -> bool:
        """Whether a stream holds `text` or pre-tokenized rows: those our path prepares with stock SFTTrainer's own
        preparation anyway (see `_tokenize_as_stock`), so a stream of them is served the same way, lazily."""
        first = next(iter(dataset), None)
        if first is None or any(c in first for c in STOCK_ONLY_COLUMNS):
            return False
        conversational = {"messages", "prompt", "chat_template", "golden"} & set(first)
        return "input_ids" in first or (args.dataset_text_field in first and not conversational)

    def _prepare_stream(self, dataset, processing_class, args, dataset_name):
        """A `text` or pre-tokenized stream given to `evaluate()` after construction: stock SFTTrainer's preparation
        (tokenisation, EOS, `labels`), then our `max_length` policy, both applied as rows are read. Packing needs the
        whole dataset, so each batch is one padding-free row of its sequences."""
        stock_args = copy.copy(args)
        stock_args.max_length, stock_args.shuffle_dataset = None, False
        completion_only_loss = self.completion_only_loss
        if args.completion_only_loss is None and "completion_mask" in next(iter(dataset)):
            self.completion_only_loss = True  # documented default of LongSFTConfig, as for a `Dataset`
        try:
            dataset = SFTTrainer._prepare_dataset(self, dataset, processing_class, stock_args, False, None, dataset_name)
        finally:
            self.completion_only_loss = completion_only_loss
        limit = args.max_length
        if limit is not None and args.truncation == "drop":
            dataset = dataset.filter(lambda row: len(row["input_ids"]) <= limit)
        elif limit is not None:
            cut = slice(None, limit) if args.truncation_mode == "keep_start" else slice(-limit, None)
            dataset = dataset.map(lambda row: {"input_ids": row["input_ids"][cut], "labels": row["labels"][cut]})
        # As for a `Dataset`: a row without a trained token (the first token is never a label) is left out.
        return dataset.filter(lambda row: any(label != -100 for label in row["labels"][1:]))

    def _tokenize_with_training_template(self, dataset, processing_class, args, dataset_name, error):
        """Conversations whose chat template renders earlier turns differently once continued (Qwen3 drops past
        reasoning): assistant turns masked with TRL's prefix-preserving training template, as stock SFTTrainer does
        with `assistant_only_loss=True`."""
        template = get_training_chat_template(processing_class)  # raises for a template TRL has no version of
        logger.warning(
            "%s dataset: %s; its assistant turns are masked with TRL's training chat template instead.",
            dataset_name,
            str(error).split(": ", 1)[-1].split(" (")[0],
        )
        chat_template = self.chat_template
        self.chat_template = template
        try:
            return self._tokenize_as_stock(dataset, processing_class, args, dataset_name, assistant_only_loss=True)
        finally:
            self.chat_template = chat_template

    def _tokenize_as_stock(self, dataset, processing_class, args, dataset_name, **overrides):
        """`text` and pre-tokenized rows: TRL's own preparation (EOS, tokenisation, labels from the masks), then a
        `completion_mask` for our collator and truncation to `max_length`, counted."""
        columns = dataset.column_names
        stock_args = copy.copy(args)
        stock_args.max_length, stock_args.shuffle_dataset = None, False  # we truncate (or drop) and count below
        for name, value in overrides.items():
            setattr(stock_args, name, value)
        completion_only_loss = self.completion_only_loss
        if args.completion_only_loss is None and "completion_mask" in columns:
            self.completion_only_loss = True  # documented default of LongSFTConfig
        try:
            dataset = SFTTrainer._prepare_dataset(
                self, dataset, processing_class, stock_args, False, None, dataset_name
            )
        finally:
            self.completion_only_loss = completion_only_loss
        dataset = dataset.map(
            lambda row: {"completion_mask": [int(label != -100) for label in row["labels"]]},
            remove_columns=["labels"],
        )
        return self._truncate(dataset, args, dataset_name)

    @staticmethod
    def _truncate(dataset: Dataset, args, dataset_name: str) -> Dataset:
        if args.max_length is None:
            return dataset
        limit = args.max_length
        lengths = dataset.map(
            lambda batch: {"length": [len(ids) for ids in batch["input_ids"]]},
            batched=True,
            remove_columns=dataset.column_names,
        )["length"]
        long_rows = sum(length > limit for length in lengths)
        if args.truncation == "drop":
            dataset = dataset.filter(lambda row: len(row["input_ids"]) <= limit)
        elif long_rows:
            cut = slice(None, limit) if args.truncation_mode == "keep_start" else slice(-limit, None)
            dataset = dataset.map(
                lambda row: {"input_ids": row["input_ids"][cut], "completion_mask": row["completion_mask"][cut]}
            )
        before = len(dataset)
        # Like TRL: a row left without a trained token contributes no loss (the first token is never a label).
        dataset = dataset.filter(lambda row: any(row["completion_mask"][1:]))
        untrained = before - len(dataset)
        if long_rows or untrained:
            logger.warning(
                "%s dataset: %d rows over max_length=%d %s; %d rows without a trained token dropped.",
                dataset_name,
                long_rows,
                limit,
                "dropped" if args.truncation == "drop" else f"truncated ({args.truncation_mode})",
                untrained,
            )
        return dataset

    def _set_signature_columns_if_needed(self):
        if self._stock_path:
            return super()._set_signature_columns_if_needed()
        if self._signature_columns is None:
            self._signature_columns = ["input_ids", "labels", "completion_mask", "num_tokens"]
            if self.args.packing or self.args.eval_packing or self.args.max_tokens_per_row:
                # The tokens of each packed row, for the length-grouped samplers (see `_prepare_dataset`). Unpacked,
                # they read `input_ids` as stock does, which drops a `length` column of the user's as unused.
                self._signature_columns.append(self.args.length_column_name)

    # ------------------------------------------------------------------ loss and metrics

    def token_logps(self, model, batch: dict[str, torch.Tensor]):
        """Per-position log-probs of the next token and the mask of trained positions."""
        return self.forward_token_logps(model, batch)

    def _token_logps_and_stats(self, model, batch):
        return self.forward_token_logps(model, batch, with_stats=True)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._stock_path:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        token_logps, label_mask, is_top1, entropy = self._token_logps_and_stats(model, inputs)
        per_token_loss = -token_logps  # 0 where not trained
        if self.args.loss_type == "dft":
            # DFT (arXiv 2508.05629), as TRL: each token's NLL weighted by its (detached) probability.
            per_token_loss = per_token_loss * token_logps.exp().detach()
        num_tokens = label_mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
        # Like TRL: `num_items_in_batch` counts every rank's tokens and DDP averages gradients across ranks.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes

        gather = self.gather_for_metrics  # each row once, also when a sequence-parallel group holds it
        with torch.no_grad():
            if mode == "train":
                self._total_train_tokens += self._count_tokens(inputs)
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            scored = gather(label_mask.sum()).sum()
            nll = gather(-token_logps.detach().sum()).sum() / scored.clamp(min=1)
            self._metrics[mode]["nll"].append(nll.item())
            correct = gather(is_top1.sum()).sum()
            entropy_sum = gather(entropy.sum()).sum()
            valid = scored.item() > 0
            self._metrics[mode]["mean_token_accuracy"].append((correct / scored).item() if valid else 0.0)
            self._metrics[mode]["entropy"].append((entropy_sum / scored).item() if valid else 0.0)
        if return_outputs:
            return loss, {"token_logps": token_logps}
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys: list[str] | None = None):
        if self._stock_path:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
            if prediction_loss_only:
                return loss.detach(), None, None
            # As TRL: the sparse head builds no logits, so they come from one more (plain) forward; a row split over
            # a sequence-parallel group has them gathered.
            logits = self.forward_logits(model, inputs)
        return loss.detach(), logits, inputs["labels"]
