"""Sequence-tiled MLPs (`mlp_tile_tokens`, `trl_longrm.memory.tiled_mlp`) compute what the untiled model computes: the same
logits and gradients of a packed row (with and without gradient checkpointing), the same weights after two optimizer
steps of each trainer (fp32, 1e-5) on one process, and on a gloo ring and a Ulysses group of 2 against one untiled
process."""

import pytest
import sp_trainer_worker as worker
import torch
from test_sequence_parallel_trainers import PRELOAD, assert_state_close

from trl_longrm.memory.tiled_mlp import apply_tiled_mlp, decoder_mlps, decoder_norms, tiled_tokens, untiled_forward
from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks
from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def forward_backward(model, input_ids, position_ids):
    model.zero_grad()
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    (logits.float().square().mean() + logits[0, -1].sum()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_tiled_model_has_the_same_logits_and_gradients(tokenizer, checkpointing):
    model = build_tiny_model("qwen3", tokenizer=tokenizer, seed=1)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(10, len(tokenizer), (1, 53), generator=generator)
    position_ids = torch.cat([torch.arange(30), torch.arange(23)]).unsqueeze(0)  # two packed documents
    want_logits, want_grads = forward_backward(model, input_ids, position_ids)

    calls = []
    for mlp in decoder_mlps(model):
        mlp.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[-2]))
    assert apply_tiled_mlp(model, 8) == model.config.num_hidden_layers
    # The layers' RMSNorms are per token too (Qwen3: input, post-attention, and the per-head q/k norms), and the
    # backbone's final norm: tiled alike.
    norms = decoder_norms(model)
    assert len(norms) == 4 * model.config.num_hidden_layers + 1 and all(tiled_tokens(n) == 8 for n in norms)
    assert norms[-1] is model.model.norm
    got_logits, got_grads = forward_backward(model, input_ids, position_ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-6)
    # Float32 rounding of another summation order (a norm's weight gradient over slices; the embedding's, whose rows
    # sum the final norm's input gradient): 1.2e-6 on one element under the AVX2 kernels.
    assert_state_close(got_grads, want_grads, "tiled gradient", atol=1e-5)
    assert len(want_grads) > 10
    # The hooks see the whole row: the tiled forward is the module's own; the slices run inside it.
    assert set(calls) == {53}

    sizes = []
    gate_proj = decoder_mlps(model)[0].gate_proj
    gate_proj.register_forward_hook(lambda module, args, output: sizes.append(args[0].shape[-2]))
    forward_backward(model, input_ids, position_ids)
    # The intermediate activations never span more than a slice: the forward pass runs the 53 tokens as 7 slices, and
    # every recompute in backward (of the slices, and of the layer under gradient checkpointing, which autograd may
    # stop early) sees one slice at a time.
    assert sizes[:7] == [8] * 6 + [5] and max(sizes) == 8 and len(sizes) >= 14, sizes


def test_a_forward_bound_after_the_tiling_is_tiled_again(tokenizer):
    """A `forward` bound to a tiled module afterwards (as Liger's kernels are, in `Trainer.train()`) replaces the tiled
    one: the module no longer counts as tiled, and the decoder stack's next forward tiles the new forward (which then
    runs over slices), with the same logits and gradients."""
    model = build_tiny_model("qwen3", tokenizer=tokenizer, seed=1)
    model.train()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(10, len(tokenizer), (1, 53), generator=generator)
    position_ids = torch.cat([torch.arange(30), torch.arange(23)]).unsqueeze(0)
    want_logits, want_grads = forward_backward(model, input_ids, position_ids)

    apply_tiled_mlp(model, 8)
    modules = [*decoder_mlps(model), *decoder_norms(model)]
    seen = []  # (module, tokens) of each call of the forwards bound afterwards

    def bound_forward(self, hidden_states):  # what the module computes, as a kernel bound to the instance would
        seen.append((self, hidden_states.shape[1]))
        return type(self).forward(self, hidden_states)

    for module in modules:
        module.__dict__["forward"] = bound_forward.__get__(module, type(module))  # Liger's `_bind_method_to_module`
    assert not any(tiled_tokens(module) for module in modules)  # the mark does not claim what no longer holds
    got_logits, got_grads = forward_backward(model, input_ids, position_ids)
    assert all(tiled_tokens(module) == 8 for module in modules)
    assert all(untiled_forward(module).__func__ is bound_forward for module in modules)
    assert {module for module, _ in seen} == set(modules) and max(tokens for _, tokens in seen) == 8
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-6)
    assert_state_close(got_grads, want_grads, "tiled again", atol=1e-5)
    # Applying again changes the size, around the same forward.
    apply_tiled_mlp(model, 16)
    assert all(tiled_tokens(module) == 16 and untiled_forward(module).__func__ is bound_forward for module in modules)


def test_bad_values_are_refused(tokenizer):
    model = build_tiny_model("llama", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="mlp_tile_tokens must be a positive integer or None, got 0"):
        apply_tiled_mlp(model, 0)
    assert apply_tiled_mlp(model, None) == 0
    with pytest.raises(NotImplementedError, match="no decoder layers with an `mlp` module"):
        apply_tiled_mlp(torch.nn.Linear(2, 2), 8)


def trained_weights(trainer) -> dict:
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def untiled(tmp_path_factory, tokenizer):
    """Each trainer's weights after two steps on one process, untiled: the reference of every tiled run."""
    out = tmp_path_factory.mktemp("untiled")
    return {
        kind: trained_weights(worker.tiled_trainer(kind, out / kind, tokenizer, k, sequence_parallel_size=1))
        for kind, k in worker.TILED_RUNS
    }


@pytest.mark.parametrize("kind", [kind for kind, _ in worker.TILED_RUNS])
def test_trainers_train_the_same_weights_tiled(tmp_path, tokenizer, untiled, kind):
    num_rejected = dict(worker.TILED_RUNS)[kind]
    trainer = worker.tiled_trainer(kind, tmp_path, tokenizer, num_rejected, sequence_parallel_size=1,
                                   mlp_tile_tokens=worker.TILE_TOKENS)  # fmt: skip
    assert all(getattr(m, "_longrm_mlp_tile_tokens", None) == worker.TILE_TOKENS for m in decoder_mlps(trainer.model))
    assert_state_close(trained_weights(trainer), untiled[kind], f"{kind} tiled")


@pytest.mark.slow
def test_tiled_on_a_ring_and_a_ulysses_group_of_two(tmp_path, untiled):
    run_on_gloo_ranks(worker.gloo_worker, 2, str(tmp_path), ["tiled:ring", "tiled:ulysses"], timeout=900,
                      preload=PRELOAD)  # fmt: skip
    for mode in ("ring", "ulysses"):
        for kind, _ in worker.TILED_RUNS:
            got = torch.load(tmp_path / f"tiled_{mode}_{kind}_world2.pt", weights_only=False)
            assert_state_close(got, untiled[kind], f"{kind} tiled on a {mode} of 2")
