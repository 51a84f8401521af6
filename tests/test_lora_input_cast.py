"""`skip_lora_input_casts_under_autocast` (trl_longrm/memory/lora_input_cast.py): under autocast, LoRA layers without PEFT's
float32 copy of their input give the same loss and gradients bit for bit as PEFT's own, make two copies of each LoRA
projection's input fewer (PEFT's float32 one and autocast's bf16 one of it) and keep less for the backward. Without
autocast, or with dropout, PEFT's cast stays."""

import copy
from collections import Counter

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from torch.utils._python_dispatch import TorchDispatchMode

from trl_longrm.memory.lora_input_cast import HOOKED_MARK, skip_lora_input_casts_under_autocast
from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def lora_model(tokenizer, dropout=0.0):
    """A bf16 Llama reward model with float32 `all-linear` adapters (PEFT's default `autocast_adapter_dtype`), lora_B
    random so that every adapter has gradients flowing through it."""
    base = build_tiny_model("llama", "seq-cls", tokenizer=tokenizer, seed=3, dtype=torch.bfloat16)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="SEQ_CLS", lora_dropout=dropout,
                        init_lora_weights=False)  # fmt: skip
    torch.manual_seed(0)
    model = get_peft_model(base, config)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    return model


class ActivationCopies(TorchDispatchMode):
    """Counts dtype conversions of activations (tensors of `shape[:2] == (batch, tokens)`) by (from, to) dtype."""

    def __init__(self, leading):
        super().__init__()
        self.leading, self.copies = leading, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape[:2]) == self.leading:
            self.copies[(args[0].dtype, out.dtype)] += 1
        return out


def step(model, input_ids, autocast=True, checkpointing=False):
    """Loss, the gradients, the bytes of the distinct storages autograd saved for the backward, and the activation
    dtype conversions of the forward."""
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), ActivationCopies(input_ids.shape) as mode:
            loss = model(input_ids=input_ids).logits.float().square().sum()
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved.values()), mode.copies


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_same_loss_and_gradients_bit_for_bit_and_no_input_copies(tokenizer, checkpointing):
    stock = lora_model(tokenizer)
    ours = copy.deepcopy(stock)
    assert skip_lora_input_casts_under_autocast(ours) == sum(type(m) is LoraLinear for m in ours.modules()) > 0
    assert skip_lora_input_casts_under_autocast(ours) > 0  # idempotent: one hook each
    input_ids = torch.randint(10, len(tokenizer), (2, 37), generator=torch.Generator().manual_seed(1))

    want_loss, want_grads, want_saved, want_copies = step(stock, input_ids, checkpointing=checkpointing)
    loss, grads, saved, copies = step(ours, input_ids, checkpointing=checkpointing)

    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys() and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name
    # PEFT's switch is off for the call only: as it was after it.
    assert all(m.cast_input_dtype_enabled for m in ours.modules() if type(m) is LoraLinear)
    # Per LoRA layer, in the forward (and again in each recomputation of it under checkpointing): PEFT's float32 copy
    # and autocast's bf16 copy of that, both gone.
    layers = sum(type(m) is LoraLinear for m in ours.modules())
    assert want_copies - copies == Counter({(torch.bfloat16, torch.float32): layers, (torch.float32, torch.bfloat16): layers})
    # Under checkpointing the forward keeps the layers' inputs only (the same); the recomputation keeps less.
    assert saved == want_saved if checkpointing else saved < want_saved


def test_without_autocast_peft_casts_as_usual(tokenizer):
    stock = lora_model(tokenizer)
    ours = copy.deepcopy(stock)
    skip_lora_input_casts_under_autocast(ours)
    input_ids = torch.randint(10, len(tokenizer), (1, 21), generator=torch.Generator().manual_seed(2))
    want_loss, want_grads, _, want_copies = step(stock, input_ids, autocast=False)
    loss, grads, _, copies = step(ours, input_ids, autocast=False)
    assert copies == want_copies
    assert torch.equal(loss, want_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name
    assert all(m.cast_input_dtype_enabled for m in ours.modules() if type(m) is LoraLinear)


def test_dropout_keeps_peft_cast(tokenizer):
    model = lora_model(tokenizer, dropout=0.1)
    skip_lora_input_casts_under_autocast(model)
    assert all(getattr(m, HOOKED_MARK) for m in model.modules() if type(m) is LoraLinear)
    input_ids = torch.randint(10, len(tokenizer), (1, 9), generator=torch.Generator().manual_seed(3))
    step(model, input_ids)
    assert all(m.cast_input_dtype_enabled for m in model.modules() if type(m) is LoraLinear)


def test_a_switch_the_user_turned_off_stays_off(tokenizer):
    model = lora_model(tokenizer)
    skip_lora_input_casts_under_autocast(model)
    layers = [m for m in model.modules() if type(m) is LoraLinear]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    input_ids = torch.randint(10, len(tokenizer), (1, 9), generator=torch.Generator().manual_seed(4))
    step(model, input_ids)
    assert not any(layer.cast_input_dtype_enabled for layer in layers)
