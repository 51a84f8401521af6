"""Build offline stand-ins of the `trl-internal-testing` tiny models by running TRL's own generation scripts.

TRL builds its test models with `scripts/generate_tiny_models/**`: one module per model, which at import time loads
the reference model's tokenizer, generation config and (for some) config from the Hub, builds a random-weight tiny
model and pushes it to `trl-internal-testing/<name>`. This module imports those modules unchanged, from a TRL
checkout (`--trl-src`, extracted by `run.py`), with the Hub calls replaced:

- `AutoTokenizer.from_pretrained(<reference id>)` returns a synthetic tokenizer: a byte-level BPE with a 2,000-token
  vocabulary trained on the dataset stand-ins, TRL's chat templates and TRL's test sources, plus the reference
  family's special and added tokens, its bos/eos/pad/unk, bos-prepending where the real tokenizer does it, and the
  chat template TRL ships for that family (from the installed `trl` package).
- `GenerationConfig.from_pretrained(<reference id>)` is built from that tokenizer's special ids.
- `AutoConfig.from_pretrained(<reference id>)` returns a config from the hand-written `REFERENCE_CONFIGS`.
- `_common.push_to_hub` saves the model, tokenizer and generation config into `<hub>/trl-internal-testing/<name>`,
  with the config's bos/eos/pad ids set to the synthetic tokenizer's.
- `check_transformers_version`, `check_dtype_pattern` and `print_config_diff` are skipped (they pin a transformers
  release or read the reference checkpoint from the Hub).

Run the dataset stand-ins first (`datasets_stand_ins.py`): their text is part of the tokenizer's training corpus.

    python stand_ins.py --trl-src WORK/trl --hub WORK/hubroot
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

import pyarrow.parquet as pq
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import CONFIG_MAPPING, AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast


ORGANIZATION = "trl-internal-testing"
VOCAB_SIZE = 2000

# The modules of scripts/generate_tiny_models that build the text models the three test files load. Not built: the
# VLMs (no image-capable stand-ins), and models only accelerator-only tests use.
TINY_MODEL_MODULES = [
    "for_causal_lm.qwen2_for_causal_lm_2_5",
    "for_sequence_classification.qwen2_for_sequence_classification_2_5",
    "for_causal_lm.gpt_neox_for_causal_lm",
    "for_causal_lm.llama_for_causal_lm_3",
    "for_causal_lm.llama_for_causal_lm_3_1",
    "for_causal_lm.llama_for_causal_lm_3_2",
    "for_causal_lm.qwen3_for_causal_lm",
    "for_causal_lm.qwen3_moe_for_causal_lm",
    "for_causal_lm.remote_for_causal_lm",
    "for_conditional_generation.t5_for_conditional_generation",
    "for_causal_lm.mistral_for_causal_lm_0_1",
    "for_causal_lm.mistral_for_causal_lm_0_2",
    "for_causal_lm.gemma_for_causal_lm",
    "for_causal_lm.gemma2_for_causal_lm",
    "for_causal_lm.cohere_for_causal_lm",
    "for_causal_lm.cohere2_for_causal_lm",
    "for_causal_lm.phi3_for_causal_lm_3",
    "for_causal_lm.gpt_oss_for_causal_lm",
    "for_causal_lm.olmo3_for_causal_lm",
    "for_causal_lm.lfm2_for_causal_lm",
    "for_causal_lm.lfm2_for_causal_lm_2_5",
    "for_causal_lm.glm4_moe_for_causal_lm",
    "for_causal_lm.deepseek_v3_for_causal_lm",
    "for_causal_lm.deepseek_v3_for_causal_lm_0528",
    "for_causal_lm.nemotron_3_nano_for_causal_lm",
]

# Names the tests use that no script pushes under that name (the Phi-3 script pushes `...-3`).
ALIASES = {"tiny-Phi3ForCausalLM": "tiny-Phi3ForCausalLM-3"}

# Reference ids the tests load directly (`chat_template_path="Qwen/Qwen3-4B"`): only a tokenizer is saved there.
TOKENIZER_ONLY_REFERENCES = ["Qwen/Qwen3-4B"]

# TRL ships no chat template for Mistral v0.1/v0.2 or Olmo-3-Think; these two are written for the stand-ins.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
OLMO3_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n<think>' -}}{%- endif -%}"
)

QWEN_EXTRA_SPECIAL = [
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip

# Per tokenizer family: special tokens (special=True), other added tokens (special=False), the bos/eos/pad/unk
# tokens, whether the real tokenizer prepends bos, and the chat template: the name of one of TRL's templates
# (`trl/chat_templates/<name>.jinja`), a template string, or None.
FAMILIES = {
    "qwen2_5": dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *QWEN_EXTRA_SPECIAL],
                    normal=["<tool_call>", "</tool_call>"], eos="<|im_end|>", pad="<|endoftext|>", template="qwen2_5"),
    "qwen3": dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *QWEN_EXTRA_SPECIAL],
                  normal=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
                  eos="<|im_end|>", pad="<|endoftext|>", template="qwen3"),
    "llama3": dict(special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>",
                            *[f"<|reserved_special_token_{i}|>" for i in range(4)]],
                   bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True),
    "neox": dict(special=["<|endoftext|>", "<|padding|>"], bos="<|endoftext|>", eos="<|endoftext|>",
                 unk="<|endoftext|>", template=None),
    "gemma": dict(special=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"],
                  bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", add_bos=True, template="gemma"),
    "cohere": dict(special=["<PAD>", "<UNK>", "<CLS>", "<SEP>", "<MASK_TOKEN>", "<BOS_TOKEN>", "<EOS_TOKEN>",
                            "<EOP_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>",
                            "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>",
                            "<|START_THINKING|>", "<|END_THINKING|>"],
                   bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", unk="<UNK>", add_bos=True),
    "phi3": dict(special=["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>",
                          "<|user|>", "<|placeholder1|>", "<|placeholder2|>"],
                 bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>", unk="<unk>", template="phi3"),
    "mistral": dict(special=["<unk>", "<s>", "</s>"], normal=["[INST]", "[/INST]"], bos="<s>", eos="</s>",
                    unk="<unk>", add_bos=True, template=MISTRAL_TEMPLATE),
    "gptoss": dict(special=["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                            "<|start|>", "<|end|>", "<|message|>", "<|call|>"],
                   bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>", template="gptoss"),
    "lfm2": dict(special=["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>", "<|fim_mid|>", "<|fim_suf|>",
                          "<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>",
                          "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_response_start|>",
                          "<|tool_response_end|>"],
                 normal=["<think>", "</think>"], bos="<|startoftext|>", eos="<|im_end|>", pad="<|pad|>", add_bos=True),
    "glm4moe": dict(special=["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
                             "<|user|>", "<|assistant|>", "<|observation|>"],
                    normal=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                            "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink"],
                    eos="<|endoftext|>", pad="<|endoftext|>", template="glm4moe"),
    "deepseekv3": dict(special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"],
                       normal=["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
                               "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                               "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                               "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"],
                       bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>",
                       add_bos=True, template="deepseekv3"),
    "nemotron": dict(special=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"],
                     normal=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                             "</tool_response>"],
                     bos="<s>", eos="<|im_end|>", pad="<pad>", unk="<unk>", template="nemotron_3_nano"),
    "olmo3": dict(special=["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"], normal=["<think>", "</think>"],
                  eos="<|endoftext|>", pad="<|pad|>", template=OLMO3_TEMPLATE),
}  # fmt: skip

# Reference id -> (family, overrides). Approximations: Gemma 2 uses gemma.jinja, DeepSeek-R1-0528 deepseekv3.jinja,
# Qwen3-8B TRL's qwen3.jinja (the script pins the Hub template revision refs/pr/14).
REFERENCES = {
    "Qwen/Qwen2.5-32B-Instruct": ("qwen2_5", {}),
    "Qwen/Qwen2.5-Coder-0.5B": ("qwen2_5", {}),
    "Qwen/Qwen3-8B": ("qwen3", {}),
    "Qwen/Qwen3-30B-A3B": ("qwen3", {}),
    "Qwen/Qwen3-4B": ("qwen3", {}),
    "meta-llama/Llama-3.2-1B-Instruct": ("llama3", {"template": "llama3_2"}),
    "meta-llama/Llama-3.1-8B-Instruct": ("llama3", {"template": "llama3_1"}),
    "meta-llama/Meta-Llama-3-8B-Instruct": ("llama3", {"template": "llama3"}),
    "EleutherAI/pythia-14m": ("neox", {}),
    "google/gemma-7b-it": ("gemma", {}),
    "google/gemma-2-2b-it": ("gemma", {}),
    "CohereLabs/aya-expanse-8b": ("cohere", {"template": "cohere"}),
    "CohereLabs/tiny-aya-earth": ("cohere", {"template": "cohere2"}),
    "microsoft/Phi-3-mini-4k-instruct": ("phi3", {}),
    "mistralai/Mistral-7B-Instruct-v0.1": ("mistral", {}),
    "mistralai/Mistral-7B-Instruct-v0.2": ("mistral", {}),
    "openai/gpt-oss-20b": ("gptoss", {}),
    "LiquidAI/LFM2-1.2B": ("lfm2", {"template": "lfm2"}),
    "LiquidAI/LFM2.5-230M": ("lfm2", {"template": "lfm2_2_5"}),
    "zai-org/GLM-4.5": ("glm4moe", {}),
    "deepseek-ai/DeepSeek-R1": ("deepseekv3", {}),
    "deepseek-ai/DeepSeek-R1-0528": ("deepseekv3", {}),
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ("nemotron", {}),
    "allenai/Olmo-3-7B-Think": ("olmo3", {}),
    "google/flan-t5-small": ("t5", {}),
}

# The reference configs the scripts load with AutoConfig (model type, fields). Only the fields the scripts keep
# matter; vocab_size is replaced by the stand-in tokenizer's size (T5's hard-coded one is kept, it is larger).
REFERENCE_CONFIGS = {
    "Qwen/Qwen2.5-32B-Instruct": ("qwen2", dict(
        hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
        max_position_embeddings=32768, max_window_layers=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        sliding_window=131072, tie_word_embeddings=False, use_sliding_window=False, bos_token_id=151643,
        eos_token_id=151645)),
    "google/flan-t5-small": ("t5", dict(
        vocab_size=32128, d_model=512, d_kv=64, d_ff=1024, num_layers=8, num_decoder_layers=8, num_heads=6,
        relative_attention_num_buckets=32, dropout_rate=0.1, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, is_encoder_decoder=True, n_positions=512)),
    "meta-llama/Llama-3.2-1B-Instruct": ("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009])),
    "EleutherAI/pythia-14m": ("gpt_neox", dict(
        hidden_size=128, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, rotary_pct=0.25,
        max_position_embeddings=2048, bos_token_id=0, eos_token_id=0)),
    "Qwen/Qwen3-4B": ("qwen3", dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)),
    "Qwen/Qwen3-30B-A3B": ("qwen3_moe", dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, bos_token_id=151643,
        eos_token_id=151645)),
}  # fmt: skip

# Config classes whose scripts pass (or default to) the real vocabulary's special ids, which lie past the stand-in
# vocabulary (the embedding's padding_idx would be out of range): their ids are set to the stand-in tokenizer's.
CONFIGS_WITH_REAL_VOCAB_IDS = ("Phi3Config", "Olmo3Config")


def trl_chat_templates_dir() -> Path:
    """`chat_templates/` of the installed trl package, found without importing trl."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the trl package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "chat_templates"


class StandInBuilder:
    """Synthetic tokenizers and the Hub replacements, with the state the scripts' calls share."""

    def __init__(self, trl_src: Path, hub: Path):
        self.trl_src = trl_src
        self.hub = hub
        self.templates = trl_chat_templates_dir()
        self.current_tokenizer = None  # the last reference tokenizer a script loaded; its config calls follow it
        self._trained: dict[tuple[str, ...], str] = {}

    # -- tokenizers ----------------------------------------------------------------------------------------------
    def corpus(self) -> list[str]:
        """Training text: the dataset stand-ins, TRL's chat templates (so template boilerplate such as tool
        instructions compresses as in a real vocabulary) and TRL's test sources. Sorted, for a reproducible
        vocabulary."""
        texts = []
        for path in sorted(self.hub.glob(f"{ORGANIZATION}/*/*/*.parquet")):
            texts.append(json.dumps(pq.read_table(path).to_pylist(), ensure_ascii=False))
        for path in sorted(self.templates.glob("*.jinja")):
            texts.append(path.read_text(encoding="utf-8"))
        tests = self.trl_src / "tests"
        for path in sorted([*tests.glob("*.py"), *tests.glob("experimental/*.py")]):
            texts.append(path.read_text(encoding="utf-8"))
        return texts

    def base_tokenizer(self, initial_special: list[str]) -> Tokenizer:
        key = tuple(initial_special)
        if key not in self._trained:
            tokenizer = Tokenizer(models.BPE())
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tokenizer.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(
                vocab_size=VOCAB_SIZE,
                special_tokens=list(initial_special),
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                show_progress=False,
            )
            tokenizer.train_from_iterator(self.corpus(), trainer=trainer)
            self._trained[key] = tokenizer.to_str()
        return Tokenizer.from_str(self._trained[key])

    def template(self, value: str | None) -> str | None:
        if value is None or "{" in value:  # no template, or a template string
            return value
        return (self.templates / f"{value}.jinja").read_text(encoding="utf-8")

    def make_tokenizer(self, reference: str) -> PreTrainedTokenizerFast:
        family, overrides = REFERENCES[reference]
        if family == "t5":
            # T5: SentencePiece-style specials, </s> appended, and the 100 sentinel tokens.
            tokenizer = self.base_tokenizer(["<pad>", "</s>", "<unk>"])
            sentinels = [f"<extra_id_{i}>" for i in range(100)]
            tokenizer.add_special_tokens([AddedToken(s, special=True) for s in sentinels])
            tokenizer.post_processor = processors.TemplateProcessing(
                single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
            )
            return PreTrainedTokenizerFast(
                tokenizer_object=tokenizer,
                eos_token="</s>",
                pad_token="<pad>",
                unk_token="<unk>",
                extra_special_tokens=sentinels,
            )
        spec = {**FAMILIES[family], **overrides}
        tokenizer = self.base_tokenizer([])
        tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in spec["special"]])
        if spec.get("normal"):
            tokenizer.add_tokens([AddedToken(s, special=False, normalized=False) for s in spec["normal"]])
        if spec.get("add_bos"):
            bos = spec["bos"]
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
            )
        else:
            tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        special = {f"{name}_token": spec[name] for name in ("bos", "eos", "pad", "unk") if spec.get(name)}
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
        template = self.template(spec.get("template"))
        if template:
            fast.chat_template = template
        return fast

    # -- Hub replacements ----------------------------------------------------------------------------------------
    def install(self) -> None:
        """Replace the Hub reads the scripts make (reference ids only; anything else goes to the original)."""
        original_tokenizer = AutoTokenizer.from_pretrained
        original_generation = GenerationConfig.from_pretrained
        original_config = AutoConfig.from_pretrained
        builder = self

        def tokenizer_from_pretrained(reference, *args, **kwargs):
            if reference in REFERENCES:
                builder.current_tokenizer = builder.make_tokenizer(reference)
                return builder.current_tokenizer
            return original_tokenizer(reference, *args, **kwargs)

        def generation_from_pretrained(cls, reference, *args, **kwargs):
            if reference in REFERENCES:
                tokenizer = builder.current_tokenizer
                return GenerationConfig(
                    bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
            return original_generation(reference, *args, **kwargs)

        def config_from_pretrained(cls, reference, *args, **kwargs):
            if reference in REFERENCE_CONFIGS:
                model_type, fields = REFERENCE_CONFIGS[reference]
                fields = dict(fields)
                if model_type != "t5":
                    fields["vocab_size"] = len(builder.current_tokenizer)
                fields.update(kwargs)
                return CONFIG_MAPPING[model_type](**fields)
            return original_config(reference, *args, **kwargs)

        AutoTokenizer.from_pretrained = staticmethod(tokenizer_from_pretrained)
        GenerationConfig.from_pretrained = classmethod(generation_from_pretrained)
        AutoConfig.from_pretrained = classmethod(config_from_pretrained)
        for name in CONFIGS_WITH_REAL_VOCAB_IDS:
            self._use_stand_in_special_ids(getattr(transformers, name))

    def _use_stand_in_special_ids(self, config_class) -> None:
        original_init = config_class.__init__
        builder = self

        def __init__(config, *args, **kwargs):
            original_init(config, *args, **kwargs)
            tokenizer = builder.current_tokenizer
            if tokenizer is not None:
                for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
                    if getattr(config, attr, None) is not None:
                        setattr(config, attr, getattr(tokenizer, attr))

        config_class.__init__ = __init__

    def push_to_hub(self, model, tokenizer, generation_config, prefix=None, suffix=None, create_pr=None) -> None:
        """Save where `trl-internal-testing/<name>` resolves from the hub root; same naming as TRL's push_to_hub."""
        name = model.__class__.__name__
        if prefix is not None:
            name = f"{prefix}-{name}"
        if suffix is not None:
            name += f"-{suffix}"
        out = self.hub / ORGANIZATION / name
        config = model.config
        if tokenizer is not None and not config.is_encoder_decoder:
            # The scripts may hard-code the real vocabulary's special ids; use the stand-in tokenizer's.
            text_config = config.get_text_config()
            if text_config.vocab_size < len(tokenizer):
                raise RuntimeError(f"{name}: vocab_size {text_config.vocab_size} < tokenizer size {len(tokenizer)}")
            for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
                token_id = getattr(tokenizer, attr)
                for part in {id(config): config, id(text_config): text_config}.values():
                    if getattr(part, attr, None) is not None or token_id is not None:
                        setattr(part, attr, token_id)
        model.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        if generation_config is not None:
            generation_config.save_pretrained(out)
        print(f"[model] {out}", flush=True)

    def load_scripts_package(self):
        """Import scripts/generate_tiny_models as a package under a private name (its modules use relative imports;
        a `scripts` package installed elsewhere must not shadow it) and replace its Hub-bound helpers."""
        root = self.trl_src / "scripts" / "generate_tiny_models"
        spec = importlib.util.spec_from_file_location(
            "trl_tiny_models", root / "__init__.py", submodule_search_locations=[str(root)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules["trl_tiny_models"] = package
        spec.loader.exec_module(package)
        common = importlib.import_module("trl_tiny_models._common")
        common.push_to_hub = self.push_to_hub
        common.check_transformers_version = lambda *args, **kwargs: None
        common.check_dtype_pattern = lambda *args, **kwargs: None
        common.print_config_diff = lambda *args, **kwargs: None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-src", type=Path, required=True, help="folder with TRL's tests/ and scripts/")
    parser.add_argument("--hub", type=Path, required=True, help="local hub root (dataset stand-ins already built)")
    parser.add_argument("--modules", nargs="*", default=TINY_MODEL_MODULES, help="generate_tiny_models modules")
    args = parser.parse_args(argv)

    builder = StandInBuilder(args.trl_src.resolve(), args.hub.resolve())
    builder.install()
    builder.load_scripts_package()
    failed = []
    for module in args.modules:
        try:
            importlib.import_module(f"trl_tiny_models.{module}")  # each script builds and "pushes" at import
        except Exception as error:  # keep building the others; the list of failures ends the run
            traceback.print_exc()
            failed.append(f"{module}: {error!r}"[:300])

    for alias, target in ALIASES.items():
        link = builder.hub / ORGANIZATION / alias
        if (builder.hub / ORGANIZATION / target).is_dir() and not link.exists():
            os.symlink(target, link)
    for reference in TOKENIZER_ONLY_REFERENCES:
        builder.make_tokenizer(reference).save_pretrained(builder.hub / reference)
        print(f"[tokenizer] {builder.hub / reference}", flush=True)

    if failed:
        print("failed to build:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
