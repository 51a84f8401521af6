"""Shared-prefix layout (a group's prompt once, then each response) against the unshared layout it replaces.

- The attention kernel on a shared row, on one process and on emulated rings of 2-4 ranks (slice by slice, keys
  from `kv_start`, key/value gradients summed like the reduce-scatter), against each response attended as its own
  `prompt + response` sequence.
- The GRM (with its NLL term) and DisRM trainers: loss and every parameter gradient equal the unshared layout's in
  fp32, k in {1, 3}, several groups per row, and with LoRA.
"""

import itertools
import types

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from trainer_helpers import cpu_args, random_groups
from varlen_reference import varlen_backward, varlen_forward, varlen_pieces

from trl_longrm import SimPODisRMConfig, SimPODisRMTrainer, SimPOGRMConfig, SimPOGRMTrainer
from trl_longrm.packing import PreferenceCollator, group_num_tokens, pack_groups
from trl_longrm.sequence_parallel import ring_attention_forward
from trl_longrm.sequence_parallel.kernels import TorchBlockKernel, VarlenKernel, VarlenOps, resolve_kernel
from trl_longrm.sequence_parallel.sharding import RingAttentionMetadata, shared_row_metadata
from trl_longrm.testing_utils import build_tiny_model
from trl_longrm.trainers.common import model_inputs


MODULE = types.SimpleNamespace(is_causal=True)

# Rows of groups: (prompt length, response lengths); a one-token prompt, a one-token response, a group of 4
# responses; and an unshared document (empty prompt: each response is its own document).
ROWS = [
    [(9, [3, 5]), (1, [4, 1, 2]), (6, [2, 7, 1, 3])],
    [(0, [4, 3]), (11, [2, 2]), (5, [6])],
]


def shared_layout(row):
    """Segment lengths/parents of a row, and for each sequence the row indices of its `prompt + response` tokens."""
    lengths, parents, sequences, at = [], [], [], 0
    for prompt, responses in row:
        if prompt:
            prefix, prefix_index = list(range(at, at + prompt)), len(lengths)
            lengths.append(prompt)
            parents.append(-1)
            at += prompt
        for n in responses:
            own = list(range(at, at + n))
            lengths.append(n)
            parents.append(prefix_index if prompt else -1)
            sequences.append((prefix if prompt else []) + own)
            at += n
    return lengths, parents, sequences


def reference(q, k, v, grad_out, row, scaling):
    """Each `prompt + response` attended causally on its own (SDPA); a prompt's output is read from any of its
    sequences (they agree), the gradients of the shared prompt are summed over its responses by autograd."""
    lengths, _, sequences = shared_layout(row)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))  # [H, L, D]
    group = q.shape[0] // k.shape[0]
    out = torch.zeros(q.shape[1], q.shape[0], q.shape[2])
    written = torch.zeros(q.shape[1], dtype=torch.bool)
    pieces = []
    for index in sequences:
        idx = torch.tensor(index)
        o = F.scaled_dot_product_attention(
            q[:, idx],
            k[:, idx].repeat_interleave(group, 0),
            v[:, idx].repeat_interleave(group, 0),
            is_causal=True,
            scale=scaling,
        ).transpose(0, 1)
        fresh = ~written[idx]  # count each token's output once (a prompt's from its first response)
        pieces.append((idx[fresh], o[fresh]))
        written[idx] = True
    assert written.all()
    for idx, o in pieces:
        out = out.index_put((idx,), o)
    out.backward(grad_out)
    return out.detach(), q.grad.transpose(0, 1), k.grad.transpose(0, 1), v.grad.transpose(0, 1)


def random_problem(num_heads, num_kv_heads, length, seed, head_dim=8):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_heads, length, head_dim, generator=gen),
        torch.randn(num_kv_heads, length, head_dim, generator=gen),
        torch.randn(num_kv_heads, length, head_dim, generator=gen),
        torch.randn(length, num_heads, head_dim, generator=gen),
    )


def assert_all_close(got, expected, label):
    for name, g, e in zip(["out", "dq", "dk", "dv"], got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{label} {n}: {m}")


def single_process_shared_row(row, scaling):
    """`(got, expected, problem)`: a shared row through `ring_attention_forward` on one process (out and the q/k/v
    gradients) and the unshared reference of the same problem."""
    lengths, parents, _ = shared_layout(row)
    q, k, v, grad_out = random_problem(4, 2, sum(lengths), seed=len(row))
    expected = reference(q, k, v, grad_out, row, scaling)
    leaves = [t.clone()[None].requires_grad_() for t in (q, k, v)]
    meta = shared_row_metadata(torch.tensor(lengths), torch.tensor(parents))
    assert meta.has_shared_prefixes
    out, _ = ring_attention_forward(MODULE, *leaves, None, scaling=scaling, ring_attn_meta=meta)
    out.backward(grad_out[None])
    got = [out[0].detach(), *(t.grad[0].transpose(0, 1) for t in leaves)]
    return got, expected, (q, k, v)


@pytest.mark.parametrize("row", ROWS, ids=["three_groups", "with_unshared_document"])
def test_shared_row_attention_single_process(row):
    scaling = 0.3
    got, expected, (q, k, v) = single_process_shared_row(row, scaling)
    assert_all_close(got, expected, "one process")
    # Not vacuous: reading the same row's documents from its position ids (each response continuing the previous
    # token) attends differently.
    plain, _ = ring_attention_forward(MODULE, q[None], k[None], v[None], None, scaling=scaling)
    assert (plain[0] - expected[0]).abs().max() > 1e-2


@pytest.mark.parametrize("shared", [True, False], ids=["shared_row", "packed_row"])
def test_mixed_dtypes_under_autocast_reach_the_kernels_as_one(shared):
    """TRL's default `bf16=True` on float32 weights: under autocast Qwen3's q/k norms return float32 while v comes out
    of its projection in bfloat16. The attention computes in autocast's dtype, as SDPA does (the fused CPU op of
    shared rows raised 'expected scalar type Float but found BFloat16'), and the gradients reach the float32 leaves."""
    lengths, parents, _ = shared_layout(ROWS[0])
    q, k, v, grad_out = random_problem(4, 2, sum(lengths), seed=3)
    meta = shared_row_metadata(torch.tensor(lengths), torch.tensor(parents)) if shared else None
    leaves = [q.clone()[None].requires_grad_(), k.clone()[None].requires_grad_(), v.bfloat16()[None].requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = ring_attention_forward(MODULE, *leaves, None, scaling=0.3, ring_attn_meta=meta)
    assert out.dtype == torch.bfloat16
    out.float().backward(grad_out[None])
    assert [t.grad.dtype for t in leaves] == [torch.float32, torch.float32, torch.bfloat16]
    # The same call on inputs already in bfloat16, without autocast: the same kernels, the same numbers.
    same = [t.detach().bfloat16() for t in leaves]
    expected, _ = ring_attention_forward(MODULE, *same, None, scaling=0.3, ring_attn_meta=meta)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    # Without autocast, mixed inputs are promoted to their common dtype (float32 here).
    promoted, _ = ring_attention_forward(MODULE, *(t.detach() for t in leaves), None, scaling=0.3, ring_attn_meta=meta)
    assert promoted.dtype == torch.float32


def emulated_shared_ring(q, k, v, grad_out, lengths, parents, group_size, chunk, scaling, kernel=None):
    """A kernel (default: the pure PyTorch one) slice by slice as each ring rank runs it (keys `[kv_start,
    local_end)` of the padded row), key/value gradients summed over the ranks like the reduce-scatter."""
    kernel = kernel or TorchBlockKernel()
    length = sum(lengths)
    pad = -length % group_size
    total = length + pad
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    grad_out = F.pad(grad_out, (0, 0, 0, 0, 0, pad))
    cu = [0]
    for n in lengths + ([pad] if pad else []):
        cu.append(cu[-1] + n)
    local = total // group_size
    out, dq = q.new_zeros(total, q.shape[0], q.shape[2]), q.new_zeros(total, q.shape[0], q.shape[2])
    dk, dv = k.new_zeros(total, k.shape[0], k.shape[2]), k.new_zeros(total, k.shape[0], k.shape[2])
    kv_starts = []
    for rank in range(group_size):
        meta = RingAttentionMetadata(
            cu_seqlens=tuple(cu),
            total_length=total,
            unpadded_length=length,
            local_start=rank * local,
            local_length=local,
            group_size=group_size,
            rank=rank,
            query_chunk_size=chunk,
            segment_parents=tuple(parents + ([-1] if pad else [])),
        )
        lo, hi, ks = rank * local, (rank + 1) * local, meta.kv_start
        kv_starts.append(ks)
        ql, kr, vr = q[:, lo:hi].transpose(0, 1), k[:, ks:hi].transpose(0, 1), v[:, ks:hi].transpose(0, 1)
        out[lo:hi] = kernel.forward(ql, kr, vr, meta, scaling)
        g_q, g_k, g_v = kernel.backward(ql, kr, vr, grad_out[lo:hi], meta, scaling)
        dq[lo:hi] = g_q
        dk[ks:hi] += g_k
        dv[ks:hi] += g_v
    return (out[:length], dq[:length], dk[:length], dv[:length]), kv_starts


@pytest.mark.parametrize("row", ROWS, ids=["three_groups", "with_unshared_document"])
@pytest.mark.parametrize("group_size", [2, 3, 4])
@pytest.mark.parametrize("chunk", [2, 1024])
def test_shared_row_attention_on_emulated_ring(row, group_size, chunk):
    """Prefixes and responses cross slice boundaries; a rank holds responses whose prefix is on another rank."""
    lengths, parents, _ = shared_layout(row)
    length, scaling = sum(lengths), 0.25
    q, k, v, grad_out = random_problem(6, 3, length, seed=group_size)
    expected = reference(q, k, v, grad_out, row, scaling)
    got, kv_starts = emulated_shared_ring(q, k, v, grad_out, lengths, parents, group_size, chunk, scaling)
    assert_all_close(got, expected, f"ring of {group_size}")
    local = -(-length // group_size)
    # Some rank starts its keys before its own slice's first document: a response there reads a remote prefix.
    assert any(ks < rank * local for rank, ks in enumerate(kv_starts))


# ---------------------------------------------------------------------------------------------------------------
# The layout and its guards


def test_collator_layout_and_token_counts():
    group = {"prompt_ids": [5, 6, 4], "chosen_completion_ids": [7, 2], "rejected_completion_ids": [[8, 9, 2], [3]]}
    shared = PreferenceCollator(pad_token_id=0, shared_prefix=True)([group])
    unshared = PreferenceCollator(pad_token_id=0)([group])
    assert shared["input_ids"].tolist() == [[5, 6, 4, 7, 2, 8, 9, 2, 3]]
    assert shared["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 3]]
    assert shared["segment_lengths"].tolist() == [3, 2, 3, 1]
    assert shared["segment_parents"].tolist() == [-1, 0, 0, 0]
    # The prompt's last token (row index 2) predicts the first token of every response.
    pairs = list(zip(*(shared[k].tolist() for k in ("logprob_positions", "logprob_targets", "logprob_sequence"))))
    assert pairs == [(2, 7, 0), (3, 2, 0), (2, 8, 1), (5, 9, 1), (6, 2, 1), (2, 3, 2)]
    # Scores are read at each response's last token; per-sequence metadata is that of the unshared layout.
    assert shared["score_positions"].tolist() == [4, 7, 8]
    for key in ("sequence_lengths", "group_index", "response_index"):
        assert shared[key].tolist() == unshared[key].tolist(), key
    assert group_num_tokens(group) == 3 * 3 + 6 and group_num_tokens(group, shared_prefix=True) == 3 + 6
    packs = pack_groups(Dataset.from_list([group] * 4), max_tokens_per_row=20, shared_prefix=True)
    assert packs["num_tokens"] == [18, 18]


def test_shared_batch_never_reaches_plain_attention(tmp_path, tokenizer):
    batch = PreferenceCollator(pad_token_id=0, shared_prefix=True)(random_groups(tokenizer, 2, 1).to_list())
    with pytest.raises(ValueError, match="attention metadata"):
        model_inputs(batch)
    with pytest.raises(ValueError, match="padding_free"):
        PreferenceCollator(pad_token_id=0, padding_free=False, shared_prefix=True)
    # Without padding_free the ring attention is not installed: the trainer keeps the unshared padded layout.
    trainer = build_trainer("disrm", tmp_path, tokenizer, 1, shared_prefix=True, padding_free=False)
    assert not trainer.data_collator.shared_prefix and "attention_mask" in first_batch(trainer)


# ---------------------------------------------------------------------------------------------------------------
# Trainers: shared == unshared


def first_batch(trainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def loss_and_grads(trainer):
    trainer.model.zero_grad()
    trainer.model.train()
    batch = first_batch(trainer)
    if isinstance(trainer, SimPOGRMTrainer):
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    else:
        loss, metrics = trainer.compute_loss(trainer.model, batch), None
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, batch, metrics


def build_trainer(kind, tmp_path, tokenizer, num_rejected, peft_config=None, **overrides):
    # Prompts longer than the responses, as in LongRM; four groups in one packed row.
    data = random_groups(tokenizer, 4, num_rejected, seed=7, prompt_len=(20, 40), completion_len=(1, 8))
    common = cpu_args(tmp_path / kind, **overrides)
    if kind == "grm":
        model = build_tiny_model("llama", "causal-lm", tokenizer, seed=3)
        args = SimPOGRMConfig(nll_loss_weight=0.5, **common)
        return SimPOGRMTrainer(
            model=model, args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft_config
        )
    model = build_tiny_model("qwen3", "seq-cls", tokenizer, seed=3)
    args = SimPODisRMConfig(center_rewards_coefficient=0.01, **common)
    return SimPODisRMTrainer(
        model=model, args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft_config
    )


def assert_shared_equals_unshared(shared, unshared):
    loss, grads, batch, metrics = shared
    ref_loss, ref_grads, ref_batch, ref_metrics = unshared
    assert "segment_parents" in batch and "segment_parents" not in ref_batch
    assert batch["group_index"].max() == 3  # four groups in the row
    assert batch["input_ids"].shape[1] < ref_batch["input_ids"].shape[1]  # the prompts are placed once
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name in grads:
        # 1e-5 relative to the tensor's scale: an entry that is a sum with cancellation keeps fp32 rounding of its
        # terms (the prompt's gradient is summed over its responses in a different order).
        scale = ref_grads[name].abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(
            grads[name], ref_grads[name], rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )
    for key in metrics or {}:
        if key != "tokens_per_step":
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("kind", ["grm", "disrm"])
@pytest.mark.parametrize("num_rejected", [1, 3])
def test_trainer_shared_equals_unshared(tmp_path, tokenizer, kind, num_rejected):
    unshared = loss_and_grads(build_trainer(kind, tmp_path, tokenizer, num_rejected, shared_prefix=False))
    shared = loss_and_grads(build_trainer(kind, tmp_path, tokenizer, num_rejected, shared_prefix=True))
    assert_shared_equals_unshared(shared, unshared)


@pytest.mark.parametrize("kind", ["grm", "disrm"])
def test_trainer_shared_equals_unshared_lora(tmp_path, tokenizer, kind):
    from peft import LoraConfig

    def lora():
        task = "CAUSAL_LM" if kind == "grm" else "SEQ_CLS"
        return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type=task, init_lora_weights=False)

    unshared = loss_and_grads(build_trainer(kind, tmp_path, tokenizer, 2, lora(), shared_prefix=False))
    shared = loss_and_grads(build_trainer(kind, tmp_path, tokenizer, 2, lora(), shared_prefix=True))
    assert any("lora" in name for name in shared[1])
    assert_shared_equals_unshared(shared, unshared)


# ---------------------------------------------------------------------------------------------------------------
# The ring (gloo): shared layout split over 2 and 4 ranks == unshared layout on one process


def slice_crossings(lengths, parents, world_size):
    """(documents crossing a slice boundary, responses lying wholly on another rank than all of their prefix)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    local = -(-cu[-1] // world_size)

    def ranks(a, b):
        return set(range(a // local, (b - 1) // local + 1))

    crossing = sum(len(ranks(cu[d], cu[d + 1])) > 1 for d in range(len(lengths)))
    remote = sum(p >= 0 and not ranks(cu[d], cu[d + 1]) & ranks(cu[p], cu[p + 1]) for d, p in enumerate(parents))
    return crossing, remote


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_shared_step_equals_single_process_unshared(tmp_path, tokenizer, world_size):
    import sp_trainer_worker as worker

    from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks

    run_on_gloo_ranks(
        worker.gloo_worker,
        world_size,
        str(tmp_path),
        ["shared_step"],
        timeout=900,
        preload=("trl_longrm.testing_utils",),
    )
    for kind in ("grm", "disrm"):
        ring = torch.load(tmp_path / f"shared_step_{kind}_world{world_size}.pt", weights_only=False)
        lengths, parents = ring["segment_lengths"].tolist(), ring["segment_parents"].tolist()
        crossing, remote = slice_crossings(lengths, parents, world_size)
        assert crossing >= world_size - 1 and remote >= 1, (kind, lengths, parents)
        reference = worker.one_step(
            worker.shared_step_trainer(
                kind, tmp_path / f"ref_{kind}", tokenizer, sequence_parallel_size=1, shared_prefix=False
            )
        )
        assert "segment_lengths" not in reference
        torch.testing.assert_close(ring["loss"], reference["loss"], rtol=1e-5, atol=1e-7, msg=f"{kind} loss")
        assert ring["grads"].keys() == reference["grads"].keys() and len(ring["grads"]) > 10
        for name, want in reference["grads"].items():
            scale = want.abs().max().item()
            torch.testing.assert_close(
                ring["grads"][name], want, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=f"{kind} {name}": f"{n}: {m}"
            )


@pytest.mark.parametrize("kind", ["grm", "disrm"])
def test_evaluate_and_row_budget_count_placed_tokens(tmp_path, tokenizer, kind):
    """`evaluate()` gives the same loss with and without sharing; with `max_tokens_per_row` the packs are sized by the
    tokens the shared row really holds."""
    losses = {}
    for shared in (False, True):
        data = random_groups(tokenizer, 6, 2, seed=11, prompt_len=(20, 40), completion_len=(1, 8))
        trainer = build_trainer(kind, tmp_path / str(shared), tokenizer, 2, shared_prefix=shared)
        losses[shared] = trainer.evaluate(eval_dataset=data)["eval_loss"]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)

    trainer = build_trainer(
        kind, tmp_path / "packed", tokenizer, 2, max_tokens_per_row=150, per_device_train_batch_size=1
    )
    packs = trainer.train_dataset
    assert len(packs) > 1 and max(packs["num_tokens"]) <= 150
    batches = list(trainer.get_train_dataloader())
    assert all("segment_parents" in batch for batch in batches)
    assert sorted(b["input_ids"].shape[1] for b in batches) == sorted(packs["num_tokens"])


class ReferenceVarlenOps(VarlenOps):
    """flash-attn's varlen forward/backward contract in plain PyTorch math (fp32, `varlen_reference`): the forward
    returns the lse `[H, Tq]`; the backward recomputes the softmax from the lse it is *given* and uses
    `rowsum(grad_out * out)` of the out it is given, as flash-attn's backward does (no autograd), so a wrong merge
    gives wrong gradients."""

    name = "reference"

    def __init__(self):
        self.key_tokens = {True: 0, False: 0}  # keys passed to forward calls, causal and full

    @staticmethod
    def _check(cu_q, cu_k, max_q, max_k):
        for qa, qb, ka, kb, _ in varlen_pieces(cu_q, cu_k, False):
            assert 0 < qb - qa <= max_q and 0 < kb - ka <= max_k

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        self._check(cu_q, cu_k, max_q, max_k)
        self.key_tokens[causal] += k.shape[0]
        return varlen_forward(q, k, v, cu_q, cu_k, scale, causal)

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        self._check(cu_q, cu_k, max_q, max_k)
        return varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, scale, causal)


def reference_varlen_fn(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """The plain (causal) varlen function of the same stand-in library, differentiable by autograd."""
    out = []
    group = q.shape[1] // k.shape[1]
    for qa, qb, ka, kb, mask in varlen_pieces(cu_q, cu_k, True):
        kk, vv = k[ka:kb].repeat_interleave(group, 1), v[ka:kb].repeat_interleave(group, 1)
        scores = (torch.einsum("qhd,khd->hqk", q[qa:qb], kk) * scale).masked_fill(~mask, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vv))
    return torch.cat(out)


def test_reference_ops_follow_the_contract():
    """The stand-in itself: its forward equals autograd-able attention, its backward from its own (out, lse) equals
    autograd, for causal (bottom-right) and full calls with grouped-query heads."""
    q, k, v, grad_out = random_problem(4, 2, 9, seed=3)
    q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    ops = ReferenceVarlenOps()
    cu_q, cu_k = torch.tensor([0, 4, 9]), torch.tensor([0, 4, 9])
    for causal in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = ops.forward(q, k, v, cu_q, cu_k, 5, 5, 0.3, causal)
        expected = []
        for (qa, qb), mask_causal in (((0, 4), causal), ((4, 9), causal)):
            block = F.scaled_dot_product_attention(
                *(t[qa:qb].transpose(0, 1) for t in leaves), is_causal=mask_causal, scale=0.3, enable_gqa=True
            )
            expected.append(block.transpose(0, 1))
        expected = torch.cat(expected)
        torch.testing.assert_close(out, expected.detach(), atol=1e-5, rtol=1e-5)
        grads = torch.autograd.grad(expected, leaves, grad_out)
        got = ops.backward(grad_out, q, k, v, out, lse, cu_q, cu_k, 5, 5, 0.3, causal)
        for g, e in zip(got, grads):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def stand_in_varlen_kernel():
    return VarlenKernel("stand_in", reference_varlen_fn, ReferenceVarlenOps())


@pytest.mark.parametrize("row", ROWS, ids=["three_groups", "with_unshared_document"])
def test_shared_row_varlen_merge_single_process(row, monkeypatch):
    """A varlen kernel (a CPU stand-in with flash-attn's contract) on a shared row, one process, plain autograd:
    prefix and own keys in two calls merged by their lse equal each response attended with its prompt, and each
    prompt's keys are passed once for all its responses, never once per response."""
    from trl_longrm.sequence_parallel import attention

    kernel = stand_in_varlen_kernel()
    monkeypatch.setattr(attention, "resolve_kernel", lambda *args: kernel)
    got, expected, _ = single_process_shared_row(row, 0.3)
    assert_all_close(got, expected, "varlen merge, one process")
    length, prompts = sum(shared_layout(row)[0]), sum(prompt for prompt, _ in row)
    assert kernel.ops.key_tokens == {True: length, False: prompts}


@pytest.mark.parametrize("row", ROWS, ids=["three_groups", "with_unshared_document"])
@pytest.mark.parametrize("group_size", [2, 3, 4])
@pytest.mark.parametrize("ops", ["reference", "cpu_flash_chunk_2", "cpu_flash", "cudnn_stand_in"])
def test_shared_row_varlen_merge_on_emulated_ring(row, group_size, ops):
    """The same merge slice by slice as ring ranks run it (kernel forward, and the recomputing backward the ring
    uses): responses whose prompt lies on another rank, pieces starting inside their document. With the stand-in
    of flash-attn's contract, with PyTorch's fused CPU attention (what CPU runs use), in query blocks of 2, and with
    cuDNN's ops as `TorchCudnnOps` calls them (a CPU stand-in, sequences of 3+ queries its own)."""
    from cudnn_stand_in import stand_in_cudnn_ops

    from trl_longrm.sequence_parallel.kernels import SharedPrefixVarlenKernel, TorchCpuFlashOps

    lengths, parents, _ = shared_layout(row)
    length, scaling = sum(lengths), 0.25
    q, k, v, grad_out = random_problem(6, 3, length, seed=group_size)
    expected = reference(q, k, v, grad_out, row, scaling)
    ops = {
        "reference": ReferenceVarlenOps(),
        "cpu_flash_chunk_2": TorchCpuFlashOps(query_chunk_size=2),
        "cpu_flash": TorchCpuFlashOps(),
        "cudnn_stand_in": stand_in_cudnn_ops(min_tokens=3)[0],
    }[ops]
    kernel = SharedPrefixVarlenKernel(ops)
    got, kv_starts = emulated_shared_ring(q, k, v, grad_out, lengths, parents, group_size, 1024, scaling, kernel)
    assert_all_close(got, expected, f"varlen merge, ring of {group_size}")
    local = -(-length // group_size)
    assert any(ks < rank * local for rank, ks in enumerate(kv_starts))


@pytest.mark.parametrize("row", ROWS, ids=["three_groups", "with_unshared_document"])
def test_shared_row_half_precision_dq_is_the_float32_one_cast(row):
    """The one-rank autograd path asks the merge for `dq` in the kernel's dtype (no float32 copy of the whole row's
    `dq`): bit for bit the float32 `dq` cast once, and the same key/value gradients, on bf16 inputs through PyTorch's
    fused CPU attention returning bf16 gradients as the CUDA kernels do."""
    from trl_longrm.sequence_parallel.kernels import TorchCpuFlashOps, _SharedPrefixLayout

    lengths, parents, _ = shared_layout(row)
    length = sum(lengths)
    q, k, v, grad_out = random_problem(6, 3, length, seed=5)
    meta = RingAttentionMetadata(cu_seqlens=tuple(itertools.accumulate([0, *lengths])), total_length=length,
                                 unpadded_length=length, local_start=0, local_length=length, group_size=1, rank=0,
                                 query_chunk_size=1024, segment_parents=tuple(parents))  # fmt: skip
    layout = _SharedPrefixLayout.of(meta, q.device)
    assert layout.has_b

    class KernelDtypeOps(TorchCpuFlashOps):
        """Gradients in the inputs' dtype, as flash-attn and torch's CUDA varlen kernels return them."""

        def backward(self, grad_out, q, *args):
            return tuple(t.to(q.dtype) for t in super().backward(grad_out, q, *args))

    ops = KernelDtypeOps()
    q, k, v = (t.transpose(0, 1).contiguous().bfloat16() for t in (q, k, v))
    grad_out = grad_out.bfloat16()
    out, lse = layout.forward(ops, q, k, v, 0.25)
    want = layout.backward(ops, grad_out, q, k, v, out, lse, 0.25)
    got = layout.backward(ops, grad_out, q, k, v, out, lse, 0.25, dq_dtype=torch.bfloat16)
    assert want[0].dtype == torch.float32 and got[0].dtype == torch.bfloat16
    assert torch.equal(got[0], want[0].to(torch.bfloat16))
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["torch", "flash_attn", "cudnn"])
@pytest.mark.parametrize("group_size", [1, 4])
def test_shared_row_cuda_varlen_kernels(backend, group_size):
    """The CUDA libraries (torch varlen_attn / flash-attn, bf16) through the shared-prefix merge, against the fp32
    reference of the unshared layout. Runs only where a GPU is present."""
    from trl_longrm.sequence_parallel.kernels import SharedPrefixVarlenKernel, is_flash_attn_available

    if backend == "flash_attn" and not is_flash_attn_available():
        pytest.skip("flash-attn is not installed")
    row = [(300, [40, 17, 64]), (5, [3, 90]), (0, [33]), (128, [1, 77, 12, 30])]
    lengths, parents, _ = shared_layout(row)
    q, k, v, grad_out = random_problem(8, 2, sum(lengths), seed=7, head_dim=64)
    q, k, v, grad_out = (t.bfloat16().float() for t in (q, k, v, grad_out))
    expected = reference(q, k, v, grad_out, row, 0.125)
    kernel = resolve_kernel(backend, torch.device("cuda"), torch.bfloat16)
    assert kernel.ops is not None, f"{kernel.name}: no forward-with-lse / backward-from-lse entry points found"
    ops = kernel.ops
    if backend == "cudnn":  # cuDNN given every sequence of 32+ queries (2048+ by default)
        ops = type(ops)(ops.fallback, min_tokens=32)
    shared = SharedPrefixVarlenKernel(ops)
    cuda = [t.cuda().bfloat16() for t in (q, k, v, grad_out)]
    got, _ = emulated_shared_ring(*cuda, lengths, parents, group_size, 1024, 0.125, shared)
    for name, g, e in zip(["out", "dq", "dk", "dv"], got, expected):
        torch.testing.assert_close(g.float().cpu(), e, atol=3e-2, rtol=3e-2, msg=lambda m, n=name: f"{n}: {m}")


def test_varlen_kernels_take_shared_rows_through_the_merge(tmp_path, monkeypatch):
    """A varlen kernel whose library exposes the lse entry points attends shared rows by the merge; one without them
    falls back to the torch kernel with a warning, and an explicit flash_attn backend is refused, not ignored."""
    from trl_longrm.sequence_parallel.attention import _shared_prefix_kernel
    from trl_longrm.sequence_parallel.kernels import SharedPrefixVarlenKernel
    from trl_longrm.trainers import common

    meta = shared_row_metadata(torch.tensor([3, 2, 2]), torch.tensor([-1, 0, 0]))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(NotImplementedError, match="varlen"):
        meta.varlen_layout(cpu)
    assert isinstance(_shared_prefix_kernel(meta, stand_in_varlen_kernel(), cuda), SharedPrefixVarlenKernel)
    on_cpu = _shared_prefix_kernel(meta, TorchBlockKernel(), cpu)
    assert isinstance(on_cpu, SharedPrefixVarlenKernel) and on_cpu.ops.name == "torch_cpu_flash"
    assert isinstance(_shared_prefix_kernel(meta, TorchBlockKernel(), cuda), TorchBlockKernel)  # fp32 on CUDA
    with pytest.warns(UserWarning, match="pure PyTorch kernel"):
        assert isinstance(_shared_prefix_kernel(meta, VarlenKernel("torch_varlen", None), cuda), TorchBlockKernel)
    meta.backend = "flash_attn"
    with pytest.raises(NotImplementedError, match="shared_prefix=False"):
        _shared_prefix_kernel(meta, VarlenKernel("flash_attn", None), cuda)
    # The config refuses flash_attn + shared_prefix only where flash-attn is present without the backward we need.
    monkeypatch.setattr(common, "is_flash_attn_available", lambda: True)
    monkeypatch.setattr(common.FlashAttnVarlenOps, "load", classmethod(lambda cls: None))
    with pytest.raises(ValueError, match="_flash_attn_varlen_backward"):
        SimPOGRMConfig(**cpu_args(tmp_path, shared_prefix=True, ring_attn_backend="flash_attn"))
    monkeypatch.setattr(common.FlashAttnVarlenOps, "load", classmethod(lambda cls: ReferenceVarlenOps()))
    SimPOGRMConfig(**cpu_args(tmp_path, shared_prefix=True, ring_attn_backend="flash_attn"))


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's values back to the host (`tolist`, `item`, a truth value, `int`, ...): on
    a CUDA tensor each waits for every kernel queued before it."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prefix_rows", "packed_rows"])
def test_cudnn_attention_reads_nothing_back_from_the_device(shared):
    """`TorchCudnnOps` plans its calls (one per long sequence, varlen runs for the rest) from the sequence boundaries;
    read back from a GPU they cost a wait for the GPU three times a layer (at Qwen3-0.6B's size the device was busy
    59% of a step). The boundaries carry their host values from where the layout is made (`boundary_tensors`): on a
    ring's ranks (forward, and the backward that recomputes it) and under autograd on one process, with the cuDNN
    stand-in (sequences of 3+ queries its own, the others on the fallback), no value is read back while attending."""
    from cudnn_stand_in import stand_in_cudnn_ops
    from test_sequence_parallel_attention import emulated_ring

    from trl_longrm.sequence_parallel.kernels import SharedPrefixVarlenKernel, VarlenKernel, varlen_function_of

    ops, cudnn = stand_in_cudnn_ops(min_tokens=3)
    kernel = SharedPrefixVarlenKernel(ops) if shared else VarlenKernel(ops.name, varlen_function_of(ops), ops)
    lengths, parents, _ = shared_layout(ROWS[0]) if shared else ([23, 3, 11, 40, 1], None, None)
    q, k, v, grad_out = random_problem(6, 3, sum(lengths), seed=3)
    counter = HostReads()
    with counter:
        if shared:
            emulated_shared_ring(q, k, v, grad_out, lengths, parents, 2, 1024, 0.25, kernel)
        else:
            emulated_ring(kernel, q, k, v, grad_out, lengths, 2, 1024, 0.25)
            meta = RingAttentionMetadata(cu_seqlens=tuple(itertools.accumulate([0, *lengths])),
                                         total_length=sum(lengths), unpadded_length=sum(lengths), local_start=0,
                                         local_length=sum(lengths), group_size=1, rank=0, query_chunk_size=1024)  # fmt: skip
            leaves = [t.transpose(0, 1).clone().requires_grad_() for t in (q, k, v)]
            kernel.forward(*leaves, meta, 0.25).backward(grad_out)
    assert cudnn.calls["forward"] and cudnn.calls["backward"]
    assert counter.reads == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_cudnn_attention_does_not_synchronize():
    """On a GPU, through the real cuDNN ops: a packed row's attention forward and backward (sequences long enough for
    cuDNN, and a short one on torch's varlen fallback) with torch's synchronization debug mode on: no call waits for
    the GPU (`torch.cuda.set_sync_debug_mode` warns on each that would)."""
    import warnings

    from trl_longrm.sequence_parallel.config import SequenceParallelConfig
    from trl_longrm.sequence_parallel.kernels import TorchCudnnOps, VarlenKernel, varlen_function_of
    from trl_longrm.sequence_parallel.sharding import packed_row_metadata

    ops = TorchCudnnOps.load()
    kernel = VarlenKernel(ops.name, varlen_function_of(ops), ops)
    lengths = [3000, 2100, 77]
    meta = packed_row_metadata(torch.cat([torch.arange(n) for n in lengths]), SequenceParallelConfig())
    q, k, v = (torch.randn(sum(lengths), h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (16, 8, 8))  # fmt: skip
    kernel.forward(q, k, v, meta, 128**-0.5).sum().backward()  # warm-up: the layout and cuDNN's plans made once
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(2):  # every layer of a step reuses the layout
                kernel.forward(q, k, v, meta, 128**-0.5).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (The debug mode's own notice that it is a prototype is not a synchronization.)
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert syncs == [], syncs
