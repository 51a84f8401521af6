"""Bad sequence-parallel configurations fail before training with a clear message."""

import types

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM

from trl_longrm.sequence_parallel import (
    RING_ATTENTION_NAME,
    SequenceParallelConfig,
    apply_ring_attention,
    check_ring_attention_backend,
    check_sequence_parallel_size,
    init_sequence_parallel_groups,
    is_flash_attn_available,
    packed_row_metadata,
    ring_attention_forward,
    validate_sequence_parallel_setup,
)
from trl_longrm.sequence_parallel.kernels import resolve_kernel
from trl_longrm.testing_utils import build_tiny_model, tiny_config


def test_group_size_must_divide_world_size():
    check_sequence_parallel_size(2, 8)
    with pytest.raises(ValueError, match="sequence_parallel_size=3 does not divide the world size 4"):
        check_sequence_parallel_size(3, 4)
    with pytest.raises(ValueError, match="positive integer"):
        check_sequence_parallel_size(0, 4)


def test_groups_without_distributed():
    groups = init_sequence_parallel_groups(1)
    assert not groups.enabled and groups.ring_group is None
    assert (groups.ring_rank, groups.data_parallel_rank, groups.data_parallel_size) == (0, 0, 1)
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialised"):
        init_sequence_parallel_groups(2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sequence_parallel_size": 0}, "sequence_parallel_size must be a positive integer"),
        ({"ring_head_stride": 0}, "ring_head_stride must be a positive integer or None"),
        ({"ring_attn_backend": "xformers"}, "ring_attn_backend must be one of"),
        ({"ring_query_chunk_size": 0}, "ring_query_chunk_size must be a positive integer"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SequenceParallelConfig(**kwargs)


def test_head_stride_must_divide_kv_heads(tokenizer):
    model = build_tiny_model("llama", tokenizer=tokenizer)  # 2 KV heads
    with pytest.raises(ValueError, match=r"ring_head_stride=3 must divide .* \(2\); valid values: \[1, 2\]"):
        apply_ring_attention(model, SequenceParallelConfig(ring_head_stride=3))
    assert model.config._attn_implementation == "sdpa"  # left untouched
    with pytest.raises(ValueError, match="does not divide the world size"):
        validate_sequence_parallel_setup(model, SequenceParallelConfig(sequence_parallel_size=4), world_size=6)


def test_head_stride_error_names_the_heads_a_ulysses_rank_holds(tokenizer):
    from trl_longrm.sequence_parallel import validate_ring_attention_model

    model = build_tiny_model("llama", tokenizer=tokenizer)  # 4 query heads, 2 KV heads
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    # Ulysses over 4 ranks: one query head per rank, each KV head replicated on 2 ranks -> 1 KV head per rank.
    config = SequenceParallelConfig(sequence_parallel_size=4, sequence_parallel_mode="ulysses", ring_head_stride=2)
    with pytest.raises(ValueError) as error:
        validate_ring_attention_model(model, config)
    message = str(error.value)
    assert "the 1 key/value heads each rank holds after the Ulysses exchange" in message
    assert "the model's 2 over a Ulysses group of 4, each head replicated" in message
    assert "valid values: [1]" in message and "model's number of key/value heads (1)" not in message


@pytest.mark.skipif(is_flash_attn_available(), reason="flash-attn is installed here")
def test_flash_backend_without_flash_attn(tokenizer):
    with pytest.raises(ImportError, match="needs the flash-attn package"):
        check_ring_attention_backend("flash_attn")
    with pytest.raises(ImportError, match="needs the flash-attn package"):
        apply_ring_attention(
            build_tiny_model("llama", tokenizer=tokenizer), SequenceParallelConfig(ring_attn_backend="flash_attn")
        )
    with pytest.raises(ImportError, match="needs the flash-attn package"):
        resolve_kernel("flash_attn", torch.device("cpu"), torch.bfloat16)


def test_unpatchable_models(tokenizer):
    with pytest.raises(TypeError, match="needs a transformers PreTrainedModel, got Linear"):
        apply_ring_attention(torch.nn.Linear(2, 2))
    legacy = type("LegacyLlama", (LlamaForCausalLM,), {"_supports_attention_backend": False})
    with pytest.raises(TypeError, match="LegacyLlama does not dispatch its attention through"):
        apply_ring_attention(legacy(tiny_config("llama", tokenizer)))


def test_unsupported_attention_features(tokenizer):
    sliding = build_tiny_model(
        "qwen3", tokenizer=tokenizer, use_sliding_window=True, sliding_window=8, max_window_layers=0
    )
    with pytest.raises(NotImplementedError, match="sliding_attention"):
        apply_ring_attention(sliding)
    dropout = build_tiny_model("llama", tokenizer=tokenizer, attention_dropout=0.1)
    with pytest.raises(NotImplementedError, match="attention_dropout=0.1"):
        apply_ring_attention(dropout)
    softcap = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            layer_types=["full_attention"] * 2,
            sliding_window=None,
        )
    )
    with pytest.raises(NotImplementedError, match="softcapping"):
        apply_ring_attention(softcap)


def test_peft_model_is_unwrapped(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        build_tiny_model("llama", tokenizer=tokenizer), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )
    apply_ring_attention(model)
    assert model.get_base_model().config._attn_implementation == RING_ATTENTION_NAME


MODULE = types.SimpleNamespace(is_causal=True)


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"attention_mask": torch.ones(1, 1, 6, 6)}, ValueError, "received an attention mask"),
        ({"dropout": 0.1}, NotImplementedError, "attention dropout"),
        ({"softcap": 30.0}, NotImplementedError, "softcapping"),
        ({"sliding_window": 4}, NotImplementedError, "sliding-window"),
        ({"module": types.SimpleNamespace(is_causal=False)}, NotImplementedError, "causal"),
        ({"key_length": 9}, NotImplementedError, "KV cache"),
        ({"meta_length": 5}, ValueError, "describes a slice of 5 tokens"),
    ],
)
def test_attention_call_errors(change, error, match):
    q = torch.randn(1, 4, 6, 8)
    k = v = torch.randn(1, 2, change.pop("key_length", 6), 8)
    meta_length = change.pop("meta_length", None)
    kwargs = {"attention_mask": None, "module": MODULE, **change}
    if meta_length:
        kwargs["ring_attn_meta"] = packed_row_metadata(torch.arange(meta_length))
    module = kwargs.pop("module")
    mask = kwargs.pop("attention_mask")
    with pytest.raises(error, match=match):
        ring_attention_forward(module, q, k, v, mask, **kwargs)
