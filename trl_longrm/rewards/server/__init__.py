"""`trl-longrm reward-server`: a group-aware HTTP reward server for RL frameworks that ask for one sample's reward at a
time (OpenRLHF's remote reward model, verl's reward loop through `trl_longrm.rewards.verl.JudgeRewardManager`).

A pairwise or ranking judge compares a prompt's samples, but these frameworks send each sample alone, from many
workers. The server holds each sample until its whole group has arrived (`group_size` samples of the same group key:
verl's `uid`, OpenRLHF's prompt text), judges the group once with `JudgeReward`, and answers every held request with
its own sample's reward. One module per job:

- `payloads`: the requests, checked field by field (a bad one refused alone, 4xx naming the field);
- `groups`: samples held by group (awaitables on one event loop), retries adopted, answers kept for them;
- `judging`: groups judged off the loop under one budget of requests in flight to the judge;
- `metrics`: `/metrics` in Prometheus' format;
- `app`: the aiohttp server (routes, limits, `/health`, the drain on SIGTERM);
- `main`: the command line.

Example:
```bash
trl-longrm reward-server --base-url http://127.0.0.1:8000/v1 --served-model judge --tokenizer ./LongReward_Qwen3-8B \\
    --protocol pairwise --group-size 8 --port 5000
```
"""

from trl_longrm.rewards.server.app import RewardServer, ServerSettings
from trl_longrm.rewards.server.groups import GroupCollector
from trl_longrm.rewards.server.payloads import openrlhf_response


__all__ = ["GroupCollector", "RewardServer", "ServerSettings", "openrlhf_response"]
