"""Batch progress lines and the stall warning (gateway/batch/progress.py), on a clock the test moves, and once
end to end: a batch whose only worker hangs is reported stalled by a running gateway."""

from __future__ import annotations

import json
import logging

import httpx

from gateway.batch.progress import BatchProgressLog
from tests.helpers import MODEL, poll, running_gateway


def test_progress_every_interval_and_one_warning_per_stall(caplog) -> None:
    caplog.set_level(logging.INFO, "fleetgate.batch")
    p = BatchProgressLog(every_s=30, stall_s=60)
    p.observe("b1", 0, 0, 100, 4, now=0)
    p.observe("b1", 40, 1, 60, 4, now=30)
    p.observe("b1", 40, 1, 60, 4, now=60)
    p.observe("b1", 40, 1, 60, 0, now=91)    # 61 s without a finished request
    p.observe("b1", 40, 1, 60, 0, now=120)   # still stalled: no second warning
    p.observe("b1", 45, 1, 55, 2, now=125)
    msgs = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert msgs[0] == ("INFO", "batch b1: 40/100 done (1 failed), 1.3 req/s, ~45 s left")
    stalls = [m for lvl, m in msgs if lvl == "WARNING"]
    assert stalls == ["batch b1 stalled: no request finished for 61 s (60 pending, 0 running anywhere)"]
    assert ("INFO", "batch b1 moving again: 45/100 done") in msgs


async def test_a_stuck_batch_is_reported_by_the_gateway(sim_fleet, caplog) -> None:
    caplog.set_level(logging.INFO, "fleetgate")
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls, batch={"poll_s": 0.02}) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        gw.gateway.batch.progress_log = BatchProgressLog(every_s=0.2, stall_s=1.0, check_s=0.1)
        await c.post(fleet.urls[0] + "/sim/faults", json={"hang": True})
        lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": MODEL, "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "x"}]}}) + "\n"
                        for i in range(3))
        f = (await c.post("/v1/files", files={"file": ("b.jsonl", lines)}, data={"purpose": "batch"})).json()
        b = (await c.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"})).json()
        await poll(lambda: any("stalled" in r.getMessage() for r in caplog.records), 15, "a stall warning")
        await c.delete(fleet.urls[0] + "/sim/faults")
    warning = next(r for r in caplog.records if "stalled" in r.getMessage())
    assert warning.levelname == "WARNING" and b["id"] in warning.getMessage() and "3 pending" in warning.getMessage()
