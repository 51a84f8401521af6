"""Whole tiny models with the ring attention: a packed row split over 2 gloo ranks gives the loss and the parameter
gradients of the single-process full-row computation with stock sdpa attention (use_cache=False)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trl_longrm.sequence_parallel import (
    RING_ATTENTION_NAME,
    SequenceParallelConfig,
    apply_ring_attention,
    gather_sequence,
    init_sequence_parallel_groups,
    packed_row_metadata,
    shard_packed_row,
)
from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks
from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model


DOC_LENGTHS = [7, 12, 4, 14]  # 37 tokens: padded to 38 for 2 ranks; documents 2 and 4 cross the slice boundary
PROMPT_LENGTH = 2  # the first tokens of each document carry no loss
PRELOAD = ("trl_longrm.testing_utils",)  # imported once by the fork server the workers come from


def packed_row(vocab_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (1, sum(DOC_LENGTHS)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in DOC_LENGTHS])[None]
    labels = ids.clone()
    labels[pos < PROMPT_LENGTH] = -100
    return ids, pos, labels


def reference_shift_labels(labels):
    """Next-token labels built document by document (independent of the sharding code)."""
    out, start = [], 0
    for n in DOC_LENGTHS:
        doc = labels[0, start : start + n]
        out.append(torch.cat([doc[1:], torch.tensor([-100])]))
        start += n
    return torch.cat(out)[None]


def token_logps(logits, shift_labels):
    logps = torch.log_softmax(logits.float(), dim=-1)
    logps = logps.gather(-1, shift_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logps * (shift_labels != -100)


def pairwise_loss(logps, shift_labels):
    """SimPO-like: per-document mean log-prob, documents (0, 1) and (2, 3) as chosen/rejected pairs."""
    means, start = [], 0
    for n in DOC_LENGTHS:
        mask = shift_labels[0, start : start + n] != -100
        means.append(logps[0, start : start + n].sum() / mask.sum())
        start += n
    return -F.logsigmoid(means[0] - means[1]) - F.logsigmoid(2.0 * (means[2] - means[3]))


def _full_row_reference(arch, tokenizer, ids, pos, labels):
    model = build_tiny_model(arch, "causal-lm", tokenizer, seed=0)
    assert model.config._attn_implementation == "sdpa"
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    loss = pairwise_loss(token_logps(logits, reference_shift_labels(labels)), reference_shift_labels(labels))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _enable_checkpointing(model):
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def _model_worker(rank, world_size, tokenizer):
    groups = init_sequence_parallel_groups(world_size)
    ids, pos, labels = packed_row(len(tokenizer))
    for arch, checkpointing in [("llama", False), ("qwen3", True)]:
        ref_loss, ref_grads = _full_row_reference(arch, tokenizer, ids, pos, labels)
        config = SequenceParallelConfig(sequence_parallel_size=world_size, ring_head_stride=1, ring_query_chunk_size=8)
        model = apply_ring_attention(build_tiny_model(arch, "causal-lm", tokenizer, seed=0), config)
        assert model.config._attn_implementation == RING_ATTENTION_NAME
        if checkpointing:  # the recompute must see the same metadata as its forward
            _enable_checkpointing(model)
        shard = shard_packed_row(ids, pos, labels, groups=groups, config=config, pad_token_id=tokenizer.pad_token_id)
        logits = model(**shard.model_inputs()).logits
        # The row is padded to a multiple of 2 x world_size (zigzag placement: two chunks per rank).
        assert logits.shape[1] == -(-sum(DOC_LENGTHS) // (2 * world_size)) * 2
        logps = gather_sequence(token_logps(logits, shard.shift_labels), shard.attention_meta)
        full_labels = gather_sequence(shard.shift_labels, shard.attention_meta)
        torch.testing.assert_close(full_labels, reference_shift_labels(labels), rtol=0, atol=0)
        loss = pairwise_loss(logps, full_labels)
        loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss, atol=1e-5, rtol=1e-5)
        # Convention of the gather (backward = sum over the ring): each rank holds group_size x its share, so the
        # ring *average* of the parameter gradients (DDP's all-reduce mean) is exactly the full-row gradient.
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=groups.ring_group)
            torch.testing.assert_close(
                grad / world_size, ref_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=f"{arch} {name}": f"{n}: {m}"
            )
        # A sequence score (DisRM): per-token scores of the backbone's hidden states, gathered, read at document ends.
        model.zero_grad()
        hidden = model.model(**shard.model_inputs()).last_hidden_state
        scores = gather_sequence(hidden.sum(-1), shard.attention_meta)[
            0, shard.attention_meta.document_last_token_indices()
        ]
        ref_model = build_tiny_model(arch, "causal-lm", tokenizer, seed=0)
        ref_hidden = ref_model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        ends = torch.tensor(DOC_LENGTHS).cumsum(0) - 1
        torch.testing.assert_close(scores, ref_hidden.sum(-1)[0, ends], atol=1e-4, rtol=1e-5)


@pytest.mark.slow
def test_tiny_models_on_two_ranks_match_full_row():
    run_on_gloo_ranks(_model_worker, 2, build_chat_tokenizer(), preload=PRELOAD)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("with_meta", [False, True])
def test_single_process_packed_rows_match_sdpa(arch, with_meta):
    """No sequence parallelism: the same attention on a batch of two packed rows equals sdpa (logits, gradients)."""
    tokenizer = build_chat_tokenizer()
    ids, pos, _ = packed_row(len(tokenizer))
    ids = torch.cat([ids, ids.flip(1)])
    other_docs = torch.cat([torch.arange(n) for n in reversed(DOC_LENGTHS)])[None]
    pos = torch.cat([pos, other_docs])  # the second row has other document boundaries
    reference = build_tiny_model(arch, "causal-lm", tokenizer, seed=0)
    ref_logits = reference(input_ids=ids, position_ids=pos, use_cache=False).logits
    ref_logits.square().mean().backward()
    model = apply_ring_attention(build_tiny_model(arch, "causal-lm", tokenizer, seed=0))
    if with_meta:  # one row at a time, boundaries computed once instead of in every layer
        logits = torch.cat(
            [
                model(
                    input_ids=ids[b : b + 1],
                    position_ids=pos[b : b + 1],
                    use_cache=False,
                    ring_attn_meta=packed_row_metadata(pos[b]),
                ).logits
                for b in range(2)
            ]
        )
    else:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    logits.square().mean().backward()
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)
