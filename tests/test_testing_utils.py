import pytest
import torch

from trl_longrm.testing_utils import EOS_TOKEN, PAD_TOKEN, build_chat_tokenizer, build_tiny_model, save_tiny_model


def test_tokenizer_round_trips_and_has_specials(tokenizer):
    text = "Any text, even unseen: Zürich 42 ∑ [[B]]"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    # Deterministic: a second build gives the same ids.
    assert build_chat_tokenizer()(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_chat_template_prefix_and_assistant_mask(tokenizer):
    messages = [
        {"role": "system", "content": "You judge."},
        {"role": "user", "content": "Is the sky blue?"},
        {"role": "assistant", "content": "[Score: 7]"},
    ]
    full = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert full["input_ids"][: len(prompt)] == prompt
    masked = [t for t, m in zip(full["input_ids"], full["assistant_masks"]) if m]
    assert tokenizer.decode(masked) == "[Score: 7]" + EOS_TOKEN
    with pytest.raises(Exception, match="Unknown role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_save_and_reload(tmp_path, arch, tokenizer):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    path = save_tiny_model(tmp_path / arch, arch=arch, task="causal-lm", seed=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    reference = build_tiny_model(arch, "causal-lm", tokenizer, seed=3)
    ids = torch.tensor([tokenizer("the city river")["input_ids"]])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    assert AutoTokenizer.from_pretrained(path).chat_template == tokenizer.chat_template

    cls_path = save_tiny_model(tmp_path / f"{arch}-cls", arch=arch, task="seq-cls")
    scorer = AutoModelForSequenceClassification.from_pretrained(cls_path)
    assert scorer(ids).logits.shape == (1, 1)
