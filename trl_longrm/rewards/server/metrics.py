"""The reward server's `/metrics`, in Prometheus' text format (the `prometheus_client` library, as vLLM serves its
own), on a registry of the server's own: two servers in one process never mix their counts."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest


PREFIX = "trl_longrm_reward_server"
# Judging a 128K-token group takes seconds to minutes; the HTTP requests wait as long as their group.
_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 180, 300, 600, 1800)


class ServerMetrics:
    """Counters, gauges and histograms of one reward server.

    Example:
    ```python
    >>> metrics = ServerMetrics(state=lambda: {"held_samples": 0, "pending_groups": 0, ...})
    >>> metrics.requests.labels(route="/verl", status="200").inc()
    >>> body, content_type = metrics.render()
    ```
    """

    def __init__(self, state=None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered, by route and status", ["route", "status"],
                                registry=r)  # fmt: skip
        self.samples = Counter(f"{PREFIX}_samples", "Samples rewarded (answered with a reward)", registry=r)
        self.unscored = Counter(f"{PREFIX}_unscored_samples", "Samples the judge left unscored (answered with their "
                                "group's mean)", registry=r)  # fmt: skip
        self.retries = Counter(f"{PREFIX}_adopted_retries", "Requests that repeated a sample whose first request had "
                               "gone (adopted, not counted twice)", registry=r)  # fmt: skip
        self.groups = Counter(f"{PREFIX}_groups", "Groups judged, by outcome (whole, partial: judged after "
                              "--group-timeout with what arrived, failed)", ["outcome"], registry=r)  # fmt: skip
        self.timeouts = Counter(f"{PREFIX}_group_timeouts", "Groups incomplete after --group-timeout", registry=r)
        self.refused = Counter(f"{PREFIX}_bad_requests", "Requests refused for their content, by field",
                               ["field"], registry=r)  # fmt: skip
        self.judge_errors = Counter(f"{PREFIX}_judge_errors", "Groups whose judging failed, by kind",
                                    ["kind"], registry=r)  # fmt: skip
        self.unparsed = Counter(f"{PREFIX}_unparsed_verdicts", "Judge verdicts that could not be read", registry=r)
        self.judge_seconds = Histogram(f"{PREFIX}_judge_seconds", "Seconds to judge a group (its requests to the "
                                       "judge server)", buckets=_SECONDS, registry=r)  # fmt: skip
        self.request_seconds = Histogram(f"{PREFIX}_request_seconds", "Seconds from a request's arrival to its answer",
                                         ["route"], buckets=_SECONDS, registry=r)  # fmt: skip
        if state is not None:
            gauges = {
                "held_samples": "Samples held, waiting for their group",
                "pending_groups": "Groups waiting for samples",
                "judging_groups": "Groups being judged or waiting for judge capacity",
                "judge_requests_in_flight": "Judge requests granted by the --max-concurrency budget",
            }
            for name, help_text in gauges.items():
                Gauge(f"{PREFIX}_{name}", help_text, registry=r).set_function(lambda name=name: state()[name])

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
