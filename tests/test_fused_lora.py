"""Fused LoRA (`fused_lora=True`, `trl_longrm.fused_lora`): PEFT's LoRA layers with the scaling folded into B, the
adapter added into the base output by `addmm`, and the down-projections of q/k/v and gate/up as one matmul each. The
same outputs and gradients as PEFT's own forward (float32 to 1e-4 of each tensor's scale; under bf16 autocast to bf16's rounding), the same
weights after two steps of every trainer, PEFT's forward kept for what it cannot serve, and refused without LoRA."""

from __future__ import annotations

import logging

import pytest
import sp_trainer_worker as worker
import torch
from test_tiled_mlp import trained_weights

from trl_longrm.fused_lora import apply_fused_lora
from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def lora_model(tokenizer, arch="llama", **lora):
    from peft import LoraConfig, get_peft_model

    model = build_tiny_model(arch, "causal-lm", tokenizer, seed=3)
    torch.manual_seed(5)  # init_lora_weights=False: B at random, so that the adapters change the outputs
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False, **lora})
    return get_peft_model(model, config)


class LoraDownProjections(torch.overrides.TorchFunctionMode):
    """The output widths of the `linear` calls against LoRA A matrices (r rows each, or several concatenated)."""

    def __init__(self, r):
        super().__init__()
        self.r, self.widths = r, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear and args[1].shape[0] % self.r == 0 and args[1].shape[0] <= 3 * self.r:
            self.widths.append(args[1].shape[0] // self.r)
        return func(*args, **(kwargs or {}))


def outputs_and_grads(model, tokenizer, autocast=False):
    ids = torch.randint(10, len(tokenizer), (2, 37), generator=torch.Generator().manual_seed(0))
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), grads


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_same_outputs_and_gradients_as_pefts_forward(tokenizer, arch):
    model = lora_model(tokenizer, arch)
    want_logits, want_grads = outputs_and_grads(model, tokenizer)
    want_bf16 = outputs_and_grads(model, tokenizer, autocast=True) if arch == "llama" else None
    layers = len(model.base_model.model.model.layers)
    assert apply_fused_lora(model) == 7 * layers
    with LoraDownProjections(r=4) as seen:
        got_logits, got_grads = outputs_and_grads(model, tokenizer)
    # One down-projection for q/k/v, one for o, one for gate/up, one for down, per layer.
    assert sorted(seen.widths) == sorted([3, 1, 2, 1] * layers), seen.widths
    # (float32: the sums in another order, a few ulps of each tensor's largest value)
    assert (got_logits - want_logits).abs().max() <= 1e-6 * want_logits.abs().max() * 10
    assert got_grads.keys() == want_grads.keys() and any("lora_A" in n for n in got_grads)
    for name, grad in want_grads.items():
        assert (got_grads[name] - grad).abs().max() <= 1e-4 * grad.abs().max(), name
    # Under bf16 autocast (TRL's bf16=True) the adapter is added in the matmul's float32 accumulator, not after a bf16
    # rounding of its own: as close to the float32 gradients as PEFT's own bf16 ones are. (On the Llama model: the tiny
    # random Qwen3's gradients are chaotic in bf16, its q/k norms amplifying rounding: noise of half a bf16 ulp on one
    # projection's output alone triples PEFT's own error there.)
    if arch != "llama":
        return
    got_bf16 = outputs_and_grads(model, tokenizer, autocast=True)
    errors = {"fused": [], "peft": []}
    for name, grad in want_grads.items():
        scale = grad.abs().max().clamp_min(1e-12)
        for side, got in (("fused", got_bf16), ("peft", want_bf16)):
            errors[side].append(float((got[1][name] - grad).abs().max() / scale))
    assert max(errors["fused"]) < 0.05 and sum(errors["fused"]) <= 1.25 * sum(errors["peft"]), errors


def test_what_it_cannot_serve_keeps_pefts_forward(tokenizer, caplog):
    """Dropout in training, DoRA, and disabled adapters run PEFT's own forward (the layers are named in the log);
    without LoRA layers the switch is refused."""
    for lora, reason in (({"lora_dropout": 0.1}, "lora_dropout=0.1"), ({"use_dora": True}, "variant")):
        model = lora_model(tokenizer, **lora)
        with caplog.at_level(logging.WARNING, logger="trl_longrm.fused_lora"):
            caplog.clear()
            assert apply_fused_lora(model) == 0
        assert reason in caplog.text
    model = lora_model(tokenizer)
    want = outputs_and_grads(model, tokenizer)[0]
    apply_fused_lora(model)
    with model.disable_adapter(), torch.no_grad():
        base = model(input_ids=torch.randint(10, len(tokenizer), (2, 37), generator=torch.Generator().manual_seed(0)))
    base = base.logits.float()
    assert not torch.allclose(base, want)
    torch.testing.assert_close(outputs_and_grads(model, tokenizer)[0], want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="fused_lora=True: .* has no LoRA layers"):
        apply_fused_lora(build_tiny_model("llama", "causal-lm", tokenizer, seed=3))


@pytest.mark.parametrize("kind", ["grm+lora", "disrm+lora", "sft+lora"])
def test_trainers_train_the_same_adapters(tmp_path, tokenizer, kind):
    """Two steps of each trainer with TRL's gradient checkpointing and our shared prefixes (the SFT trainer packs):
    the same adapter updates with and without `fused_lora`, to float32's summation order (1e-3 of each tensor's
    update: the tiny random Qwen3 of the DisRM and SFT runs amplifies rounding, see above)."""
    num_rejected = 3 if not kind.startswith("sft") else 1

    def run(out, **settings):
        trainer = worker.tiled_trainer(kind, out, tokenizer, num_rejected, sequence_parallel_size=1,
                                       gradient_checkpointing=True, **settings)  # fmt: skip
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return trainer, start, trained_weights(trainer)

    _, start, want = run(tmp_path / "peft")
    trainer, _, got = run(tmp_path / "fused", fused_lora=True)
    assert any(getattr(m, "_longrm_fused_lora", False) for m in trainer.model.modules())
    assert got.keys() == want.keys()
    updated = 0
    for name, value in want.items():
        update = (value - start[name]).abs().max()
        updated += bool(update > 0)
        assert (got[name] - value).abs().max() <= 1e-3 * update, (name, float((got[name] - value).abs().max()),
                                                                  float(update))
    assert updated > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fused_lora_is_as_accurate_as_pefts_in_bf16(tokenizer):
    """On a GPU (cuBLAS's addmm epilogue), at a Llama layer's real width: a LoRA projection's output and gradients in
    bf16 autocast, fused and PEFT's, against float32; the fused path no less accurate."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False)).cuda()
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["0"], init_lora_weights=False))
    x = torch.randn(4096, 4096, device="cuda")
    grad = torch.randn(4096, 4096, device="cuda")

    def run(autocast):
        xs = x.clone().requires_grad_()
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(xs)
        out.float().backward(grad)
        lora = model.base_model.model[0]
        return [out.float(), xs.grad, lora.lora_A["default"].weight.grad, lora.lora_B["default"].weight.grad]

    reference, peft = run(False), run(True)
    apply_fused_lora(model)
    fused = run(True)
    for want, theirs, ours in zip(reference, peft, fused):
        scale = want.abs().max()
        assert (ours - want).abs().max() / scale <= 1.25 * (theirs - want).abs().max() / scale + 1e-3
