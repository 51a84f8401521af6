"""Attention kernels for the local queries of one ring rank against the gathered keys of its documents.

Tensors are token-major: queries `[local_length, Hq, D]`, keys/values `[local_end - kv_start, Hkv, D]` (the global
row's keys from the start of the document of this rank's first token up to its last token; no local query sees keys
outside that range). Query head `h` uses key/value head `h // (Hq / Hkv)` (grouped-query attention).

Kernels with a fused library's entry points (`reuses_forward`: flash-attn, torch's varlen, PyTorch's fused CPU
attention) return the log-sum-exp with the output (`forward_lse`) and take both back in the backward
(`backward_from`), as flash-attn's own autograd does: the ring keeps the local out and lse (the size of q) and never
recomputes the attention. The pure PyTorch block kernel, the fallback where no such library serves the dtype and
device, recomputes each block in its backward (`backward`). Gradients come back in float32: they are summed over
blocks here and over ranks by the ring in float32, then cast once to the inputs' dtype (as ring-flash-attention
accumulates), since bf16 sums over 64 blocks lose ~1e-2 relative.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..memory.selective_checkpointing import keeps_attention_outputs
from .sharding import RingAttentionMetadata


def is_flash_attn_available() -> bool:
    """Whether flash-attn 2's varlen interface can be imported. A flash-attn-4-only install (`flash_attn.cute`) makes
    `import flash_attn` succeed as a namespace package without it, and counts as absent."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:  # a broken build (e.g. CUDA mismatch), or no flash-attn 2 interface: absent
        return False
    return True


def _deterministic() -> bool:
    """flash-attn's `deterministic` backward where the user asked torch for deterministic algorithms."""
    return torch.are_deterministic_algorithms_enabled()


def _pad_head_dim(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero-pad the last dim to a multiple of 8, as flash-attn's public wrappers do before calling its kernels (which
    refuse other head dims). Zeros change neither scores nor `rowsum(dout * out)`."""
    pad = -tensors[0].shape[-1] % 8
    return tensors if not pad else tuple(F.pad(t, (0, pad)) for t in tensors)


class TorchBlockKernel:
    """Pure PyTorch kernel over the document pieces of the local queries, any device.

    A piece that starts at its document's start attends with one `is_causal` call (the fused CPU/CUDA kernels, no
    mask, memory linear in its length). A piece that starts inside its document (a document crossing into this rank
    from the previous one) sees every earlier key of that document: its queries go in blocks of `query_chunk_size`
    with a bottom-right causal mask, so no `L x L` mask or score matrix ever exists.

    A document that continues a shared prefix (`meta.segment_parents`) attends to its prefix in full and causally to
    itself: its query blocks see the prefix's keys followed by their own document's keys up to the block's end, which
    is again bottom-right causal over the concatenated keys, so the same block call serves both.
    """

    name = "torch"
    reuses_forward = False

    def _blocks(self, meta: RingAttentionMetadata):
        """`(a, b, key_ranges, is_causal_square)`: local queries `[a, b)` against the keys of `key_ranges`, a tuple
        of `(k_lo, k_hi)` relative to `kv_start`, concatenated in order."""
        offset = meta.kv_start
        cu = meta.cu_seqlens
        for doc in meta.local_documents():
            doc_start, doc_end = cu[doc], cu[doc + 1]
            q_lo, q_hi = max(doc_start, meta.local_start), min(doc_end, meta.local_end)
            prefix = tuple((cu[p] - offset, cu[p + 1] - offset) for p in meta.ancestors(doc))
            if q_lo == doc_start and not prefix:
                yield q_lo - meta.local_start, q_hi - meta.local_start, ((doc_start - offset, q_hi - offset),), True
                continue
            for a in range(q_lo, q_hi, meta.query_chunk_size):
                b = min(a + meta.query_chunk_size, q_hi)
                yield a - meta.local_start, b - meta.local_start, (*prefix, (doc_start - offset, b - offset)), False

    @staticmethod
    def _keys(t, key_ranges):
        if len(key_ranges) == 1:
            return t[key_ranges[0][0] : key_ranges[0][1]]
        return torch.cat([t[lo:hi] for lo, hi in key_ranges])

    @staticmethod
    def _block(q, k, v, is_causal_square, scaling):
        """q `[m, H, D]` against k/v `[n, Hkv, D]`; causal (square) or bottom-right causal (query i sees keys up to
        `i + n - m`)."""
        # [1, heads, tokens, dim]: the batched 4-D layout takes SDPA's fused kernels (3-D inputs fall back to math).
        query = q.transpose(0, 1).unsqueeze(0)
        key = k.transpose(0, 1).unsqueeze(0)
        value = v.transpose(0, 1).unsqueeze(0)
        mask = None
        if not is_causal_square:
            m, n = q.shape[0], k.shape[0]
            mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - m, n, device=q.device)[:, None]
        gqa = q.shape[1] != k.shape[1]
        if gqa and mask is not None and q.device.type != "cpu":
            # On CUDA a masked call can only take the memory-efficient backend, which refuses `enable_gqa`: with it
            # SDPA falls back to the math backend, which materialises float32 scores ([heads, m, n], 8 GiB for 16
            # heads x 1K queries x 128K keys). Repeating the key/value heads keeps it on the fused kernel.
            group = q.shape[1] // k.shape[1]
            key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
            gqa = False
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=is_causal_square, scale=scaling, enable_gqa=gqa
        )
        return out[0].transpose(0, 1)

    def forward(self, q, k, v, meta: RingAttentionMetadata, scaling: float) -> torch.Tensor:
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        for a, b, key_ranges, square in self._blocks(meta):
            out[a:b] = self._block(q[a:b], self._keys(k, key_ranges), self._keys(v, key_ranges), square, scaling)
        return out

    def backward(self, q, k, v, grad_out, meta: RingAttentionMetadata, scaling: float):
        dq, dk, dv = (_fp32_zeros(t) for t in (q, k, v))  # summed over blocks in float32, cast once by the caller
        for a, b, key_ranges, square in self._blocks(meta):
            # Each block's own slices are the leaves: differentiating the whole q/k/v instead would materialise and
            # add a full-size gradient per block (cost: blocks x row length, 7x the forward on a packed row).
            q_b = q[a:b].detach().requires_grad_()
            k_b = self._keys(k, key_ranges).detach().requires_grad_()
            v_b = self._keys(v, key_ranges).detach().requires_grad_()
            with torch.enable_grad():
                block = self._block(q_b, k_b, v_b, square, scaling)
            dq_b, dk_b, dv_b = torch.autograd.grad(block, (q_b, k_b, v_b), grad_out[a:b])
            dq[a:b] += dq_b
            at = 0
            for lo, hi in key_ranges:  # a shared prefix's keys receive the gradient of every response block
                dk[lo:hi] += dk_b[at : at + hi - lo]
                dv[lo:hi] += dv_b[at : at + hi - lo]
                at += hi - lo
        return dq, dk, dv


def _fp32_zeros(t: torch.Tensor) -> torch.Tensor:
    """A float32 accumulator for gradients of `t` (half-precision sums over blocks and ranks lose ~1e-2 relative)."""
    return torch.zeros(t.shape, dtype=torch.float32, device=t.device)


VarlenFunction = Callable[..., torch.Tensor]
"""`fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale) -> out`, token-major, causal with
bottom-right alignment per document (the flash-attn convention), grouped-query heads supported."""


class VarlenKernel:
    """Kernel on top of a variable-length attention function (flash-attn, torch's `varlen_attn`): one call per
    head chunk, with per-document query/key boundaries from `RingAttentionMetadata.varlen_layout`.

    `fn` is the library's differentiable function (used under plain autograd on one process); `ops` (optional) are
    its forward-with-log-sum-exp and backward-from-(out, lse) entry points: with them the ring's backward reuses the
    forward's out and lse, and shared-prefix rows are attended by `SharedPrefixVarlenKernel` instead of the pure
    PyTorch kernel. `fn=None` makes the forward the ops' (PyTorch's fused CPU attention on a ring).
    """

    def __init__(self, name: str, fn: VarlenFunction | None, ops: VarlenOps | None = None):
        self.name = name
        self.fn = fn
        self.ops = ops

    @property
    def reuses_forward(self) -> bool:
        return self.ops is not None

    @staticmethod
    def _contiguous(*tensors):
        # Head-chunk slices of transposed views: give the fused kernels plain contiguous [tokens, heads, dim] tensors.
        return tuple(t.contiguous() for t in tensors)

    def forward(self, q, k, v, meta: RingAttentionMetadata, scaling: float) -> torch.Tensor:
        if self.fn is None:
            return self.forward_lse(q, k, v, meta, scaling)[0]
        return self.fn(*self._contiguous(q, k, v), *meta.varlen_layout(q.device), scaling)

    def forward_lse(self, q, k, v, meta: RingAttentionMetadata, scaling: float):
        """`(out, lse)`, lse float32 `[H, Tq]` (no autograd)."""
        return self.ops.forward(*self._contiguous(q, k, v), *meta.varlen_layout(q.device), scaling, True)

    def backward_from(self, q, k, v, out, lse, grad_out, meta: RingAttentionMetadata, scaling: float):
        """float32 `(dq, dk, dv)` from the forward's `out` and `lse`: no attention is recomputed."""
        grads = self.ops.backward(*self._contiguous(grad_out, q, k, v, out, lse), *meta.varlen_layout(q.device),
                                  scaling, True)  # fmt: skip
        return tuple(grad.float() for grad in grads)

    def backward(self, q, k, v, grad_out, meta: RingAttentionMetadata, scaling: float):
        """float32 `(dq, dk, dv)` with the forward recomputed (what a caller that kept no out/lse calls)."""
        if self.ops is not None:
            out, lse = self.forward_lse(q, k, v, meta, scaling)
            return self.backward_from(q, k, v, out, lse, grad_out, meta, scaling)
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            out = self.forward(q, k, v, meta, scaling)
        return tuple(grad.float() for grad in torch.autograd.grad(out, (q, k, v), grad_out))  # summed over ranks


class VarlenOps:
    """The two entry points of a varlen attention library that a log-sum-exp merge needs (flash-attn's convention):

    - `forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> (out, lse)`: token-major q `[Tq, H, D]`, k/v
      `[Tk, Hkv, D]`; `lse` is the natural-log softmax normaliser of every query, float32 `[H, Tq]`; `causal` is
      bottom-right aligned per sequence (query i of nq sees key j of nk iff j <= i + nk - nq), else full.
    - `backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal) -> (dq, dk, dv)`: the gradients
      of this call's keys given the *final* `out` and `lse` of the queries (which may also attend other keys): the
      softmax is recomputed as `exp(s - lse)` and its Jacobian uses `rowsum(grad_out * out)`, so a query's attention
      split over several calls and merged gets each call's exact share (as ring attention merges its blocks).
    """

    name = "varlen_ops"

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        raise NotImplementedError

    def forward_fills_own_buffers(self, q) -> bool:
        """Whether `forward` on these queries returns buffers it allocated and filled itself (the attention ops'
        outputs copied into them), not an attention op's own outputs or views of them: selective checkpointing keeps
        those for the recompute, and a caller must not write into them (the shared-prefix merge copies them first).
        False unless the library knows better."""
        return False

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        raise NotImplementedError


def _heads_first_lse(lse: torch.Tensor, q: torch.Tensor, library: str) -> torch.Tensor:
    """The lse as float32 `[H, Tq]` (flash-attn 2 and torch's flash kernel give that; torch documents `[Tq, H]`)."""
    tokens, heads = q.shape[0], q.shape[1]
    if lse.shape == (heads, tokens):
        return lse.float()
    if lse.shape == (tokens, heads):
        return lse.transpose(0, 1).float().contiguous()
    raise RuntimeError(
        f"{library} returned a log-sum-exp of shape {tuple(lse.shape)} for {tokens} queries of {heads} heads; the "
        "shared-prefix varlen path needs [heads, tokens]. Set shared_prefix=False or ring_attn_backend='torch'."
    )


class FlashAttnVarlenOps(VarlenOps):
    """flash-attn 2's varlen forward (public, `return_attn_probs=True` for the lse) and its varlen backward (the
    private `_flash_attn_varlen_backward` that ring-flash-attention also calls; its signature is read at run time)."""

    name = "flash_attn"

    def __init__(self, backward_fn, backward_parameters):
        self._backward_fn = backward_fn
        self._backward_parameters = backward_parameters

    @classmethod
    def load(cls) -> FlashAttnVarlenOps | None:
        """The ops when this flash-attn has a varlen backward whose arguments we know, else None."""
        try:
            from flash_attn import flash_attn_interface
        except Exception:
            return None
        fn = getattr(flash_attn_interface, "_flash_attn_varlen_backward", None)
        if fn is None:
            return None
        # flash-attn >= 2.7 wraps it in `torch.library.custom_op`, whose own signature is `(*args, **kwargs)`: the
        # real parameters are those of the wrapped function (what ring-flash-attention reads too).
        parameters = set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)
        needed = {"dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k"}
        if not needed <= parameters:
            return None
        return cls(fn, parameters)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        from flash_attn import flash_attn_varlen_func

        with torch.no_grad():
            out, lse, _ = flash_attn_varlen_func(
                q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal, return_attn_probs=True
            )
        return out, _heads_first_lse(lse, q, "flash-attn")

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        head_dim = q.shape[-1]
        grad_out, q, k, v, out = _pad_head_dim(grad_out.contiguous(), q, k, v, out.contiguous())
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kwargs = {
            "dout": grad_out, "q": q, "k": k, "v": v, "out": out, "softmax_lse": lse,
            "dq": dq, "dk": dk, "dv": dv, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q,
            "max_seqlen_k": max_k, "dropout_p": 0.0, "softmax_scale": scale, "causal": causal,
            "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1, "softcap": 0.0,
            "alibi_slopes": None, "deterministic": _deterministic(), "rng_state": None,
        }  # fmt: skip
        self._backward_fn(**{key: value for key, value in kwargs.items() if key in self._backward_parameters})
        return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]


class TorchVarlenOps(VarlenOps):
    """torch's `varlen_attn` (`return_aux` for the lse) and the backward op its own autograd calls
    (`torch.ops.torch_attn._varlen_attn_backward`), which takes the out and lse to use."""

    name = "torch_varlen"

    @classmethod
    def load(cls) -> TorchVarlenOps | None:
        try:
            from torch.nn.attention.varlen import AuxRequest, varlen_attn  # noqa: F401

            op = torch.ops.torch_attn._varlen_attn_backward
        except (ImportError, AttributeError, RuntimeError):
            return None
        arguments = [argument.name for argument in op.default._schema.arguments]
        expected = ["grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "cu_seq_k", "max_q", "max_k"]
        if arguments[: len(expected)] != expected or "is_causal" not in arguments or "rng_state" not in arguments:
            return None
        return cls()

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        with torch.no_grad():
            out, lse = varlen_attn(
                q, k, v, cu_q, cu_k, max_q, max_k, return_aux=AuxRequest(lse=True), scale=scale,
                window_size=(-1, 0) if causal else (-1, -1), **_torch_varlen_gqa_kwargs(varlen_attn, q, k),
            )  # fmt: skip
        return out, _heads_first_lse(lse, q, "torch varlen_attn")

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
        return torch.ops.torch_attn._varlen_attn_backward(
            grad_out.contiguous(), q, k, v, out.contiguous(), lse, cu_q, cu_k, max_q, max_k, causal, rng_state,
            scale=scale, window_size=[-1, 0] if causal else [-1, -1],
        )  # fmt: skip


class TorchCudnnOps(VarlenOps):
    """cuDNN's fused attention (the kernels SDPA's `CUDNN_ATTENTION` backend calls:
    `aten._scaled_dot_product_cudnn_attention` and its backward, as torch's own context parallelism calls them), one
    call per sequence. On an H100 it runs a long causal sequence at ~1.75x the TFLOP/s of torch's `varlen_attn`
    (`bench/gpu_attention_kernels.py`: 570 vs 323 forward+backward at 32K-64K tokens, Qwen3-0.6B heads).

    The sequences it does not serve go to `fallback` (torch's varlen ops), as one varlen call per run of consecutive
    such sequences: causal ones with fewer queries than keys (a document entering this ring rank from the previous
    one, which needs a bottom-right mask: cuDNN's causal mask is top-left aligned), and those under `min_tokens`
    queries, where a kernel launch per sequence costs more than the faster kernel saves. Grouped-query heads are
    repeated for cuDNN (its GQA support differs by version), in head chunks whose repeated keys stay under
    `repeat_elements` elements (0.5 GiB in bf16); their gradients are summed back in float32.
    """

    name = "torch_cudnn"

    def __init__(
        self, fallback: VarlenOps, min_tokens: int = 2048, repeat_elements: int = 2**28, forward_op=None,
        backward_op=None,
    ):  # fmt: skip
        self.fallback = fallback
        self.min_tokens = min_tokens
        self.repeat_elements = repeat_elements
        # The aten ops (a test passes stand-ins with their schema to run this on CPU).
        self.forward_op = forward_op or torch.ops.aten._scaled_dot_product_cudnn_attention
        self.backward_op = backward_op or torch.ops.aten._scaled_dot_product_cudnn_attention_backward

    @classmethod
    def load(cls, min_tokens: int = 2048) -> TorchCudnnOps | None:
        aten = torch.ops.aten
        if not hasattr(aten, "_scaled_dot_product_cudnn_attention") or not hasattr(
            aten, "_scaled_dot_product_cudnn_attention_backward"
        ):
            return None
        fallback = TorchVarlenOps.load()
        return None if fallback is None else cls(fallback, min_tokens)

    def _runs(self, cu_q, cu_k, causal):
        """`(use_cudnn, qa, qb, ka, kb, cu_q, cu_k, max_q, max_k)` per call: one per sequence cuDNN serves, one varlen
        call per run of consecutive sequences it leaves to the fallback (boundaries rebased to the run's start)."""
        cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
        pending: list[int] = []

        def flush():
            first, last = pending[0], pending[-1] + 1
            run_q = [c - cu_q[first] for c in cu_q[first : last + 1]]
            run_k = [c - cu_k[first] for c in cu_k[first : last + 1]]
            max_q = max(b - a for a, b in zip(run_q, run_q[1:]))
            max_k = max(b - a for a, b in zip(run_k, run_k[1:]))
            pending.clear()
            return (False, cu_q[first], cu_q[last], cu_k[first], cu_k[last], run_q, run_k, max_q, max_k)

        for i in range(len(cu_q) - 1):
            nq, nk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
            if nq >= self.min_tokens and (not causal or nq == nk):
                if pending:
                    yield flush()
                yield (True, cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1], None, None, nq, nk)
            elif nq:
                pending.append(i)
        if pending:
            yield flush()

    def _head_chunks(self, q, k, num_keys):
        """`(query heads, key/value heads)` slices per cuDNN call of a sequence with `num_keys` keys: all heads at
        once, unless its keys repeated to the query heads would pass `repeat_elements`, then as few key/value heads
        per call as keep them under it (at least one). cuDNN is given one key/value head per query head, so grouped
        heads are repeated; bounded so, a 512K-token sequence of Llama-3.1-8B's heads repeats 0.5 GiB per call
        instead of 4 GiB."""
        heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        group = heads // kv_heads
        per_call = max(1, min(kv_heads, self.repeat_elements // max(1, num_keys * group * head_dim)))
        if kv_heads == heads:  # nothing is repeated
            per_call = kv_heads
        for h in range(0, kv_heads, per_call):
            hi = min(h + per_call, kv_heads)
            yield slice(h * group, hi * group), slice(h, hi)

    @staticmethod
    def _heads_first(t, heads):
        """`[T, Hkv, D]` -> `[1, heads, T, D]`, key/value heads repeated; a slice of some heads is copied first, so
        that cuDNN always gets the layout of a whole token-major tensor."""
        if not t.is_contiguous():
            t = t.contiguous()
        if t.shape[1] != heads:
            t = t.repeat_interleave(heads // t.shape[1], dim=1)
        return t.transpose(0, 1).unsqueeze(0)

    @staticmethod
    def serves(q) -> bool:
        """Whether cuDNN takes these heads: head dims that are multiples of 8 up to 128 (what every cuDNN 9 build
        SDPA dispatches to takes), and no deterministic backward asked for (torch calls cuDNN's backward
        nondeterministic)."""
        return q.shape[-1] % 8 == 0 and q.shape[-1] <= 128 and not _deterministic()

    def forward_fills_own_buffers(self, q) -> bool:
        return self.serves(q)  # else the fallback's outputs as they are

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        if not self.serves(q):
            return self.fallback.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        for cudnn, qa, qb, ka, kb, run_q, run_k, mq, mk in self._runs(cu_q, cu_k, causal):
            if not cudnn:
                out[qa:qb], lse[:, qa:qb] = self.fallback.forward(
                    q[qa:qb], k[ka:kb], v[ka:kb], *_int32(q.device, run_q, run_k), mq, mk, scale, causal
                )
                continue
            for hq, hk in self._head_chunks(q, k, kb - ka):
                n = hq.stop - hq.start
                block_out, block_lse = self.forward_op(
                    self._heads_first(q[qa:qb, hq], n), self._heads_first(k[ka:kb, hk], n),
                    self._heads_first(v[ka:kb, hk], n), None, True, 0.0, causal, False, scale=scale,
                )[:2]  # fmt: skip
                out[qa:qb, hq] = block_out[0].transpose(0, 1)
                lse[hq, qa:qb] = block_lse.reshape(n, qb - qa)
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        if not self.serves(q):
            return self.fallback.backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal)
        # Each query and each key belongs to one sequence here: the gradients are written, not summed, in the
        # inputs' dtype (no float32 copy of a long row's dq).
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        no_rng = torch.zeros((), dtype=torch.long, device=q.device)
        for cudnn, qa, qb, ka, kb, run_q, run_k, mq, mk in self._runs(cu_q, cu_k, causal):
            if not cudnn:
                dq[qa:qb], dk[ka:kb], dv[ka:kb] = self.fallback.backward(
                    grad_out[qa:qb], q[qa:qb], k[ka:kb], v[ka:kb], out[qa:qb], lse[:, qa:qb].contiguous(),
                    *_int32(q.device, run_q, run_k), mq, mk, scale, causal,
                )  # fmt: skip
                continue
            for hq, hk in self._head_chunks(q, k, kb - ka):
                n, n_kv = hq.stop - hq.start, hk.stop - hk.start
                dq_b, dk_b, dv_b = self.backward_op(
                    self._heads_first(grad_out[qa:qb, hq], n), self._heads_first(q[qa:qb, hq], n),
                    self._heads_first(k[ka:kb, hk], n), self._heads_first(v[ka:kb, hk], n),
                    self._heads_first(out[qa:qb, hq], n), lse[hq, qa:qb].reshape(1, n, qb - qa, 1).contiguous(),
                    no_rng, no_rng, None, None, None, qb - qa, kb - ka, 0.0, causal, scale=scale,
                )  # fmt: skip
                dq[qa:qb, hq] = dq_b[0].transpose(0, 1)
                for grad, into in ((dk_b, dk), (dv_b, dv)):
                    grad = grad[0].transpose(0, 1)  # [keys, n, D]
                    if n_kv != n:
                        grad = grad.unflatten(1, (n_kv, n // n_kv)).sum(2, dtype=torch.float32)
                    into[ka:kb, hk] = grad
        return dq, dk, dv


def _int32(device, *boundaries):
    """Sequence boundaries (lists) as the int32 tensors varlen kernels take."""
    return tuple(torch.tensor(b, dtype=torch.int32, device=device) for b in boundaries)


class _VarlenOpsFunction(torch.autograd.Function):
    """A differentiable causal varlen attention from a library's two entry points (forward with lse, backward from
    out and lse), for libraries without their own autograd (cuDNN's fused ops)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, ops):
        out, lse = ops.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, True)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.max_q, ctx.max_k, ctx.scale, ctx.ops = max_q, max_k, scale, ops
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        grads = ctx.ops.backward(grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k,
                                 ctx.scale, True)  # fmt: skip
        return (*(g.to(t.dtype) for g, t in zip(grads, (q, k, v))), None, None, None, None, None, None)


def varlen_function_of(ops: VarlenOps) -> VarlenFunction:
    """The causal varlen attention function (`VarlenKernel.fn`) of `ops`, differentiable through its entry points."""

    def fn(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return _VarlenOpsFunction.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, ops)

    return fn


class TorchCpuFlashOps(VarlenOps):
    """The same contract on CPU from PyTorch's fused CPU attention (`aten::_scaled_dot_product_flash_attention_for_cpu`
    and its backward, the ops SDPA itself dispatches to), one call per sequence. Shared-prefix rows on CPU use it: a
    response's scores against its long prompt are never materialised (the masked SDPA blocks of `TorchBlockKernel`
    keep `[queries, prompt]` score matrices alive for the backward), and the backward reuses the forward's lse.

    A causal sequence with fewer queries than keys (a document entering this ring rank from the previous one) goes in
    blocks of `query_chunk_size` queries with a bottom-right mask, so no `L x L` mask exists.
    """

    name = "torch_cpu_flash"

    def __init__(self, query_chunk_size: int = 1024):
        self.query_chunk_size = query_chunk_size

    @classmethod
    def load(cls, query_chunk_size: int = 1024) -> TorchCpuFlashOps | None:
        aten = torch.ops.aten
        if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu") or not hasattr(
            aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
        ):
            return None
        return cls(query_chunk_size)

    def _blocks(self, cu_q, cu_k, causal):
        """`(qa, qb, ka, kb, mode)` per call, mode 'full', 'causal' (square) or 'bottom_right' (masked block)."""
        cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
        for i in range(len(cu_q) - 1):
            qa, qb, ka, kb = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
            nq, nk = qb - qa, kb - ka
            if not causal or nq == nk:
                yield qa, qb, ka, kb, "causal" if causal else "full"
                continue
            for a in range(0, nq, self.query_chunk_size):
                b = min(a + self.query_chunk_size, nq)
                yield qa + a, qa + b, ka, ka + nk - nq + b, "bottom_right"

    @staticmethod
    def _mask(m, n, mode, dtype, device):
        if mode != "bottom_right":
            return None
        keep = torch.arange(n, device=device)[None, :] <= torch.arange(n - m, n, device=device)[:, None]
        return torch.zeros(m, n, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))

    @staticmethod
    def _heads_first(t):
        return t.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D]

    def forward_fills_own_buffers(self, q) -> bool:
        return True  # each block's outputs are copied into `out` and `lse`

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        for qa, qb, ka, kb, mode in self._blocks(cu_q, cu_k, causal):
            mask = self._mask(qb - qa, kb - ka, mode, q.dtype, q.device)
            block_out, block_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                *(self._heads_first(t) for t in (q[qa:qb], k[ka:kb], v[ka:kb])),
                0.0, mode == "causal", attn_mask=mask, scale=scale,
            )  # fmt: skip
            out[qa:qb] = block_out[0].transpose(0, 1)
            lse[:, qa:qb] = block_lse[0]
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        dq, dk, dv = (_fp32_zeros(t) for t in (q, k, v))  # blocks of one sequence share keys: summed in float32
        for qa, qb, ka, kb, mode in self._blocks(cu_q, cu_k, causal):
            mask = self._mask(qb - qa, kb - ka, mode, q.dtype, q.device)
            dq_b, dk_b, dv_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *(self._heads_first(t) for t in (grad_out[qa:qb], q[qa:qb], k[ka:kb], v[ka:kb], out[qa:qb])),
                lse[:, qa:qb].unsqueeze(0).contiguous(), 0.0, mode == "causal", attn_mask=mask, scale=scale,
            )  # fmt: skip
            dq[qa:qb] = dq_b[0].transpose(0, 1)
            dk[ka:kb] += dk_b[0].transpose(0, 1)
            dv[ka:kb] += dv_b[0].transpose(0, 1)
        return dq, dk, dv


class _SharedPrefixLayout:
    """The two varlen calls that attend a shared-prefix slice exactly, without copying a prefix per response.

    - Call A (causal): every local document piece against its own document's keys up to its last local query, as for
      an ordinary packed row (a prefix attends only to itself; a response causally to itself).
    - Call B (full): the local queries of the responses of one prefix, all of them as one query sequence, against
      that prefix's (and its ancestors') keys, taken once per prefix.

    A response's output is the log-sum-exp merge of its two calls. Indices are relative to the local queries and to
    the keys `[kv_start, local_end)`.
    """

    def __init__(self, meta: RingAttentionMetadata, device: torch.device):
        cu, offset = meta.cu_seqlens, meta.kv_start
        documents = list(meta.local_documents())
        self.keys_a_start = cu[documents[0]] - offset
        cu_q_a, cu_k_a, max_q_a, max_k_a = [0], [0], 0, 0
        sequences_b: list[tuple[tuple[int, ...], int, int]] = []  # (ancestors, q_lo, q_hi), local query indices
        for doc in documents:
            doc_start, doc_end = cu[doc], cu[doc + 1]
            q_lo, q_hi = max(doc_start, meta.local_start), min(doc_end, meta.local_end)
            cu_q_a.append(cu_q_a[-1] + q_hi - q_lo)
            cu_k_a.append(cu_k_a[-1] + q_hi - doc_start)
            max_q_a, max_k_a = max(max_q_a, q_hi - q_lo), max(max_k_a, q_hi - doc_start)
            ancestors = tuple(meta.ancestors(doc))
            if not ancestors:
                continue
            a, b = q_lo - meta.local_start, q_hi - meta.local_start
            if sequences_b and sequences_b[-1][0] == ancestors and sequences_b[-1][2] == a:
                sequences_b[-1] = (ancestors, sequences_b[-1][1], b)  # the next response of the same prefix
            else:
                sequences_b.append((ancestors, a, b))
        as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
        self.call_a = (as_int32(cu_q_a), as_int32(cu_k_a), max_q_a, max_k_a)
        self.key_ranges_b = [
            (cu[p] - offset, cu[p + 1] - offset) for ancestors, _, _ in sequences_b for p in ancestors
        ]
        cu_q_b, cu_k_b = [0], [0]
        for ancestors, a, b in sequences_b:
            cu_q_b.append(cu_q_b[-1] + b - a)
            cu_k_b.append(cu_k_b[-1] + sum(cu[p + 1] - cu[p] for p in ancestors))
        self.has_b = bool(sequences_b)
        if self.has_b:
            lengths_q = [cu_q_b[i + 1] - cu_q_b[i] for i in range(len(sequences_b))]
            lengths_k = [cu_k_b[i + 1] - cu_k_b[i] for i in range(len(sequences_b))]
            self.call_b = (as_int32(cu_q_b), as_int32(cu_k_b), max(lengths_q), max(lengths_k))
            self.queries_b = torch.cat([torch.arange(a, b, device=device) for _, a, b in sequences_b])

    @classmethod
    def of(cls, meta: RingAttentionMetadata, device: torch.device) -> _SharedPrefixLayout:
        key = ("shared_prefix_varlen", str(device))
        if key not in meta._cache:
            meta._cache[key] = cls(meta, device)
        return meta._cache[key]

    def keys_b(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[lo:hi] for lo, hi in self.key_ranges_b])

    def forward(self, ops: VarlenOps, q, k, v, scale):
        """`(out, lse)` of every local query over all the keys it sees."""
        a = self.keys_a_start
        out, lse = ops.forward(q, k[a:].contiguous(), v[a:].contiguous(), *self.call_a, scale, True)
        if not self.has_b:
            return out, lse
        idx = self.queries_b
        out_b, lse_b = ops.forward(q[idx], self.keys_b(k), self.keys_b(v), *self.call_b, scale, False)
        if keeps_attention_outputs() and not ops.forward_fills_own_buffers(q):
            # `out` and `lse` are (views of) the attention op's outputs, which selective checkpointing keeps for the
            # recompute: torch refuses a kept tensor that was changed, and the recompute would read the merged values.
            # The merge writes into copies (flash-attn's and torch's varlen outputs; buffers the ops filled themselves,
            # PyTorch's CPU flash kernel's and cuDNN's, are nobody else's and merged in place).
            out, lse = out.clone(), lse.clone()
        lse_a = lse[:, idx]
        merged = torch.logaddexp(lse_a, lse_b)
        weight_a = torch.exp(lse_a - merged).transpose(0, 1).unsqueeze(-1)  # [n, H, 1]
        weight_b = torch.exp(lse_b - merged).transpose(0, 1).unsqueeze(-1)
        # The ops return fresh tensors (or copies, above): merge in place.
        out[idx] = (out[idx].float() * weight_a + out_b.float() * weight_b).to(out.dtype)
        lse[:, idx] = merged
        return out, lse

    def backward(self, ops: VarlenOps, grad_out, q, k, v, out, lse, scale, dq_dtype=torch.float32):
        """float32 `(dq, dk, dv)`; `dq_dtype=q.dtype` returns `dq` in the kernel's dtype instead, with the same values
        once cast: the responses' queries, the only ones with a second term, are summed in float32 and cast once, and
        the row's other queries keep the kernel's `dq` as it is (no float32 copy of the whole row's `dq`, the largest
        buffer of a long row's attention backward)."""
        a = self.keys_a_start
        dq, dk_a, dv_a = ops.backward(grad_out, q, k[a:].contiguous(), v[a:].contiguous(), out, lse, *self.call_a,
                                      scale, True)  # fmt: skip
        # The two calls' gradients (and every response's share of its prefix's) are summed in float32; the caller
        # casts once.
        if dq_dtype == torch.float32:
            dq = dq.float()
        dk, dv = _fp32_zeros(k), _fp32_zeros(v)
        dk[a:] += dk_a
        dv[a:] += dv_a
        if self.has_b:
            idx = self.queries_b
            dq_b, dk_b, dv_b = ops.backward(
                grad_out[idx], q[idx], self.keys_b(k), self.keys_b(v), out[idx], lse[:, idx].contiguous(),
                *self.call_b, scale, False,
            )  # fmt: skip
            if dq.dtype == torch.float32:
                dq.index_add_(0, idx, dq_b.float())  # in place: `dq` is this call's own
            else:
                dq[idx] = (dq[idx].float() + dq_b.float()).to(dq.dtype)
            at = 0
            for lo, hi in self.key_ranges_b:  # each prefix once, with the gradient of all its responses' queries
                dk[lo:hi] += dk_b[at : at + hi - lo]
                dv[lo:hi] += dv_b[at : at + hi - lo]
                at += hi - lo
        return dq, dk, dv


class _SharedPrefixVarlenFunction(torch.autograd.Function):
    """Autograd over the two calls: saves q/k/v and the merged out/lse, so the backward recomputes nothing."""

    @staticmethod
    def forward(ctx, q, k, v, layout, ops, scale):
        out, lse = layout.forward(ops, q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.ops, ctx.scale = layout, ops, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.layout.backward(ctx.ops, grad_out, q, k, v, out, lse, ctx.scale, dq_dtype=q.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class SharedPrefixVarlenKernel:
    """A varlen library's kernels on a shared-prefix row: prefix and own keys attended by two calls and merged with
    their log-sum-exp (see `_SharedPrefixLayout`), the backward of each call taking the merged out and lse. No
    prefix's keys are copied per response: each is passed once per slice, for all of its responses."""

    reuses_forward = True
    _contiguous = staticmethod(VarlenKernel._contiguous)

    def __init__(self, ops: VarlenOps):
        self.ops = ops
        self.name = f"{ops.name}_shared_prefix"

    def forward(self, q, k, v, meta: RingAttentionMetadata, scaling: float) -> torch.Tensor:
        layout = _SharedPrefixLayout.of(meta, q.device)
        return _SharedPrefixVarlenFunction.apply(*self._contiguous(q, k, v), layout, self.ops, scaling)

    def forward_lse(self, q, k, v, meta: RingAttentionMetadata, scaling: float):
        """`(out, lse)` merged over each query's prefix and own keys (no autograd)."""
        return _SharedPrefixLayout.of(meta, q.device).forward(self.ops, *self._contiguous(q, k, v), scaling)

    def backward_from(self, q, k, v, out, lse, grad_out, meta: RingAttentionMetadata, scaling: float):
        """float32 `(dq, dk, dv)` from the merged `out` and `lse`: no attention is recomputed."""
        layout = _SharedPrefixLayout.of(meta, q.device)
        return layout.backward(self.ops, *self._contiguous(grad_out, q, k, v, out, lse), scaling)

    def backward(self, q, k, v, grad_out, meta: RingAttentionMetadata, scaling: float):
        out, lse = self.forward_lse(q, k, v, meta, scaling)
        return self.backward_from(q, k, v, out, lse, grad_out, meta, scaling)


# Resolvers that take the place of the device's own kernels, innermost last: a memory plan of a CUDA run, traced on CPU
# fake tensors, gives our attention the CUDA kernels as allocations (`trl_longrm.memory_plan.planned_kernels`). A
# resolver returns a kernel, or None where the device's own applies.
_kernel_overrides: list = []


@contextlib.contextmanager
def kernels_resolved_by(resolver):
    """Within this context `resolve_kernel` asks `resolver(backend, device, dtype)` first."""
    _kernel_overrides.append(resolver)
    try:
        yield
    finally:
        _kernel_overrides.pop()


def kernels_overridden() -> bool:
    """Whether attention kernels are resolved by an override here (`kernels_resolved_by`): a plan's kernels are
    allocations only, so flash-attn need not be importable where the plan is made."""
    return bool(_kernel_overrides)


def _flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=True,
        deterministic=_deterministic(),
    )  # fmt: skip


def _torch_varlen_function() -> VarlenFunction | None:
    """torch's `varlen_attn` when this torch has the signature we rely on (window (-1, 0) = causal, GQA)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" not in parameters or "scale" not in parameters:
        return None

    def fn(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0),
            **_torch_varlen_gqa_kwargs(varlen_attn, q, k),
        )  # fmt: skip

    return fn


def _torch_varlen_gqa_kwargs(varlen_attn, q, k) -> dict:
    """`enable_gqa` where this torch's `varlen_attn` has it (2.13); torch 2.11's has no such argument and takes
    grouped-query heads natively (fewer key/value heads than query heads)."""
    if "enable_gqa" in inspect.signature(varlen_attn).parameters:
        return {"enable_gqa": q.shape[1] != k.shape[1]}
    return {}


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def resolve_kernel(backend: str, device: torch.device, dtype: torch.dtype):
    """The kernel for `backend` ('auto', 'torch', 'cudnn', 'flash_attn') on tensors of this device and dtype.

    'auto' on CUDA half-precision tensors: flash-attn where importable, else cuDNN's fused attention for long
    sequences with torch's `varlen_attn` for the rest (`TorchCudnnOps`), else torch's `varlen_attn` alone.

    Example:
    ```python
    >>> resolve_kernel("auto", torch.device("cpu"), torch.float32).name
    'torch'
    ```
    """
    if _kernel_overrides:
        kernel = _kernel_overrides[-1](backend, device, dtype)
        if kernel is not None:
            return kernel
    if backend == "flash_attn":
        if not is_flash_attn_available():
            raise ImportError(
                "ring_attn_backend='flash_attn' needs the flash-attn package, which is not importable here "
                "(`pip install flash-attn --no-build-isolation` on a CUDA machine), or use ring_attn_backend='torch'."
            )
        if device.type != "cuda":
            raise ValueError(f"ring_attn_backend='flash_attn' runs on CUDA tensors only, got tensors on {device}.")
        if dtype not in _HALF_DTYPES:
            raise ValueError(f"ring_attn_backend='flash_attn' needs float16 or bfloat16 tensors, got {dtype}.")
        return VarlenKernel("flash_attn", _flash_attn_varlen, FlashAttnVarlenOps.load())
    if backend == "cudnn":
        if device.type != "cuda" or dtype not in _HALF_DTYPES:
            raise ValueError(
                f"ring_attn_backend='cudnn' runs on CUDA float16/bfloat16 tensors only, got {dtype} on {device}."
            )
        ops = TorchCudnnOps.load()
        if ops is None:
            raise ImportError(
                "ring_attn_backend='cudnn' needs torch's cuDNN attention ops and its varlen_attn (torch >= 2.10); "
                "this torch lacks them. Use ring_attn_backend='torch'."
            )
        return VarlenKernel(ops.name, varlen_function_of(ops), ops)
    if backend == "auto":
        if device.type == "cuda" and dtype in _HALF_DTYPES:
            if is_flash_attn_available():
                return VarlenKernel("flash_attn", _flash_attn_varlen, FlashAttnVarlenOps.load())
            ops = TorchCudnnOps.load()
            if ops is not None:
                return VarlenKernel(ops.name, varlen_function_of(ops), ops)
        return resolve_kernel("torch", device, dtype)
    if backend == "torch":
        if device.type == "cuda" and dtype in _HALF_DTYPES:
            fn = _torch_varlen_function()
            if fn is not None:
                return VarlenKernel("torch_varlen", fn, TorchVarlenOps.load())
        return TorchBlockKernel()
    raise ValueError(f"Unknown ring attention backend {backend!r}; expected 'auto', 'torch' or 'flash_attn'.")
