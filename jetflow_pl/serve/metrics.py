"""`/metrics`: the driver's counters in the Prometheus text format (`prometheus_client`).

A collector reads `DriverStats` at scrape time (one registry per app, so several servers in one process,
as in the tests, do not share series). Names follow Prometheus conventions (`_total` counters, base units);
rates are the scraper's job (`rate(jetflow_tokens_generated_total[1m])`), but a tokens/s gauge over the
last `RATE_WINDOW_S` seconds is exported too for a quick look without a Prometheus server.

vLLM's spec-decode counters are exported under vLLM's own names and labels (`model_name`, `engine`;
`position` for the per-position vector), so dashboards and benchmark tools written for vLLM read this
server unchanged: `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
`..._num_accepted_tokens_per_pos` (meanings in `driver.spec_decode_counts`). vLLM's mean acceptance length
is `1 + num_accepted_tokens / num_drafts`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from jetflow_pl.serve.driver import RATE_WINDOW_S, DriverStats, SpecDecodeCounts

__all__ = ["CONTENT_TYPE", "metrics_registry", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: request outcomes always exported (zero until one happens), so dashboards see every series
OUTCOMES = ("ok", "cancelled", "error", "rejected", "invalid")


class _DriverCollector:
    def __init__(self, stats: DriverStats, model: str, positions: int) -> None:
        self.stats = stats
        self.model = model
        self.positions = positions

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        rate = s.tokens_per_s()
        with s.lock:
            requests = {k: s.requests.get(k, 0) for k in OUTCOMES} | dict(s.requests)
            tokens, rounds, committed = s.tokens_generated, s.rounds, s.committed_in_rounds
            budgets = s.budget_sum
            lat_sum, ttft_sum, lat_n = s.latency_sum_s, s.ttft_sum_s, s.latency_count
            depth, active, steps = s.queue_depth, s.active, s.steps
            spec = SpecDecodeCounts()
            spec.add(s.spec)  # a copy, taken under the lock
        m = [self.model]
        req = CounterMetricFamily(
            "jetflow_requests",
            "Requests by outcome (rejected: queue full; invalid: a 4xx)",
            labels=["model", "outcome"],
        )
        for outcome, n in sorted(requests.items()):
            req.add_metric([*m, outcome], n)
        yield req
        yield _counter("jetflow_tokens_generated", "Tokens generated (all requests)", m, tokens)
        yield _counter(
            "jetflow_verify_rounds", "Request-rounds: one per request per verify forward", m, rounds
        )
        yield _counter("jetflow_engine_steps", "Engine scheduling steps", m, steps)
        yield _gauge(
            "jetflow_tau_mean",
            "Tokens committed per verify forward, over every finished request",
            m,
            committed / rounds if rounds else 0.0,
        )
        yield _gauge(
            "jetflow_draft_budget_mean",
            "Draft tokens per tree (0 = an AR round), over every finished request's rounds",
            m,
            budgets / rounds if rounds else 0.0,
        )
        yield _gauge(
            "jetflow_tokens_per_second",
            f"Tokens generated per second over the last {RATE_WINDOW_S:g} s",
            m,
            rate,
        )
        yield _gauge("jetflow_queue_depth", "Requests waiting for a slot", m, depth)
        yield _gauge("jetflow_active_requests", "Requests holding a slot (prefilling or decoding)", m, active)
        for name, doc, total in (
            ("jetflow_request_latency_seconds", "Submission to last token (finished requests)", lat_sum),
            ("jetflow_request_ttft_seconds", "Submission to first token (finished requests)", ttft_sum),
        ):
            summary = SummaryMetricFamily(name, doc, labels=["model"])
            summary.add_metric(m, count_value=lat_n, sum_value=total)
            yield summary
        yield from _vllm_spec_decode(self.model, self.positions, spec)


def _vllm_spec_decode(model: str, positions: int, spec: SpecDecodeCounts) -> Iterator[Metric]:
    """vLLM's four spec-decode counters, named and labelled as vLLM exports them (engine "0")."""
    labels = ["model_name", "engine"]
    values = [model, "0"]
    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens),
    ):
        c = CounterMetricFamily(name, doc, labels=labels)
        c.add_metric(values, value)
        yield c
    c = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=[*labels, "position"],
    )
    per_pos = spec.accepted_per_pos
    for pos in range(max(positions, len(per_pos))):
        c.add_metric([*values, str(pos)], per_pos[pos] if pos < len(per_pos) else 0)
    yield c


def _counter(name: str, doc: str, labels: list[str], value: float) -> Metric:
    c = CounterMetricFamily(name.removesuffix("_total"), doc, labels=["model"])
    c.add_metric(labels, value)
    return c


def _gauge(name: str, doc: str, labels: list[str], value: float) -> Metric:
    g = GaugeMetricFamily(name, doc, labels=["model"])
    g.add_metric(labels, value)
    return g


def metrics_registry(stats: DriverStats, model: str, positions: int = 0) -> CollectorRegistry:
    """A registry holding only this server's metrics; `positions`: how many draft depths the per-position
    vector always lists (the head's `block_size - 1`, as vLLM lists `num_speculative_tokens`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_DriverCollector(stats, model, positions))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
