import math

import pytest
import torch

from trl_longrm.losses import bradley_terry_loss, center_rewards_penalty, cpo_loss, group_values, simpo_loss


def logsig(x):
    return -math.log1p(math.exp(-x))


def test_group_values_regroups_sequences():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    group_index = torch.tensor([0, 0, 0, 1, 1, 0])
    response_index = torch.tensor([0, 1, 2, 0, 1, 3])
    chosen, rejected, mask = group_values(values, group_index, response_index, 2)
    assert chosen.tolist() == [1.0, 4.0]
    assert rejected.tolist() == [[2.0, 3.0, 6.0], [5.0, 0.0, 0.0]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]


def test_simpo_loss_hand_computed():
    chosen = torch.tensor([-0.5, -1.0])
    rejected = torch.tensor([[-1.0, -2.0, 0.0], [-0.2, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    beta, gamma, ls = 2.5, 0.5, 0.1
    losses, cr, rr = simpo_loss(chosen, rejected, mask, beta=beta, gamma=gamma, label_smoothing=ls)
    for g, (c, r) in enumerate([(-0.5, (-1.0 - 2.0) / 2), (-1.0, -0.2)]):
        z = beta * (c - r) - gamma
        assert losses[g].item() == pytest.approx(-logsig(z) * (1 - ls) - logsig(-z) * ls, rel=1e-6)
        assert cr[g].item() == pytest.approx(beta * c) and rr[g].item() == pytest.approx(beta * r)



def test_cpo_loss_types_hand_computed():
    chosen = torch.tensor([-0.5, -1.0])
    rejected = torch.tensor([[-1.0, -2.0, 0.0], [-0.2, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    beta, gamma, alpha = 0.8, 0.5, 0.3
    pairs = [(-0.5, [-1.0, -2.0]), (-1.0, [-0.2])]
    for loss_type, expected in {
        "sigmoid": lambda d: -logsig(beta * d),
        "hinge": lambda d: max(0.0, 1 - beta * d),
        "ipo": lambda d: (d - 1 / (2 * beta)) ** 2,
        "simpo": lambda d: -logsig(beta * d - gamma),
    }.items():
        losses, _, _ = cpo_loss(chosen, rejected, mask, loss_type, beta=beta, gamma=gamma)
        for g, (c, rs) in enumerate(pairs):
            assert losses[g].item() == pytest.approx(expected(c - sum(rs) / len(rs)), rel=1e-6), loss_type
    # AlphaPO: rewards (1 - p ** -alpha) / alpha with p = exp(logp), the rejected ones averaged.
    losses, cr, rr = cpo_loss(chosen, rejected, mask, "sigmoid", beta=beta, alpha=alpha)
    for g, (c, rs) in enumerate(pairs):
        r_c = (1 - math.exp(c) ** -alpha) / alpha
        r_r = sum((1 - math.exp(r) ** -alpha) / alpha for r in rs) / len(rs)
        assert losses[g].item() == pytest.approx(-logsig(beta * (r_c - r_r)), rel=1e-6)
        assert cr[g].item() == pytest.approx(beta * r_c, rel=1e-5) and rr[g].item() == pytest.approx(beta * r_r, rel=1e-5)
    with pytest.raises(ValueError, match="loss_type"):
        cpo_loss(chosen, rejected, mask, "kto")


def test_bradley_terry_mean_pairwise_margin_and_centering():
    chosen = torch.tensor([1.0, 0.0])
    rejected = torch.tensor([[0.0, 3.0], [-1.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    margin = torch.tensor([0.2, 0.0])
    mean = bradley_terry_loss(chosen, rejected, mask, gamma=0.1, margin=margin, reject_aggregation="mean")
    assert mean[0].item() == pytest.approx(-logsig(1.0 - 1.5 - 0.3), rel=1e-6)
    assert mean[1].item() == pytest.approx(-logsig(0.0 + 1.0 - 0.1), rel=1e-6)
    pair = bradley_terry_loss(chosen, rejected, mask, gamma=0.1, margin=margin, reject_aggregation="pairwise")
    assert pair[0].item() == pytest.approx((-logsig(1.0 - 0.3) - logsig(1.0 - 3.0 - 0.3)) / 2, rel=1e-6)
    assert pair[1].item() == pytest.approx(mean[1].item(), rel=1e-6)  # k == 1: both aggregations agree
    assert center_rewards_penalty(chosen, rejected, mask).item() == pytest.approx(((1 + 0) ** 2 + 4**2) / 4 + 1 / 2)
    with pytest.raises(ValueError, match="reject_aggregation"):
        bradley_terry_loss(chosen, rejected, mask, reject_aggregation="max")
