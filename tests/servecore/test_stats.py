"""``servecore.stats``: the counters stay bounded over a long life, and their figures stay
right."""

from __future__ import annotations

import copy
import random

from servecore.stats import TTFT_WINDOW, ServingStats, Window


def test_ttft_keeps_a_bounded_window_and_a_mean_over_every_request():
    rng = random.Random(0)
    values = [rng.uniform(0.001, 2.0) for _ in range(5 * TTFT_WINDOW + 17)]
    s = ServingStats()
    for v in values:
        s.add_ttft(v)
    assert len(s.ttft) == TTFT_WINDOW  # capped, not one float per request forever
    assert list(s.ttft) == values[-TTFT_WINDOW:]  # the most recent, oldest first
    assert s.ttft_count == len(values)
    assert abs(s.mean_ttft - sum(values) / len(values)) < 1e-12  # the plain computation
    assert s.ttft[-3:] == values[-3:] and isinstance(s.ttft[-3:], list)


def test_stats_given_a_ttft_list_count_it_and_copy_apart():
    s = ServingStats(ttft=[0.1, 0.3])
    assert isinstance(s.ttft, Window) and s.ttft_count == 2 and abs(s.mean_ttft - 0.2) < 1e-12
    before = copy.deepcopy(s)
    s.add_ttft(0.5)
    assert (s.ttft_count - before.ttft_count, list(before.ttft)) == (1, [0.1, 0.3])
    assert abs((s.ttft_sum - before.ttft_sum) - 0.5) < 1e-12
    assert ServingStats().mean_ttft == 0.0
