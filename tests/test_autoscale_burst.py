"""`fleetgate demo --autoscale`'s steady burst against the live gateway (bench/autoscale_live.py): the fleet grows
once and shrinks once, after the burst, and no worker is stopped with a request on it."""

from __future__ import annotations

import pytest

from bench.autoscale_live import direction_changes, run_burst
from tests.helpers import free_port_range


def test_direction_changes_counts_sign_flips() -> None:
    assert direction_changes([7, -2, 2, -2, -1, 3]) == 4       # the flapping run the demo showed
    assert direction_changes([3, 4, -1, -2, -1]) == 1
    assert direction_changes([]) == 0


@pytest.mark.slow  # one burst at --time-scale 10: ~30 s
async def test_one_steady_burst_grows_the_fleet_then_shrinks_it_after_the_calm() -> None:
    burst_s = 12.0
    r = await run_burst(time_scale=10.0, users=32, burst_s=burst_s, workers=1, base_port=free_port_range(10))
    changes = [a["change"] for a in r.actions]
    assert changes and changes[0] > 0, r.actions                   # the burst made it grow
    assert r.direction_changes == 1, r.actions                     # grow, then shrink: once each
    assert all(a["t"] >= burst_s for a in r.actions if a["change"] < 0), r.actions   # shrinking waited for the calm
    assert r.peak_workers > 1 and r.final_workers == 1, (r.peak_workers, r.final_workers)
    assert r.stopped_busy == [], r.stopped_busy                    # every engine was idle when stopped
    assert r.worker_errors == [] and r.retries == 0 and r.stream_breaks == 0, (r.worker_errors, r.retries)
    # the only client-visible errors: 429s shed by the queue while one worker meets 32 users (the demo's own
    # users retry them); no request failed on a worker
    assert r.requests > 100 and set(r.failures) <= {"RateLimitError 429"}, r.failures
