"""Selective activation checkpointing (`gradient_checkpointing_kwargs={"selective": True}`, TRL's key;
`trl_longrm.memory.selective_checkpointing`): every trainer trains the same weights as under plain gradient checkpointing
(fp32, bitwise on one process; 1e-5 on a gloo ring and a Ulysses group of 2 against one process), while each attention
kernel's forward runs once instead of twice (counted at the dispatcher); the kernels our paths call through flash-attn's
real interface and torch's `varlen_attn` are matched too; the memory plan traces what it keeps (against the measured
peak in tests/test_memory_plan.py) and that is at most the layers' attention outputs and log-sum-exps."""

from __future__ import annotations

import itertools
import types

import pytest
import sp_trainer_worker as worker
import torch
from test_activation_offload import KINDS, two_steps
from test_sequence_parallel_attention import CASES, positions, random_problem
from test_sequence_parallel_trainers import PRELOAD, assert_state_close
from test_shared_prefix import ROWS, shared_layout
from test_tiled_mlp import trained_weights
from torch.utils.checkpoint import checkpoint
from trainer_helpers import AttentionCallCounter, cpu_args
from upstream_attention import flash_attn_source, install_flash_attn, torch_varlen_cpu_kernels, uninstall_flash_attn

from trl_longrm import LongSFTConfig, SimPODisRMConfig, SimPOGRMConfig
from trl_longrm.memory.selective_checkpointing import is_attention_forward_op, selective_context_fn
from trl_longrm.memory_plan.planned_kernels import planned_flash_attn_forward
from trl_longrm.sequence_parallel import kernels
from trl_longrm.sequence_parallel.kernels import (
    FlashAttnVarlenOps,
    SharedPrefixVarlenKernel,
    TorchCpuFlashOps,
    TorchVarlenOps,
    VarlenKernel,
    _flash_attn_varlen,
    _torch_varlen_function,
)
from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks
from trl_longrm.sequence_parallel.sharding import RingAttentionMetadata, packed_row_metadata
from trl_longrm.testing_utils import build_chat_tokenizer


SELECTIVE = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": True})
CONFIGS = [SimPOGRMConfig, SimPODisRMConfig, LongSFTConfig]


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def counted_weights(trainer):
    with AttentionCallCounter() as calls:
        weights = trained_weights(trainer)
    return weights, calls


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tokenizer):
    """Each trainer's weights after two steps under plain gradient checkpointing, and its attention calls."""
    out = tmp_path_factory.mktemp("plain")
    return {kind: counted_weights(two_steps(kind, out / kind, tokenizer, gradient_checkpointing=True)) for kind in KINDS}


# ---------------------------------------------------------------------------------------------- the trainers


@pytest.mark.parametrize("kind", KINDS)
def test_trainers_train_the_same_weights_with_each_attention_run_once(tmp_path, tokenizer, plain, kind):
    want, plain_calls = plain[kind]
    # Under plain checkpointing the recompute runs every attention forward a second time.
    assert plain_calls.forward == 2 * plain_calls.backward > 0, vars(plain_calls)
    trainer = two_steps(kind, tmp_path, tokenizer, **SELECTIVE)
    got, calls = counted_weights(trainer)
    assert calls.forward == calls.backward == plain_calls.backward, vars(calls)
    assert_state_close(got, want, f"{kind} selective", atol=0)
    # The key stays where the user put it (saved with the run's arguments); TRL's own SFT wrapper was not installed.
    assert trainer.args.gradient_checkpointing_kwargs == {"selective": True}
    assert not getattr(trainer.model.gradient_checkpointing_enable, "_is_sac_wrapped", False)


@pytest.mark.parametrize("kind", KINDS)
def test_selective_false_is_plain_checkpointing(tmp_path, tokenizer, plain, kind):
    """`{"selective": False}` (which TRL takes) is plain checkpointing in every trainer: the key is taken out before
    torch's `checkpoint` (which refuses it: "Unexpected keyword arguments: selective"), the recompute runs, and the
    weights are those of no key."""
    want, plain_calls = plain[kind]
    trainer = two_steps(kind, tmp_path, tokenizer, gradient_checkpointing=True,
                        gradient_checkpointing_kwargs={"selective": False})  # fmt: skip
    got, calls = counted_weights(trainer)
    assert (calls.forward, calls.backward) == (plain_calls.forward, plain_calls.backward), vars(calls)
    assert_state_close(got, want, f"{kind} selective=False", atol=0)
    assert trainer.args.gradient_checkpointing_kwargs == {"selective": False}


@pytest.mark.parametrize("kind", KINDS)
def test_selective_with_the_long_row_settings(tmp_path, tokenizer, plain, kind):
    """With checkpoint offload and the tiled MLP (the `*_1m.yaml` settings; the tiled MLP's own checkpoints nest in
    the layer's): the same weights (to the tiled MLP's summation order), attention still run once."""
    settings = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": True, "offload": True},
                    mlp_tile_tokens=worker.TILE_TOKENS)  # fmt: skip
    trainer = two_steps(kind, tmp_path, tokenizer, **settings)
    got, calls = counted_weights(trainer)
    assert calls.forward == calls.backward == plain[kind][1].backward
    assert trainer.activation_offload_store.moved_bytes > 0
    assert_state_close(got, plain[kind][0], f"{kind} selective, offloaded, tiled", atol=1e-6)


def test_selective_with_lora(tmp_path, tokenizer):
    """With a PEFT model the HF Trainer's call reaches the base model's method, which is the one wrapped."""

    def run(out, **settings):
        trainer = worker.tiled_trainer("disrm+lora", out, tokenizer, 3, sequence_parallel_size=1, **settings)
        return counted_weights(trainer)

    want, plain_calls = run(tmp_path / "plain", gradient_checkpointing=True)
    got, calls = run(tmp_path / "selective", **SELECTIVE)
    assert plain_calls.forward == 2 * calls.forward and calls.forward == calls.backward > 0
    assert_state_close(got, want, "disrm LoRA selective", atol=0)


@pytest.mark.slow
def test_selective_on_a_ring_and_a_ulysses_group_of_two(tmp_path, plain):
    """Each rank asserts its attention ran once per backward (`sp_trainer_worker.run_tiled_task`)."""
    run_on_gloo_ranks(worker.gloo_worker, 2, str(tmp_path), ["selective:ring", "selective:ulysses"], timeout=900,
                      preload=PRELOAD)  # fmt: skip
    for mode in ("ring", "ulysses"):
        for kind in KINDS:
            got = torch.load(tmp_path / f"selective_{mode}_{kind}_world2.pt", weights_only=False)
            assert_state_close(got, plain[kind][0], f"{kind} selective on a {mode} of 2")


# ---------------------------------------------------------------------------------------------- the settings


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_configs_refuse_what_selective_checkpointing_cannot_honour(tmp_path, config):
    """TRL's SFTTrainer's messages, at configuration time (before a model loads)."""
    with pytest.raises(ValueError, match=r"'selective': True\}` requires `gradient_checkpointing=True`"):
        config(**cpu_args(tmp_path, gradient_checkpointing=False), gradient_checkpointing_kwargs={"selective": True})
    with pytest.raises(ValueError, match=r"requires non-reentrant gradient checkpointing"):
        config(**cpu_args(tmp_path, gradient_checkpointing=True),
               gradient_checkpointing_kwargs={"selective": True, "use_reentrant": True})  # fmt: skip
    with pytest.raises(ValueError, match=r"\{'selective': 'yes'\}: `selective` must be True or False"):
        config(**cpu_args(tmp_path, gradient_checkpointing=True), gradient_checkpointing_kwargs={"selective": "yes"})
    args = config(**cpu_args(tmp_path, gradient_checkpointing=True), gradient_checkpointing_kwargs={"selective": False})
    assert args.gradient_checkpointing_kwargs == {"selective": False}


def test_policy_keeps_the_attention_forward_ops_only():
    aten = torch.ops.aten
    for op in (aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention,
               aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention_for_cpu):  # fmt: skip
        assert is_attention_forward_op(op.default), op
    assert is_attention_forward_op(planned_flash_attn_forward._opoverload)  # a CUDA plan's stand-in for flash-attn's
    for op in (aten._scaled_dot_product_cudnn_attention_backward, aten._scaled_dot_product_flash_attention_for_cpu_backward,
               aten.mm, aten.mul.Tensor, aten.scaled_dot_product_attention):  # fmt: skip
        op = getattr(op, "default", op)
        assert not is_attention_forward_op(op), op


# ------------------------------------------------------------------------------ the kernels' real interfaces


@pytest.fixture
def flash_attn():
    source = flash_attn_source()
    emulation = install_flash_attn(source, allow_float32=True)
    yield emulation
    uninstall_flash_attn(source)


@pytest.fixture
def torch_varlen():
    from torch.nn.attention import varlen

    if not hasattr(varlen, "_varlen_attn_backward"):
        pytest.skip(f"torch {torch.__version__} has no varlen attention backward op")
    torch_varlen_cpu_kernels()


def checkpointed_attention(kernel, layout, context_fn=None):
    """Out and q/k/v gradients of one row through `kernel` under non-reentrant checkpointing, and the attention calls
    it made: `layout` 'packed' (documents; the kernel is called as the one-process path calls it) or 'shared' (a
    shared-prefix row: two calls per head chunk merged by their log-sum-exp, `SharedPrefixVarlenKernel`)."""
    if layout == "packed":
        num_heads, num_kv_heads, lengths = CASES[0]
        meta = packed_row_metadata(positions(lengths))
    else:
        (num_heads, num_kv_heads), (lengths, parents, _) = (6, 3), shared_layout(ROWS[0])
        cu = [0, *itertools.accumulate(lengths)]
        meta = RingAttentionMetadata(cu_seqlens=tuple(cu), total_length=cu[-1], unpadded_length=cu[-1], local_start=0,
                                     local_length=cu[-1], group_size=1, rank=0, segment_parents=tuple(parents))  # fmt: skip
        kernel = SharedPrefixVarlenKernel(kernel.ops)
    q, k, v, grad_out = random_problem(num_heads, num_kv_heads, sum(lengths), seed=0)
    q, k, v = (t.transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))  # token-major, as kernels take

    def layer(q, k, v):
        return kernel.forward(q * 1.5, k, v, meta, 0.3).square()

    kwargs = {"context_fn": context_fn} if context_fn else {}
    with AttentionCallCounter() as calls:
        out = checkpoint(layer, q, k, v, use_reentrant=False, **kwargs)
        out.backward(grad_out)
    return (out.detach(), q.grad, k.grad, v.grad), calls


@pytest.mark.parametrize("layout", ["packed", "shared"])
@pytest.mark.parametrize("library", ["flash_attn", "torch_varlen"])
def test_the_kernels_forward_ops_are_kept(request, library, layout):
    """flash-attn's custom op (`flash_attn::_flash_attn_varlen_forward`) and torch's (`torch_attn::_varlen_attn`),
    which TRL's policy does not match, run once under selective checkpointing, on packed rows and on a shared-prefix
    row (whose merge writes into a copy of the kept outputs); the results are the same, bit for bit."""
    if library == "flash_attn":
        request.getfixturevalue("flash_attn")
        kernel, op = VarlenKernel("flash_attn", _flash_attn_varlen, FlashAttnVarlenOps.load()), "flash_attn::"
    else:
        request.getfixturevalue("torch_varlen")
        kernel, op = VarlenKernel("torch_varlen", _torch_varlen_function(), TorchVarlenOps.load()), "torch_attn::"
    calls_per_pass = 1 if layout == "packed" else 2  # the shared row's two calls
    want, plain = checkpointed_attention(kernel, layout)
    got, selective = checkpointed_attention(kernel, layout, selective_context_fn)
    assert plain.forward == 2 * calls_per_pass and plain.backward == calls_per_pass, vars(plain)
    assert selective.forward == selective.backward == calls_per_pass, vars(selective)
    assert {name.split("::")[0] + "::" for name in selective.ops} == {op}
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m, name=name: f"{library} {name}: {m}")


@pytest.mark.parametrize("library", ["torch_cpu_flash", "torch_varlen"])
def test_the_shared_prefix_merge_copies_only_the_kept_outputs(request, monkeypatch, library):
    """Under selective checkpointing the shared-prefix merge writes into a copy of its first call's `out` and `lse`
    only where they are the attention op's outputs, which the checkpoint keeps for the recompute (torch's
    `varlen_attn`); PyTorch's CPU flash kernel returns buffers it filled itself, merged in place as under plain
    checkpointing. The same results, bit for bit."""
    if library == "torch_varlen":
        request.getfixturevalue("torch_varlen")
        ops = TorchVarlenOps.load()
    else:
        ops = TorchCpuFlashOps.load()
    first_outputs, merged_in_place = [], []  # per merge: whether it returned its first call's `out` itself
    call = ops.forward

    def recorded_call(*args):
        out, lse = call(*args)
        first_outputs.append(out.data_ptr())
        return out, lse

    merge = kernels._SharedPrefixLayout.forward

    def recorded_merge(self, ops, q, k, v, scale):
        first = len(first_outputs)
        out, lse = merge(self, ops, q, k, v, scale)
        merged_in_place.append(out.data_ptr() == first_outputs[first])
        return out, lse

    monkeypatch.setattr(ops, "forward", recorded_call)
    monkeypatch.setattr(kernels._SharedPrefixLayout, "forward", recorded_merge)
    kernel = types.SimpleNamespace(ops=ops)
    want, plain = checkpointed_attention(kernel, "shared")
    assert merged_in_place == [True, True]  # the forward and its recompute
    merged_in_place.clear()
    got, selective = checkpointed_attention(kernel, "shared", selective_context_fn)
    assert selective.forward == selective.backward == plain.backward > 0, vars(selective)  # each attention op once
    assert merged_in_place == [library == "torch_cpu_flash"] * 2
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m, name=name: f"{library} {name}: {m}")


# ---------------------------------------------------------------------------------------------- the memory plan


def test_the_plan_keeps_at_most_the_layers_attention_outputs():
    """The plan of a selective step exceeds the plain one's by what the policy keeps: at most each layer's attention
    output and log-sum-exp (a hand computation), at least one layer's output."""
    from test_memory_plan import build_case

    from trl_longrm.memory_plan import plan_memory

    stage, args, config, shape, peft_config, dtype, _ = build_case("grm_shared_k4_checkpointing_fp32")
    plain = plan_memory(stage, args, config, shape, dtype=dtype)
    stage, args, config, shape, peft_config, dtype, _ = build_case("grm_shared_k4_selective_checkpointing_fp32")
    selective = plan_memory(stage, args, config, shape, dtype=dtype)
    tokens = shape.tokens(True, stage)
    heads, head_dim = config.num_attention_heads, config.head_dim
    per_layer = tokens * heads * head_dim * 4 + tokens * heads * 4  # fp32 output, fp32 lse
    extra = selective.peak - plain.peak
    assert tokens * heads * head_dim * 4 <= extra <= config.num_hidden_layers * per_layer, (extra, per_layer)


@pytest.mark.parametrize("attention", ["flash_attn", "cudnn"])
def test_a_cuda_plan_keeps_the_planned_kernels_outputs(attention):
    """A plan of a CUDA run traces flash-attn's forward as one operator (`planned_flash_attn_forward`) and cuDNN's
    through its aten op, so the outputs a GPU run keeps are in the plan: more than plain checkpointing by at least one
    layer's bf16 attention output (by none if the planned kernels' outputs were not kept), at most each layer's output
    and lse twice (the kept outputs, and the copy the shared-prefix merge writes into for the layer being
    recomputed)."""
    from test_memory_plan import build_case

    from trl_longrm.memory_plan import plan_memory

    peaks = {}
    for name in ("grm_shared_k4_checkpointing_fp32", "grm_shared_k4_selective_checkpointing_fp32"):
        stage, args, config, shape, _, _, _ = build_case(name)
        args.bf16 = True
        peaks[name] = plan_memory(stage, args, config, shape, dtype=torch.bfloat16, device="cuda", attention=attention)
    plain, selective = peaks.values()
    tokens, heads, head_dim = shape.tokens(True, stage), config.num_attention_heads, config.head_dim
    output, lse = tokens * heads * head_dim * 2, tokens * heads * 4
    extra = selective.peak - plain.peak
    assert output <= extra <= 2 * config.num_hidden_layers * (output + lse), (extra, output)
