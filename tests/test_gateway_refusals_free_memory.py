"""A refused request leaves nothing for the cyclic garbage collector: its body (up to server.max_body_bytes) is
freed when the answer is sent, not at the next full collection. A kept exception with its traceback once tied the
request's frame into a cycle, and 2,000 fuzzed requests grew the gateway's RSS by a quarter (tests_chaos fuzz)."""

from __future__ import annotations

import gc

import httpx

from tests.helpers import MODEL, running_gateway


def _handle_frames_in(garbage: list[object]) -> int:
    return sum(1 for o in garbage if type(o).__name__ == "frame" and o.f_code.co_name == "handle")  # type: ignore[attr-defined]


async def test_refused_requests_leave_no_cycles(sim_url: str) -> None:
    async with running_gateway([sim_url]) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        bad = [b"{not json" + b"x" * 200_000,
               b'{"model": "%s", "messages": "not a list"}' % MODEL.encode(),
               b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}']
        for body in bad:   # warm: first-use allocations are not what this counts
            await c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            statuses = []
            for _ in range(5):
                for body in bad:
                    r = await c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
                    statuses.append(r.status_code)
            gc.collect()
            frames = _handle_frames_in(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert set(statuses) <= {400, 404} and statuses, statuses
        assert frames == 0, f"{frames} request frames were freed only by the cyclic collector"
