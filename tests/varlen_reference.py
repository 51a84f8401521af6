"""Variable-length attention in plain PyTorch math with flash-attn's contract: the reference behind the CPU
stand-ins of the varlen libraries (`ReferenceVarlenOps`) and behind the CPU emulations of their compiled kernels
(`upstream_attention`), so that the libraries' real Python layers can run on CPU.

Token-major tensors: q `[Tq, H, D]`, k/v `[Tk, Hkv, D]`, query head `h` using key/value head `h // (H / Hkv)`.
Sequence `i` is queries `cu_q[i]:cu_q[i+1]` against keys `cu_k[i]:cu_k[i+1]`; `causal` is bottom-right aligned (query
`a` of `nq` sees key `b` of `nk` iff `b <= a + nk - nq`). The forward returns the output in the input dtype and the
natural-log softmax normaliser `lse` float32 `[H, Tq]`; the backward recomputes the probabilities from the `lse` it
is given and uses `rowsum(dout * out)` of the `out` it is given, as flash-attn's backward does (no autograd), so an
attention split over several calls and merged gets each call's exact share. Computed in float32.
"""

from __future__ import annotations

import torch


def varlen_pieces(cu_q, cu_k, causal):
    """`(qa, qb, ka, kb, mask)` per sequence, `mask` `[nq, nk]` True where the query sees the key."""
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    for i in range(len(cu_q) - 1):
        qa, qb, ka, kb = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        nq, nk = qb - qa, kb - ka
        mask = torch.ones(nq, nk, dtype=torch.bool)
        if causal:
            mask = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + nk - nq
        yield qa, qb, ka, kb, mask


def _scores(q, k, scale, mask):
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    return scores.masked_fill(~mask.to(q.device), float("-inf")), kk


def varlen_forward(q, k, v, cu_q, cu_k, scale, causal):
    """`(out, lse)`: out in q's dtype `[Tq, H, Dv]`, lse float32 `[H, Tq]` (-inf for a query that sees no key)."""
    dtype = q.dtype
    q, k, v = (t.float() for t in (q, k, v))
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"))
    group = q.shape[1] // k.shape[1]
    for qa, qb, ka, kb, mask in varlen_pieces(cu_q, cu_k, causal):
        if qb == qa or kb == ka:
            continue
        scores, _ = _scores(q[qa:qb], k[ka:kb], scale, mask)
        piece_lse = torch.logsumexp(scores, -1)
        lse[:, qa:qb] = piece_lse
        probs = torch.exp(scores - piece_lse[..., None]).nan_to_num(0.0)  # a query with no key: zero output
        out[qa:qb] = torch.einsum("hqk,khd->qhd", probs, v[ka:kb].repeat_interleave(group, 1))
    return out.to(dtype), lse


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal):
    """`(dq, dk, dv)` in the inputs' dtypes, from the given `out` and `lse` (see the module docstring)."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    dout, q, k, v, out, lse = (t.float() for t in (dout, q, k, v, out, lse))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    group = q.shape[1] // k.shape[1]
    for qa, qb, ka, kb, mask in varlen_pieces(cu_q, cu_k, causal):
        if qb == qa or kb == ka:
            continue
        scores, kk = _scores(q[qa:qb], k[ka:kb], scale, mask)
        probs = torch.exp(scores - lse[:, qa:qb, None]).nan_to_num(0.0)
        g, vv = dout[qa:qb], v[ka:kb].repeat_interleave(group, 1)
        d_probs = torch.einsum("qhd,khd->hqk", g, vv)
        d_scores = probs * (d_probs - (g * out[qa:qb]).sum(-1).transpose(0, 1)[..., None]) * scale
        dq[qa:qb] = torch.einsum("hqk,khd->qhd", d_scores, kk)
        kv_shape = (kb - ka, k.shape[1], group, k.shape[2])
        dk[ka:kb] = torch.einsum("hqk,qhd->khd", d_scores, q[qa:qb]).reshape(kv_shape).sum(2)
        dv[ka:kb] = torch.einsum("hqk,qhd->khd", probs, g).reshape(*kv_shape[:3], v.shape[2]).sum(2)
    return dq.to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2])
