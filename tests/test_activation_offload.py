"""Activation offload (`trl_longrm.memory.activation_offload`; `activation_offloading=True`, or transformers' checkpoint
offload `gradient_checkpointing_kwargs={"offload": True}`): with the saved activations held in host memory, each
trainer trains the same weights as without (fp32, 1e-5) over two optimizer steps, with and without gradient
checkpointing, on one process and on a gloo ring and a Ulysses group of 2; the host store's counters show what moved,
and under gradient checkpointing that is each checkpointed layer's input (layers x tokens x hidden x 4 bytes)."""

import dataclasses

import pytest
import sp_trainer_worker as worker
import torch
from test_sequence_parallel_trainers import PRELOAD, assert_state_close
from test_tiled_mlp import trained_weights
from trainer_helpers import cpu_args, random_groups
from trl import RewardConfig

from trl_longrm import LongSFTConfig, SimPODisRMConfig, SimPODisRMTrainer, SimPOGRMConfig
from trl_longrm.memory.activation_offload import (
    CountingHostStore,
    HostStore,
    OffloadActivations,
    offload_checkpointed_inputs,
    use_host_store,
)
from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks
from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model


KINDS = [kind for kind, _ in worker.TILED_RUNS]


class RecordingStore(HostStore):
    """A `HostStore` that also keeps each host copy, to see what was offloaded."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.copied = []

    def to_host(self, tensor):
        packed = super().to_host(tensor)
        self.copied.append(packed.tensor)
        return packed


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def two_steps(kind, output_dir, tokenizer, **overrides):
    """Two SGD steps of `kind` on one process (`sp_trainer_worker.tiled_trainer`)."""
    num_rejected = dict(worker.TILED_RUNS)[kind]
    return worker.tiled_trainer(kind, output_dir, tokenizer, num_rejected, sequence_parallel_size=1, **overrides)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tokenizer):
    """Each trainer's weights after two steps with gradient checkpointing, nothing offloaded: the reference."""
    out = tmp_path_factory.mktemp("plain")
    return {
        kind: trained_weights(two_steps(kind, out / kind, tokenizer, gradient_checkpointing=True)) for kind in KINDS
    }


# ---------------------------------------------------------------------------------------------------- one model


def packed_row(tokenizer):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(10, len(tokenizer), (1, 53), generator=generator)
    position_ids = torch.cat([torch.arange(30), torch.arange(23)]).unsqueeze(0)  # two packed documents
    return input_ids, position_ids


def forward_backward(model, row, context, during_forward=None):
    model.zero_grad()
    with context:
        logits = model(input_ids=row[0], position_ids=row[1], use_cache=False).logits
        if during_forward is not None:
            during_forward()
        (logits.float().square().mean() + logits[0, -1].sum()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def checkpointed_model(tokenizer):
    model = build_tiny_model("qwen3", tokenizer=tokenizer, seed=1)
    model.train()
    return model


def test_checkpoint_offload_moves_exactly_the_layer_inputs(tokenizer):
    row = packed_row(tokenizer)
    model = checkpointed_model(tokenizer)
    model.activation_checkpointing_enable()
    want_logits, want_grads = forward_backward(model, row, torch.enable_grad())

    offload = OffloadActivations(model=model)
    offload_checkpointed_inputs(model, offload)
    model.activation_checkpointing_enable(offload=True)  # what the HF Trainer calls for {"offload": True}
    layers, hidden, tokens = model.config.num_hidden_layers, model.config.hidden_size, row[0].shape[1]
    held = []
    got_logits, got_grads = forward_backward(
        model, row, torch.enable_grad(), lambda: held.append(offload.store.current_bytes)
    )
    # Each checkpointed layer's input, in fp32, and nothing else; all released by the backward.
    assert held == [layers * tokens * hidden * 4] == [offload.store.peak_bytes]
    assert offload.store.copies == layers and offload.store.current_bytes == 0
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    assert_state_close(got_grads, want_grads, "checkpoint-offloaded gradient", atol=1e-6)

    # The memory plan's hook: another store takes the copies; a counting one keeps no values, only bytes.
    with use_host_store(CountingHostStore()) as counting:
        forward_backward(model, row, torch.enable_grad())
    assert counting.peak_bytes == layers * tokens * hidden * 4 and counting.current_bytes == 0
    assert offload.store.copies == layers  # nothing more went to the trainer's own store


def test_offload_context_holds_every_saved_activation(tokenizer):
    row = packed_row(tokenizer)
    peaks = {}
    for checkpointing in (False, True):
        model = checkpointed_model(tokenizer)
        if checkpointing:
            model.activation_checkpointing_enable()
        want_logits, want_grads = forward_backward(model, row, torch.enable_grad())

        layer_inputs = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(
                lambda module, args, seen=layer_inputs: seen.append(args[0].detach().clone())
            )
        store = RecordingStore()
        got_logits, got_grads = forward_backward(model, row, OffloadActivations(model=model, store=store))
        torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
        assert_state_close(got_grads, want_grads, f"offloaded gradient (checkpointing={checkpointing})", atol=1e-6)
        assert store.current_bytes == 0
        # Every layer's input went to host memory (under checkpointing, as the layer's saved input); no weight did.
        assert all(any(c.shape == x.shape and torch.equal(c, x) for c in store.copied) for x in layer_inputs)
        weights = [w for p in model.parameters() for w in (p.detach(), p.detach().t() if p.dim() == 2 else p)]
        assert not any(c.shape == w.shape and torch.equal(c, w) for c in store.copied for w in weights)
        peaks[checkpointing] = store.peak_bytes
    # Under checkpointing, the layers' own activations are left to the recompute: far less is held.
    config = model.config
    assert config.num_hidden_layers * row[0].shape[1] * config.hidden_size * 4 < peaks[True] < peaks[False] / 3


class SavesItsInput(torch.autograd.Function):
    """Saves its input for backward, where it records what autograd hands back."""

    @staticmethod
    def forward(ctx, x, restored):
        ctx.save_for_backward(x)
        ctx.restored = restored
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        ctx.restored.append(x)
        return grad * 2, None


@pytest.mark.parametrize("use_streams", [False, True], ids=["compute_stream", "use_streams"])
def test_offload_gives_back_the_strides_of_a_saved_tensor(use_streams):
    """A saved view keeps its layout through host memory (as TRL's `OffloadActivations` restores strides): a
    transposed or permuted tensor comes back with its strides, from a real host copy; a view with gaps (a strided
    slice), whose strides would need its whole storage copied, comes back dense in the same dimension order. The
    side-stream copies (`use_streams`, CUDA tensors only) leave a CPU run as it is; their CUDA path needs a GPU and is
    not run here."""

    def run(context):
        base, cube = torch.randn(40, 24, generator=torch.Generator().manual_seed(0)), torch.randn(6, 10, 8)
        base.requires_grad_(), cube.requires_grad_()
        views = [base.t(), cube.permute(2, 0, 1), base[:, ::2], base.t()[::2]]
        restored = []
        with context:
            outputs = [SavesItsInput.apply(view, restored) for view in views]
        sum(out.square().sum() for out in outputs).backward()
        return views, restored[::-1], base.grad  # backward runs the last forward first

    store = RecordingStore(use_streams=use_streams)
    views, restored, grad = run(OffloadActivations(device="cpu", store=store))
    assert store.copies == len(views) and store.current_bytes == 0
    for view, back, copy in zip(views, restored, store.copied):
        assert back.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()  # the host copy
        assert back.data_ptr() == copy.data_ptr()
        torch.testing.assert_close(back, view.detach(), rtol=0, atol=0)
    assert [back.stride() for back in restored] == [(1, 24), (1, 80, 8), (12, 1), (1, 12)]
    assert [view.stride() for view in views[:2]] == [(1, 24), (1, 80, 8)]
    _, plain, want = run(torch.enable_grad())
    assert [back.stride() for back in plain] == [view.stride() for view in views]
    torch.testing.assert_close(grad, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------- the trainers


@pytest.mark.parametrize("kind", KINDS)
def test_trainers_train_the_same_weights_offloaded(tmp_path, tokenizer, plain, kind):
    trainer = two_steps(kind, tmp_path, tokenizer, gradient_checkpointing=True, activation_offloading=True)
    assert isinstance(trainer.maybe_activation_offload_context, OffloadActivations)  # what `training_step` enters
    weights = trained_weights(trainer)
    store = trainer.activation_offload_store
    assert store.moved_bytes > 0 and store.current_bytes == 0
    assert_state_close(weights, plain[kind], f"{kind} offloaded")


def test_offload_without_gradient_checkpointing(tmp_path, tokenizer):
    """As TRL: `activation_offloading` without checkpointing offloads every saved activation."""
    want = trained_weights(two_steps("grm", tmp_path / "plain", tokenizer, gradient_checkpointing=False))
    trainer = two_steps(
        "grm", tmp_path / "offload", tokenizer, gradient_checkpointing=False, activation_offloading=True
    )
    got = trained_weights(trainer)
    assert trainer.activation_offload_store.copies > 0
    assert_state_close(got, want, "grm offloaded without gradient checkpointing")


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_offload_kwarg_moves_the_layer_inputs(tmp_path, tokenizer, plain, kind):
    trainer = two_steps(kind, tmp_path, tokenizer, gradient_checkpointing=True,
                        gradient_checkpointing_kwargs={"offload": True})  # fmt: skip
    config = trainer.model.config
    tokens = []  # each micro-batch's row length, as the model receives it
    trainer.model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: tokens.append(args[0].shape[-1])
    )
    with use_host_store(RecordingStore()) as store:
        weights = trained_weights(trainer)
    assert_state_close(weights, plain[kind], f"{kind} checkpoint-offloaded")
    layers, hidden = config.num_hidden_layers, config.hidden_size
    # Only the checkpointed layers' inputs, one per layer and micro-batch, fp32; never more than one forward's at once.
    assert len(tokens) == 2
    assert [tuple(copy.shape) for copy in store.copied] == [(1, t, hidden) for t in tokens for _ in range(layers)]
    assert store.peak_bytes == layers * max(tokens) * hidden * 4 and store.current_bytes == 0
    assert trainer.activation_offload_store.copies == 0  # `use_host_store` took them all


@pytest.mark.parametrize("selective", [False, True], ids=["selective=False", "selective=True"])
def test_a_second_trainer_on_the_model_offloads_to_its_own_store(tmp_path, tokenizer, selective):
    """A trainer built on a model another trainer already set up (its checkpointing wrapped for the offload, and for
    `selective` around that) moves the layer inputs to its own store, not to the first trainer's."""
    settings = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"offload": True, "selective": selective},
                    max_steps=1)  # fmt: skip
    first = two_steps("disrm", tmp_path / "first", tokenizer, **settings)
    first.train()
    moved = first.activation_offload_store.copies
    assert moved == first.model.config.num_hidden_layers  # one micro-batch: each layer's input
    second = SimPODisRMTrainer(
        model=first.model,
        args=SimPODisRMConfig(**cpu_args(tmp_path / "second", per_device_train_batch_size=worker.TRAIN_BATCH, **settings)),
        train_dataset=random_groups(tokenizer, worker.TRAIN_GROUPS, 3, seed=worker.TRAIN_SEED),
        processing_class=tokenizer,
    )
    assert second.activation_offload_store is not first.activation_offload_store
    second.train()
    assert second.activation_offload_store.copies == moved
    assert first.activation_offload_store.copies == moved  # nothing more went to the first trainer's store


def test_configs_take_the_field_and_refuse_an_offload_without_checkpointing(tmp_path):
    fields = {f.name: f for f in dataclasses.fields(SimPOGRMConfig)}
    stock = {f.name: f for f in dataclasses.fields(RewardConfig)}["activation_offloading"]
    assert fields["activation_offloading"].default == stock.default
    assert fields["activation_offloading"].metadata["help"] == stock.metadata["help"]
    assert SimPOGRMConfig(**cpu_args(tmp_path), activation_offloading=True).activation_offloading is True
    for config in (SimPOGRMConfig, SimPODisRMConfig, LongSFTConfig):
        with pytest.raises(ValueError, match=r"gradient_checkpointing_kwargs=\{'offload': True\}.*needs "
                                             r"gradient_checkpointing=True.*activation_offloading=True"):  # fmt: skip
            config(**cpu_args(tmp_path), gradient_checkpointing_kwargs={"offload": True})
        with pytest.raises(ValueError, match=r"gradient_checkpointing_kwargs=\{'offload': 'yes'\}: `offload` must be"):
            config(**cpu_args(tmp_path, gradient_checkpointing=True), gradient_checkpointing_kwargs={"offload": "yes"})


@pytest.mark.slow
def test_offloaded_on_a_ring_and_a_ulysses_group_of_two(tmp_path, plain):
    run_on_gloo_ranks(worker.gloo_worker, 2, str(tmp_path), ["offload:ring", "offload:ulysses"], timeout=900,
                      preload=PRELOAD)  # fmt: skip
    for mode in ("ring", "ulysses"):
        for kind in KINDS:
            got = torch.load(tmp_path / f"offload_{mode}_{kind}_world2.pt", weights_only=False)
            assert_state_close(got, plain[kind], f"{kind} offloaded on a {mode} of 2")


def test_pinned_host_copies_are_counted_as_the_pinned_allocator_holds_them():
    """torch's caching host allocator rounds every pinned request up to a power of two (`CachingHostAllocator`:
    `c10::llvm::PowerOf2Ceil`), so a CUDA run's offloaded layer input of 2 GiB + 2 MiB holds 4 GiB of host memory:
    the store counts that for pinned copies (a CUDA plan's `CountingHostStore(pinned=True)`), and exact bytes on CPU."""
    from trl_longrm.memory.activation_offload import CountingHostStore, HostStore, pinned_host_bytes

    assert [pinned_host_bytes(n) for n in (1, 4096, 4097, 2**31 + 2**21)] == [1, 4096, 8192, 2**32]
    tensor = torch.empty(4097, dtype=torch.uint8)
    for store, held in ((CountingHostStore(pinned=True), 8192), (CountingHostStore(), 4097), (HostStore(), 4097)):
        copy = store.to_host(tensor)
        assert store.current_bytes == store.peak_bytes == held
        del copy
        assert store.current_bytes == 0
