"""LongRM preference losses on per-sequence values, with k >= 1 rejected responses per prompt.

Both losses take the chosen value of each group, shape `[G]`, and the rejected values as a padded `[G, K]` tensor
with a boolean mask of the same shape (groups may have different numbers of rejected responses). They return
per-group losses; the trainers average them.

Example:
```python
>>> import torch
>>> from trl_longrm.losses import simpo_loss
>>> chosen = torch.tensor([-0.5]); rejected = torch.tensor([[-1.0, -2.0]]); mask = torch.ones(1, 2, dtype=torch.bool)
>>> losses, chosen_rewards, rejected_rewards = simpo_loss(chosen, rejected, mask, beta=2.5, gamma=0.5)
```
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Mean of `values` over `dim` where `mask` is true (rows with no true entry give 0)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


# CPO loss types whose sequence log-probs are length-normalised (TRL's `average_log_prob`); the others sum them.
AVERAGED_LOSS_TYPES = ("simpo", "ipo")
CPO_LOSS_TYPES = ("simpo", "sigmoid", "hinge", "ipo")


def cpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    rejected_mask: torch.Tensor,
    loss_type: str = "simpo",
    beta: float = 2.5,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's `CPOTrainer.cpo_loss` with k >= 1 rejected responses per group, compared through their mean reward.

    Rewards are the log-probs (`alpha == 0`) or AlphaPO's `(1 - p ** -alpha) / alpha` with `p = exp(logp)`; with
    `d = reward_chosen - mean_k reward_rejected_k` (one rejected response: TRL's exactly):
    - `"simpo"`: `-logsigmoid(beta * d - gamma) * (1 - ls) - logsigmoid(-(beta * d - gamma)) * ls` (LongRM: the mean
      of the rejected length-normalised log-probs; `gamma` is absolute, as TRL's `simpo_gamma`);
    - `"sigmoid"`: the same without `gamma`;
    - `"hinge"`: `relu(1 - beta * d)`;
    - `"ipo"`: `(d - 1 / (2 * beta)) ** 2`.
    The log-probs are length-normalised for `simpo` and `ipo` and summed for the others (`AVERAGED_LOSS_TYPES`): the
    caller passes them so. Returns `(losses [G], chosen_rewards [G], rejected_rewards [G])`, rewards being `beta *`
    reward (the rejected one averaged over the k responses), detached, as TRL reports them.
    """
    if loss_type not in CPO_LOSS_TYPES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; expected one of {list(CPO_LOSS_TYPES)}.")

    def reward(logps):
        return logps if alpha == 0 else (1 - torch.exp(logps).pow(-alpha)) / alpha

    chosen_reward = reward(chosen_logps)
    rejected_reward = masked_mean(reward(rejected_logps), rejected_mask)
    d = chosen_reward - rejected_reward
    if loss_type in ("simpo", "sigmoid"):
        logits = beta * d - (gamma if loss_type == "simpo" else 0.0)
        losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * d)
    else:
        losses = (d - 1 / (2 * beta)) ** 2
    return losses, beta * chosen_reward.detach(), beta * rejected_reward.detach()


def simpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    rejected_mask: torch.Tensor,
    beta: float = 2.5,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO on length-normalised log-probs against the mean of the rejected ones (LongRM): `cpo_loss(...,
    loss_type="simpo")`, i.e. `-logsigmoid(beta * (logp_chosen - mean_k logp_rejected_k) - gamma)` with label
    smoothing."""
    return cpo_loss(chosen_logps, rejected_logps, rejected_mask, "simpo", beta, gamma, label_smoothing)


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    rejected_mask: torch.Tensor,
    gamma: float = 0.0,
    margin: torch.Tensor | None = None,
    reject_aggregation: str = "mean",
) -> torch.Tensor:
    """Bradley-Terry loss of a chosen score against k rejected scores.

    - `"mean"` (LongRM): `-logsigmoid(s_chosen - mean_k s_rejected_k - gamma - margin)`: one comparison against
      the average rejected response; a single very bad rejected response can carry the others.
    - `"pairwise"`: `mean_k -logsigmoid(s_chosen - s_rejected_k - gamma - margin)`: every rejected response must be
      beaten on its own; it is the usual multi-negative generalisation and equals `"mean"` when k == 1.

    `gamma` is a SimPO-style target margin shared by all groups, `margin` an optional per-group margin from the data
    (as TRL's `RewardTrainer` uses it). Returns per-group losses `[G]`.
    """
    offset = gamma if margin is None else gamma + margin
    if reject_aggregation == "mean":
        return -F.logsigmoid(chosen_scores - masked_mean(rejected_scores, rejected_mask) - offset)
    if reject_aggregation == "pairwise":
        offset = offset.unsqueeze(-1) if isinstance(offset, torch.Tensor) else offset
        pairwise = -F.logsigmoid(chosen_scores.unsqueeze(-1) - rejected_scores - offset)
        return masked_mean(pairwise, rejected_mask)
    raise ValueError(f"Unknown reject_aggregation {reject_aggregation!r}; expected 'mean' or 'pairwise'.")


def center_rewards_penalty(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, rejected_mask: torch.Tensor
) -> torch.Tensor:
    """TRL's reward-centering term `mean((s_chosen + s_rejected)^2)`, over every (chosen, rejected_k) pair."""
    return masked_mean((chosen_scores.unsqueeze(-1) + rejected_scores) ** 2, rejected_mask).mean()


def group_values(
    values: torch.Tensor, group_index: torch.Tensor, response_index: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split per-sequence values `[S]` into chosen `[G]` and padded rejected `[G, K]` with a mask.

    `group_index[s]` is the group of sequence `s`; `response_index[s]` is 0 for the chosen response and `1..k` for
    the rejected ones.
    """
    is_chosen = response_index == 0
    chosen = values.new_zeros(num_groups).index_put((group_index[is_chosen],), values[is_chosen])
    max_rejected = int(response_index.max().item()) if response_index.numel() else 0
    rejected = values.new_zeros(num_groups, max(max_rejected, 1))
    mask = torch.zeros(num_groups, max(max_rejected, 1), dtype=torch.bool, device=values.device)
    rej = ~is_chosen
    slots = (group_index[rej], response_index[rej] - 1)
    rejected = rejected.index_put(slots, values[rej])
    mask = mask.index_put(slots, torch.ones_like(values[rej], dtype=torch.bool))
    return chosen, rejected, mask
