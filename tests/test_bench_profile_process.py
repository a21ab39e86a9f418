"""bench/profile_process.py: py-spy's folded stacks are counted for the innermost frame's part of the process."""

from __future__ import annotations

from bench.profile_process import PhaseProfile, group_samples, table

RAW = """\
run (gateway/server.py:184);Runner.run (asyncio/runners.py:118);FleetgateApp.__call__ (gateway/app.py:129);\
Dispatcher.handle (gateway/pipeline/dispatch.py:231) 5
Runner.run (asyncio/runners.py:118);RedisStore._refresh (gateway/state/redis_store.py:700);\
AsyncScript.__call__ (redis/commands/core.py:11005) 3
Runner.run (asyncio/runners.py:118);AbstractConnection._send_packed_command (redis/asyncio/connection.py:1168);\
StreamWriter.writelines (asyncio/streams.py:346) 2
Runner.run (asyncio/runners.py:118) 6
FleetgateHandler.emit_access (gateway/ops/logs.py:127) 4
<module> (something_else.py:1) 0
"""


def test_samples_go_to_the_innermost_known_part() -> None:
    shares, total = group_samples(RAW)
    assert total == 20
    assert shares["dispatch pipeline (gateway/pipeline/: dispatch, attempts, legs; app.py, wire/resume.py)"] == 5 / 20
    assert shares["Redis client (redis-py)"] == 3 / 20        # inside the store's call: redis-py's own frames
    assert shares["Redis socket writes and reads (asyncio streams: only redis-py uses them here)"] == 2 / 20
    assert shares["event loop, transports, tasks (asyncio, uvloop: C code shows as its caller)"] == 6 / 20
    assert shares["access log, observe (gateway/ops/: access_log, logs, observe, tracing)"] == 4 / 20
    assert abs(sum(shares.values()) - 1.0) < 1e-9


def test_the_table_turns_shares_into_microseconds() -> None:
    shares, total = group_samples(RAW)
    text = table([PhaseProfile("in-memory, non-streaming", 100, 1000.0, 0.2, shares, total)])
    assert "| dispatch pipeline (gateway/pipeline/: dispatch, attempts, legs; app.py, wire/resume.py) | 25.0% / 50 |" in text
    assert "**0.200**" in text
