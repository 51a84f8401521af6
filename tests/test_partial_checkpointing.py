"""Partial gradient checkpointing (`gradient_checkpointing_kwargs={"unchecked_layers": N}`,
`trl_longrm.memory.partial_checkpointing`): every trainer trains the same weights as under plain gradient checkpointing
(fp32, bitwise on one process), the first N decoder layers run without checkpointing (their attention forward is not
recomputed: counted at the dispatcher), with `selective` beside it and through a PEFT model; bad values are refused at
configuration time. The memory plan of it is checked in tests/test_memory_plan.py."""

from __future__ import annotations

import pytest
import sp_trainer_worker as worker
from test_activation_offload import KINDS, two_steps
from test_selective_checkpointing import counted_weights, plain  # noqa: F401  (the module fixture of plain runs)
from test_sequence_parallel_trainers import assert_state_close
from trainer_helpers import cpu_args

from trl_longrm import LongSFTConfig, SimPODisRMConfig, SimPOGRMConfig
from trl_longrm.memory.partial_checkpointing import checkpointed_layers
from trl_longrm.testing_utils import build_chat_tokenizer


CONFIGS = [SimPOGRMConfig, SimPODisRMConfig, LongSFTConfig]


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def recomputed_forwards(calls):
    """Attention forwards recomputed in backward: every forward beyond the one per backward call."""
    return calls.forward - calls.backward


@pytest.mark.parametrize("kind", KINDS)
def test_first_layers_keep_their_activations_and_train_the_same_weights(tmp_path, tokenizer, plain, kind):  # noqa: F811
    want, plain_calls = plain[kind]
    trainer = two_steps(kind, tmp_path, tokenizer, gradient_checkpointing=True,
                        gradient_checkpointing_kwargs={"unchecked_layers": 1})  # fmt: skip
    got, calls = counted_weights(trainer)
    layers = checkpointed_layers(trainer.accelerator.unwrap_model(trainer.model))
    assert [layer.gradient_checkpointing for layer in layers] == [False] + [True] * (len(layers) - 1)
    # Plain checkpointing recomputes every layer's attention; one layer of L no longer is.
    plain_recomputed = recomputed_forwards(plain_calls)
    assert plain_recomputed > 0 and calls.backward == plain_calls.backward
    assert recomputed_forwards(calls) == plain_recomputed * (len(layers) - 1) // len(layers), vars(calls)
    assert_state_close(got, want, f"{kind} unchecked_layers=1", atol=0)
    # The key stays where the user put it (saved with the run's arguments).
    assert trainer.args.gradient_checkpointing_kwargs == {"unchecked_layers": 1}


@pytest.mark.parametrize("kind", ["grm"])
def test_with_selective_and_every_layer_unchecked(tmp_path, tokenizer, plain, kind):  # noqa: F811
    """With `selective` the checkpointed layers keep their attention outputs too: no attention forward is recomputed
    at all; and as many unchecked layers as the model has (or more) is training without checkpointing."""
    want, _ = plain[kind]
    for name, settings in (("selective", {"unchecked_layers": 1, "selective": True}), ("all", {"unchecked_layers": 99})):
        trainer = two_steps(kind, tmp_path / name, tokenizer, gradient_checkpointing=True,
                            gradient_checkpointing_kwargs=settings)  # fmt: skip
        got, calls = counted_weights(trainer)
        assert calls.forward == calls.backward > 0, (name, vars(calls))
        assert_state_close(got, want, f"{kind} {settings}", atol=0)
    assert not any(layer.gradient_checkpointing for layer in checkpointed_layers(trainer.model))


def test_through_a_peft_model(tmp_path, tokenizer):
    """With a PEFT model the HF Trainer's call reaches the base model's method, which is the one wrapped."""

    def run(out, **settings):
        trainer = worker.tiled_trainer("disrm+lora", out, tokenizer, 3, sequence_parallel_size=1, **settings)
        return counted_weights(trainer)

    want, plain_calls = run(tmp_path / "plain", gradient_checkpointing=True)
    got, calls = run(tmp_path / "partial", gradient_checkpointing=True,
                     gradient_checkpointing_kwargs={"unchecked_layers": 1})  # fmt: skip
    assert calls.forward < plain_calls.forward and calls.backward == plain_calls.backward
    assert_state_close(got, want, "disrm LoRA unchecked_layers=1", atol=0)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_configs_refuse_what_partial_checkpointing_cannot_honour(tmp_path, config):
    for value in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="`unchecked_layers` must be an integer >= 0"):
            config(**cpu_args(tmp_path, gradient_checkpointing=True), gradient_checkpointing_kwargs={"unchecked_layers": value})
    with pytest.raises(ValueError, match=r"'unchecked_layers': 2\}` requires `gradient_checkpointing=True`"):
        config(**cpu_args(tmp_path, gradient_checkpointing=False), gradient_checkpointing_kwargs={"unchecked_layers": 2})
