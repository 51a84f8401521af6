"""Exact attention over a packed row split across a ring group, as a transformers attention implementation.

Each rank keeps the queries of its slice and all-gathers the keys/values of the whole ring, `ring_head_stride` key/value
heads at a time (gather a chunk, attend with the query heads that use it, free it, next chunk; the next chunk's gather
is in flight while the current one is attended), so the peak memory is two chunks of the gathered row. The backward
gathers each chunk again, runs the kernel's backward from the forward's out and lse (the pure PyTorch fallback
recomputes the attention) and sends the key/value gradients back to their owners with a summing reduce-scatter,
overlapped with the next chunk. Masking is causal within each document, with the
document boundaries of the global row and this rank's offset in it (from `RingAttentionMetadata`).

Without metadata (`ring_attn_meta=None`) the same kernels attend a packed single-process batch document-causally, the
documents being read from `position_ids`: trainers get one attention path for packed rows. With nothing to gather on
one process, the kernel (pure PyTorch, or a varlen kernel) then runs under plain autograd (no recompute in backward).

A shared-prefix row (a group's prompt once, then each response attending to it) cannot be read from `position_ids`;
it always comes with metadata carrying `segment_parents`. It is attended in two calls (each piece causally on its own,
then each prefix's responses against it) merged by their log-sum-exp (`SharedPrefixVarlenKernel`), with the varlen
library on CUDA and PyTorch's fused CPU attention on CPU; the block-masked pure PyTorch kernel is the fallback.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import is_fake

from ..memory.selective_checkpointing import keeps_attention_outputs
from .collectives import all_to_all_autograd, start_all_gather_dim0, start_reduce_scatter_dim0
from .config import SequenceParallelConfig
from .kernels import SharedPrefixVarlenKernel, TorchBlockKernel, TorchCpuFlashOps, VarlenKernel, resolve_kernel
from .sharding import RingAttentionMetadata, packed_row_metadata
from .validation import check_ring_head_stride, validate_ring_attention_model


if TYPE_CHECKING:
    from transformers import PreTrainedModel


RING_ATTENTION_NAME = "longrm_ring"


def _head_chunks(num_heads: int, num_kv_heads: int, stride: int | None):
    stride = stride or num_kv_heads
    group = num_heads // num_kv_heads
    for kv_lo in range(0, num_kv_heads, stride):
        kv_hi = kv_lo + stride
        yield kv_lo, kv_hi, kv_lo * group, kv_hi * group


def _traced_head_chunks(chunks: list, q: torch.Tensor) -> list:
    """The head chunks to run: all of them, except under the memory plan's trace (fake tensors, no values), where
    the middle ones of equal width are left out. Each chunk allocates and frees the same buffers as the one before it
    once the pipeline is full (the next chunk's gather in flight in forward, the last chunk's scatter in backward), so
    the first three chunks and the last one show every state the whole loop goes through: the same peak, with a
    fraction of the trace's operations (an 8B model's 8 key/value heads, one a chunk: 4 chunks instead of 8). Not
    under selective checkpointing, which keeps every chunk's attention outputs."""
    if len(chunks) <= 4 or not is_fake(q) or keeps_attention_outputs():
        return chunks
    width = chunks[0][1] - chunks[0][0]
    if any(c[1] - c[0] != width for c in chunks[:-1]):
        return chunks
    return chunks[:3] + chunks[-1:]


class _Gather:
    """One head chunk's all-gather of keys/values, issued (`start`) and later read (`keys_values`)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, meta: RingAttentionMetadata):
        self.meta, self.split = meta, k.shape[1] if k.shape[-1] == v.shape[-1] else None
        if meta.group is None:
            self.local, self.pending = (k, v), None
        elif self.split is not None:  # one collective for both
            self.pending = [start_all_gather_dim0(torch.cat([k, v], dim=1), meta.group)]
        else:
            self.pending = [start_all_gather_dim0(k, meta.group), start_all_gather_dim0(v, meta.group)]

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the global row, in its order, over `meta.key_span()` (every key a local query sees):
        `[span_end - span_start, heads, D]`."""
        meta, span = self.meta, self.meta.key_span()
        if self.pending is None:
            k, v = self.local
            return k[span[0] : span[1]], v[span[0] : span[1]]
        for _, work in self.pending:
            work.wait()
        gathered = [meta.to_global_order(out, span=span) for out, _ in self.pending]
        self.pending = None  # the rank-major buffers are freed once reordered
        if self.split is not None:
            return gathered[0][:, : self.split], gathered[0][:, self.split :]
        return gathered[0], gathered[1]


def _gathered_head_chunks(q, k, v, meta: RingAttentionMetadata):
    """`(kv_lo, kv_hi, q_lo, q_hi, k_all, v_all)` for each head chunk (`meta.ring_head_stride` key/value heads), the
    next chunk's all-gather issued before the current chunk is handed out: the collective runs while the current
    chunk is attended, so two chunks' gathered keys/values are alive at a time (the caller drops each when done)."""
    chunks = _traced_head_chunks(list(_head_chunks(q.shape[1], k.shape[1], meta.ring_head_stride)), q)
    start = lambda c: _Gather(k[:, c[0] : c[1]], v[:, c[0] : c[1]], meta)  # noqa: E731
    pending = start(chunks[0])
    for index, chunk in enumerate(chunks):
        current, pending = pending, start(chunks[index + 1]) if index + 1 < len(chunks) else None
        k_all, v_all = current.keys_values()
        del current
        yield (*chunk, k_all, v_all)
        del k_all, v_all


class _Scatter:
    """One head chunk's key/value gradients summed over the ranks and scattered to their owners, issued (`start`)
    and later read (`result`). The sum over ranks stays in the kernels' float32 (not rounded to half precision at
    each step)."""

    def __init__(self, dk: torch.Tensor, dv: torch.Tensor, meta: RingAttentionMetadata):
        self.split = dk.shape[1] if dk.shape[-1] == dv.shape[-1] else None
        if meta.group is None:
            self.local, self.pending = (dk, dv), None
            return
        self.pending = []
        for grad in [torch.cat([dk, dv], dim=1)] if self.split is not None else [dk, dv]:
            full = meta.span_in_rank_major_order(grad, meta.key_span())
            self.pending.append(start_reduce_scatter_dim0(full, meta.group))

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's `(dk, dv)` summed over the ring."""
        if self.pending is None:
            return self.local
        for _, work in self.pending:
            work.wait()
        grads = [out for out, _ in self.pending]
        if self.split is not None:
            return grads[0][:, : self.split], grads[0][:, self.split :]
        return grads[0], grads[1]


class _RingAttention(torch.autograd.Function):
    """q `[local_length, H, D]`, k/v `[local_length, Hkv, D]` -> out `[local_length, H, D]`. Each contiguous piece of
    the rank's tokens (`meta.pieces()`: several with the balanced and zigzag placements) is attended by the kernel
    on its own, against the keys of its documents.

    With a fused library (`kernel.reuses_forward`) the forward keeps the local out and lse (the size of q) and the
    backward calls the library's backward on them: the keys/values are gathered again (keeping them would cost the
    whole row per layer) but the attention is not recomputed. The pure PyTorch block kernel recomputes it."""

    @staticmethod
    def forward(ctx, q, k, v, meta, scaling, kernel):
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        reuse = kernel.reuses_forward
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device) if reuse else None
        span_start = meta.key_span()[0]
        for _, _, q_lo, q_hi, k_all, v_all in _gathered_head_chunks(q, k, v, meta):
            for offset, piece in meta.pieces():
                rows = slice(offset, offset + piece.local_length)
                keys = slice(piece.kv_start - span_start, piece.local_end - span_start)
                args = (q[rows, q_lo:q_hi], k_all[keys], v_all[keys], piece, scaling)
                if reuse:
                    out[rows, q_lo:q_hi], lse[q_lo:q_hi, rows] = kernel.forward_lse(*args)
                else:
                    out[rows, q_lo:q_hi] = kernel.forward(*args)
        ctx.save_for_backward(q, k, v, *((out, lse) if reuse else ()))
        ctx.meta, ctx.scaling, ctx.kernel = meta, scaling, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, *saved = ctx.saved_tensors
        meta, scaling, kernel = ctx.meta, ctx.scaling, ctx.kernel
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        span_start = meta.key_span()[0]
        scatters = []
        for kv_lo, kv_hi, q_lo, q_hi, k_all, v_all in _gathered_head_chunks(q, k, v, meta):
            # The key span's gradients, summed over the pieces and then over the ranks in float32.
            dk_all = torch.zeros(k_all.shape, dtype=torch.float32, device=k_all.device)
            dv_all = torch.zeros(v_all.shape, dtype=torch.float32, device=v_all.device)
            for offset, piece in meta.pieces():
                rows = slice(offset, offset + piece.local_length)
                keys = slice(piece.kv_start - span_start, piece.local_end - span_start)
                inputs = (q[rows, q_lo:q_hi], k_all[keys], v_all[keys])
                if saved:
                    out, lse = saved
                    dq_c, dk_p, dv_p = kernel.backward_from(
                        *inputs, out[rows, q_lo:q_hi], lse[q_lo:q_hi, rows], grad_out[rows, q_lo:q_hi], piece, scaling
                    )  # fmt: skip
                else:
                    dq_c, dk_p, dv_p = kernel.backward(*inputs, grad_out[rows, q_lo:q_hi], piece, scaling)
                dq[rows, q_lo:q_hi] = dq_c
                dk_all[keys] += dk_p
                dv_all[keys] += dv_p
            # The reduce-scatter runs while the next chunk is attended; at most two are in flight.
            scatters.append(((kv_lo, kv_hi), _Scatter(dk_all, dv_all, meta)))
            del dk_all, dv_all
            if len(scatters) == 2:
                (lo, hi), scatter = scatters.pop(0)
                dk[:, lo:hi], dv[:, lo:hi] = scatter.result()
        for (lo, hi), scatter in scatters:
            dk[:, lo:hi], dv[:, lo:hi] = scatter.result()
        return dq, dk, dv, None, None, None


def ulysses_kv_heads(num_heads: int, num_kv_heads: int, ulysses_size: int) -> list[list[int]]:
    """For each rank of a Ulysses group, the key/value heads its query heads (`num_heads / ulysses_size` consecutive
    ones) use: `num_kv_heads / ulysses_size` of them, or one replicated head when there are fewer key/value heads than
    ranks (grouped-query attention, as DeepSpeed's Ulysses replicates them).

    Example:
    ```python
    >>> ulysses_kv_heads(8, 2, 4)  # 4 ranks, 2 KV heads: each used by two ranks
    [[0], [0], [1], [1]]
    ```
    """
    per_rank, group = num_heads // ulysses_size, num_heads // num_kv_heads
    return [sorted({h // group for h in range(r * per_rank, (r + 1) * per_rank)}) for r in range(ulysses_size)]


def _heads_to_tokens(x: torch.Tensor, meta: RingAttentionMetadata, heads: list[list[int]] | None = None):
    """`[local, heads, D]` on each rank of the Ulysses group -> `[group's tokens, heads of this rank, D]`: the tokens of
    the group's slices in order, for this rank's share of the heads (`heads[r]` for rank r, else an equal split)."""
    size = meta.ulysses_size
    if heads is not None and any(h != list(range(r * len(h), (r + 1) * len(h))) for r, h in enumerate(heads)):
        x = x.index_select(1, torch.tensor([i for h in heads for i in h], device=x.device))  # replicated KV heads
    blocks = x.unflatten(1, (size, -1)).transpose(0, 1)  # [P, local, heads / P, D]: block r goes to rank r
    return all_to_all_autograd(blocks, meta.ulysses_group).flatten(0, 1)


def _tokens_to_heads(out: torch.Tensor, meta: RingAttentionMetadata):
    """The inverse of `_heads_to_tokens` for the attention output: `[group's tokens, H / P, D]` -> `[local, H, D]`."""
    blocks = all_to_all_autograd(out.unflatten(0, (meta.ulysses_size, -1)), meta.ulysses_group)
    return blocks.transpose(0, 1).flatten(1, 2)


def _attend(q, k, v, meta: RingAttentionMetadata, scaling: float, kernel, device):
    """q/k/v of the tokens `meta` describes: locally under autograd without a ring, else the ring attention."""
    if meta.group is None:
        # No ring (one process, or Ulysses alone): nothing to gather, so `_RingAttention` (which gathers each head
        # chunk again in the backward to bound the gathered memory) only costs time. All heads at once under plain
        # autograd let the fused kernels' own backward (SDPA's, flash-attn's varlen) reuse the forward's log-sum-exp: ~30%
        # shorter packed DisRM steps on CPU.
        return kernel.forward(q, k, v, meta, scaling)
    return _RingAttention.apply(q, k, v, meta, scaling, _ring_kernel(meta, kernel, device))


def _check_call(module, query, key, attention_mask, dropout, kwargs):
    where = f"{RING_ATTENTION_NAME} attention ({type(module).__name__})"
    if attention_mask is not None:
        raise ValueError(
            f"{where} received an attention mask; it takes packed rows whose documents are given by position_ids "
            "(or ring_attn_meta). Pass position_ids instead of attention_mask."
        )
    if dropout:
        raise NotImplementedError(f"{where} does not support attention dropout (got {dropout}); set it to 0.")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{where} does not support attention logit softcapping.")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(f"{where} does not support sliding-window attention.")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{where} does not support attention sinks.")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise NotImplementedError(f"{where} supports causal (decoder) attention only.")
    if key.shape[2] != query.shape[2]:
        raise NotImplementedError(
            f"{where} got {query.shape[2]} queries but {key.shape[2]} keys: a KV cache or cross-attention is not "
            "supported. Call the model with use_cache=False (switch to 'sdpa' for generation)."
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{where}: {query.shape[1]} query heads are not a multiple of {key.shape[1]} KV heads.")


def _to_attention_dtype(query, key, value):
    """q/k/v in the one dtype the kernels compute in.

    Under autocast (TRL's default `bf16=True` on float32 weights, or the usual LoRA setup) the projections come out in
    the autocast dtype, but a norm between projection and attention can return float32 (Qwen3's `q_norm`/`k_norm`
    multiply by a float32 weight), so the three reach us in mixed dtypes. SDPA, which stock models call here, is on
    autocast's lower-precision list and casts its inputs to the autocast dtype: so do we, which also picks the
    kernel by that dtype. Without autocast the three are promoted to their common dtype."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in (query, key, value))


def _shared_prefix_kernel(meta: RingAttentionMetadata, kernel, device: torch.device):
    """The kernel for a shared-prefix row, `kernel` being the one resolved for ordinary rows."""
    if isinstance(kernel, TorchBlockKernel):
        # On CPU, PyTorch's fused CPU attention with its lse serves the merge below; its masked blocks (the block
        # kernel's way of showing a response its prompt) would keep [queries, prompt] scores for the backward.
        ops = TorchCpuFlashOps.load(meta.query_chunk_size) if device.type == "cpu" else None
        return SharedPrefixVarlenKernel(ops) if ops is not None else kernel
    ops = getattr(kernel, "ops", None)
    if ops is not None:
        return SharedPrefixVarlenKernel(ops)
    if meta.backend == "flash_attn":
        raise NotImplementedError(
            f"{RING_ATTENTION_NAME} attention: ring_attn_backend='flash_attn' cannot attend a shared-prefix row "
            "(responses attending to their group's prompt) with this flash-attn: its varlen backward "
            "(flash_attn_interface._flash_attn_varlen_backward) was not found with the arguments we pass. Set "
            "shared_prefix=False, or ring_attn_backend='auto' or 'torch' to use the pure PyTorch kernel for such rows."
        )
    warnings.warn(
        f"Shared-prefix rows are attended by the pure PyTorch kernel, not by {kernel.name!r}: this version does not "
        "expose the varlen backward the shared-prefix merge needs; set shared_prefix=False to use it.",
        stacklevel=3,
    )
    return TorchBlockKernel()


def _ring_kernel(meta: RingAttentionMetadata, kernel, device: torch.device):
    """The kernel a ring uses: on CPU, PyTorch's fused CPU attention with its lse (the ops SDPA dispatches to) in
    place of the block kernel, so that the ring's backward reuses the forward's out and lse instead of recomputing
    each block."""
    if isinstance(kernel, TorchBlockKernel) and device.type == "cpu":
        ops = TorchCpuFlashOps.load(meta.query_chunk_size)
        if ops is not None:
            return VarlenKernel(ops.name, None, ops)
    return kernel


def ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    ring_attn_meta: RingAttentionMetadata | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention implementation registered as `"longrm_ring"`.

    query `[B, H, L, D]`, key/value `[B, Hkv, L, D]` -> (`[B, L, H, D]`, None). With `ring_attn_meta`, `B == 1` and `L`
    is this rank's slice of the row described by the metadata; without, each row of the batch is a packed row whose
    documents restart their `position_ids` at 0.

    Example:
    ```python
    >>> out, _ = ring_attention_forward(attn_module, q, k, v, None, scaling=0.125, ring_attn_meta=shard.attention_meta)
    ```
    """
    _check_call(module, query, key, attention_mask, dropout, kwargs)
    query, key, value = _to_attention_dtype(query, key, value)
    batch, _, length, head_dim = query.shape
    scaling = head_dim**-0.5 if scaling is None else scaling
    if ring_attn_meta is None:
        if position_ids is None:
            position_ids = torch.arange(length, device=query.device).unsqueeze(0)
        position_ids = position_ids.expand(batch, -1)
        metas = [packed_row_metadata(position_ids[b]) for b in range(batch)]
    else:
        if batch != 1 or length != ring_attn_meta.local_length:
            raise ValueError(
                f"{RING_ATTENTION_NAME} attention: ring_attn_meta describes a slice of {ring_attn_meta.local_length} "
                f"tokens of one row, but the model got a batch of shape [{batch}, {length}]. Pass exactly the "
                "tensors returned by shard_packed_row."
            )
        metas = [ring_attn_meta]
    outputs = []
    for b, meta in enumerate(metas):
        check_ring_head_stride(
            meta.ring_head_stride, max(key.shape[1] // meta.ulysses_size, 1), key.shape[1], meta.ulysses_size
        )
        kernel = resolve_kernel(meta.backend, query.device, query.dtype)
        if meta.has_shared_prefixes:
            kernel = _shared_prefix_kernel(meta, kernel, query.device)
        q, k, v = (t[b].transpose(0, 1) for t in (query, key, value))
        if meta.ulysses_size == 1:
            outputs.append(_attend(q, k, v, meta, scaling, kernel, query.device))
            continue
        # Ulysses: all-to-all over heads, attend the group's tokens (the whole row without a ring) for this rank's
        # heads with the same kernels and masks, all-to-all the output back.
        kv_heads = ulysses_kv_heads(q.shape[1], k.shape[1], meta.ulysses_size)
        q, k, v = _heads_to_tokens(q, meta), _heads_to_tokens(k, meta, kv_heads), _heads_to_tokens(v, meta, kv_heads)
        out = _attend(q, k, v, meta.attention_view(), scaling, kernel, query.device)
        outputs.append(_tokens_to_heads(out, meta))
    return torch.stack(outputs), None


def register_ring_attention() -> str:
    """Register the ring attention with transformers' `AttentionInterface`; returns its name.

    No attention mask function is registered on purpose: for this name `create_causal_mask` returns None, and the
    documents come from `position_ids` / `ring_attn_meta`.

    Example:
    ```python
    >>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register_ring_attention())
    ```
    """
    # transformers is imported here only: the attention math and the collectives do not need it (faster workers).
    from transformers import AttentionInterface

    AttentionInterface.register(RING_ATTENTION_NAME, ring_attention_forward)
    return RING_ATTENTION_NAME


def apply_ring_attention(model: PreTrainedModel, config: SequenceParallelConfig | None = None) -> PreTrainedModel:
    """Check that `model` can use the ring attention with `config`, then switch it (in place) to `"longrm_ring"`.

    Raises a clear error for models that do not dispatch attention through `ALL_ATTENTION_FUNCTIONS` or use
    features the ring attention lacks (sliding windows, softcapping, attention dropout), for a `ring_head_stride`
    not dividing the number of key/value heads, and for the flash_attn backend without flash-attn.

    Example:
    ```python
    >>> model = apply_ring_attention(model, SequenceParallelConfig(sequence_parallel_size=2))
    >>> shard = shard_packed_row(ids, pos, labels, groups=groups)
    >>> logits = model(**shard.model_inputs()).logits
    ```
    """
    config = config or SequenceParallelConfig()
    base = validate_ring_attention_model(model, config)
    name = register_ring_attention()
    base.set_attn_implementation(name)
    if base.config._attn_implementation != name:
        raise RuntimeError(
            f"{type(base).__name__} kept attn_implementation={base.config._attn_implementation!r} after "
            f"set_attn_implementation({name!r}); its attention cannot be replaced."
        )
    return model
