"""``Metrics``: the server's counters, in Prometheus' text format (``GET /metrics``).

Requests by route and status, prompt, cached and generated tokens, requests waiting and
running, and histograms of the time to first token and of the whole request. The engine's
own ``stats`` (prefix-cache hit rate and the rest) are exported beside them when it has any.

>>> m = Metrics()
>>> m.request("/v1/completions", 200)
>>> m.observe_ttft(0.03)
>>> text = m.render(waiting=1, running=2)
>>> 'servecore_requests_total{route="/v1/completions",status="200"} 1' in text
True
>>> 'servecore_time_to_first_token_seconds_bucket{le="0.05"} 1' in text
True
"""

from __future__ import annotations

import threading
from collections import Counter

from servecore.stats import ServingStats

__all__ = ["Metrics"]

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Histogram:
    def __init__(self):
        self.counts = [0] * len(BUCKETS)
        self.count, self.sum = 0, 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        for i, b in enumerate(BUCKETS):
            if seconds <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(BUCKETS, self.counts,
                                                                  strict=True)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}",
                f"{name}_count {self.count}"]
        return out


class Metrics:
    """The server's counters (see the module docstring); safe to update from any thread.

    >>> m = Metrics()
    >>> m.add_tokens(prompt=10, cached=8, completion=3)
    >>> "servecore_cached_tokens_total 8" in m.render(waiting=0, running=0)
    True
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.tokens: Counter[str] = Counter()  # prompt, cached, completion
        self.disconnects = 0
        self.ttft = _Histogram()
        self.latency = _Histogram()

    def request(self, route: str, status: int) -> None:
        """Count one answered request."""
        with self._lock:
            self.requests[route, status] += 1

    def add_tokens(self, prompt: int, cached: int, completion: int) -> None:
        """Count one generation's tokens."""
        with self._lock:
            self.tokens.update(prompt=prompt, cached=cached, completion=completion)

    def disconnected(self) -> None:
        """Count a client that left before its answer ended."""
        with self._lock:
            self.disconnects += 1

    def observe_ttft(self, seconds: float) -> None:
        """Record one time to first token."""
        with self._lock:
            self.ttft.observe(seconds)

    def observe_latency(self, seconds: float) -> None:
        """Record one request's whole time."""
        with self._lock:
            self.latency.observe(seconds)

    def render(self, *, waiting: int, running: int,
               engine_stats: ServingStats | None = None) -> str:
        """Everything, in Prometheus' text format."""
        with self._lock:
            lines = ["# TYPE servecore_requests_total counter"]
            lines += [f'servecore_requests_total{{route="{r}",status="{s}"}} {n}'
                      for (r, s), n in sorted(self.requests.items())]
            for kind in ("prompt", "cached", "completion"):
                lines += [f"# TYPE servecore_{kind}_tokens_total counter",
                          f"servecore_{kind}_tokens_total {self.tokens[kind]}"]
            lines += ["# TYPE servecore_client_disconnects_total counter",
                      f"servecore_client_disconnects_total {self.disconnects}",
                      "# TYPE servecore_requests_waiting gauge",
                      f"servecore_requests_waiting {waiting}",
                      "# TYPE servecore_requests_running gauge",
                      f"servecore_requests_running {running}"]
            lines += self.ttft.lines("servecore_time_to_first_token_seconds")
            lines += self.latency.lines("servecore_request_seconds")
        if engine_stats is not None:
            st = engine_stats
            for name, value in (("hit_rate", st.hit_rate), ("cached_tokens", st.cached_tokens),
                                ("prompt_tokens", st.prompt_tokens),
                                ("prefill_tokens", st.prefill_tokens),
                                ("decode_tokens", st.decode_tokens),
                                ("requests", st.requests)):
                lines += [f"# TYPE servecore_engine_{name} gauge",
                          f"servecore_engine_{name} {value}"]
        return "\n".join(lines) + "\n"
