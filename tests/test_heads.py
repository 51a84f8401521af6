"""The sparse log-prob head's chunked computation against the dense reference (`log_softmax` of all logits)."""

import pytest
import torch

from trl_longrm.heads import _LabelLogProb, chunked_token_logprobs


def dense_reference(hidden, labels, lm_head):
    logps = torch.log_softmax(lm_head(hidden).float(), dim=-1)
    return logps.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def test_label_logprob_gradient_is_exact(monkeypatch):
    # float64 finite differences against the hand-written backward (onehot - softmax, scaled), with row blocks of 2
    # in the forward's logsumexp; then the in-place backward (on logits of the caller's own, `x * 1`) gives the same.
    monkeypatch.setattr(_LabelLogProb, "BLOCK_ELEMENTS", 2 * 11)
    torch.manual_seed(0)
    logits = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, 10, 3, 7])
    weights = torch.randn(5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: _LabelLogProb.apply(x, labels, False), (logits,))
    logps = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(_LabelLogProb.apply(logits, labels, False), logps)

    expected = torch.autograd.grad((logps * weights).sum(), logits)[0]
    fresh = logits * 1
    out = _LabelLogProb.apply(fresh, labels, True)
    torch.testing.assert_close(torch.autograd.grad((out * weights).sum(), logits)[0], expected)
    # A second backward through the overwritten logits is refused by autograd, never silently wrong.
    out = _LabelLogProb.apply(logits * 1, labels, True)
    torch.autograd.grad(out.sum(), logits, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out.sum(), logits)


@pytest.mark.parametrize("with_stats", [False, True])
@pytest.mark.parametrize("chunk_elements", [2**30, 3 * 50, 7 * 50])  # one chunk; 3 and 7 rows per chunk (N = 20)
def test_chunked_logprobs_match_dense(chunk_elements, with_stats):
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(20, 16, requires_grad=True)
    labels = torch.randint(0, 50, (20,))
    weights = torch.randn(20)  # a loss that weighs each token differently, so a wrong per-row scale shows

    expected = dense_reference(hidden, labels, lm_head)
    (expected * weights).sum().backward()
    expected_grads = hidden.grad.clone(), lm_head.weight.grad.clone()
    hidden.grad, lm_head.weight.grad = None, None

    out = chunked_token_logprobs(hidden, labels, lm_head, chunk_elements, with_stats)
    logps = out[0] if with_stats else out
    (logps * weights).sum().backward()
    torch.testing.assert_close(logps, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, expected_grads[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lm_head.weight.grad, expected_grads[1], rtol=1e-5, atol=1e-6)
    if with_stats:
        with torch.no_grad():
            logits = lm_head(hidden)
            dense = torch.log_softmax(logits, dim=-1)
        torch.testing.assert_close(out[1], logits.argmax(-1) == labels)
        torch.testing.assert_close(out[2], -(dense.exp() * dense).sum(-1), rtol=1e-5, atol=1e-6)


def test_chunked_logprobs_bf16_head_match_dense():
    # A bf16 head: the logits are cast to fp32 before the log-softmax, in both; the gradient flows back through the cast.
    # One chunk: with several, the weight's gradient is a sum of bf16 per-chunk products (rounded differently).
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 50, bias=False).to(torch.bfloat16)
    hidden = torch.randn(20, 16, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (20,))
    expected = dense_reference(hidden, labels, lm_head)
    expected.sum().backward()
    expected_grads = hidden.grad.clone(), lm_head.weight.grad.clone()
    hidden.grad, lm_head.weight.grad = None, None

    logps = chunked_token_logprobs(hidden, labels, lm_head, 2**30)
    logps.sum().backward()
    assert logps.dtype == torch.float32
    torch.testing.assert_close(logps, expected)
    torch.testing.assert_close(hidden.grad, expected_grads[0])
    torch.testing.assert_close(lm_head.weight.grad, expected_grads[1])
