"""A vLLM server dies (SIGKILL of its whole process tree) while streams run through the gateway.

Every open stream must end within a bounded time (completed, resumed elsewhere, an SSE error event or a
truncated stream: anything but a hang), the gateway takes the dead worker out of rotation, and new requests
go to the surviving server. Runs last (marker `destructive`); the killed server stays down.

The test runs its own gateway, started just before the streams: the session gateway has judged both servers
for the whole suite (paces, stall ejections, sleep states seen), and what is tested here is only what a kill
does. CI once saw the session gateway place none of the four streams on the server about to die.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests_vllm.conftest import MODEL, engine_metric, metric_samples, run_gateway, wait_until

STREAMS = 4
STREAM_END_S = 60.0


class StreamWatch:
    """Consumes one stream in a thread and records how it ended."""

    def __init__(self, client: openai.OpenAI, index: int) -> None:
        self.client = client
        self.index = index
        self.chunks = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"stream {self.index}"}], max_tokens=400,
                stream=True, temperature=0, extra_body={"ignore_eos": True})
            for chunk in stream:
                self.chunks += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish_reason = chunk.choices[0].finish_reason
        except Exception as exc:  # an APIError from an SSE error event, or a cut connection
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended.set()

    @property
    def outcome(self) -> str:
        if self.error:
            return "error"
        return "completed" if self.finish_reason else "truncated"


@pytest.mark.destructive
def test_killed_server_ends_open_streams_and_traffic_moves_to_the_survivor(  # noqa: ANN001
        vllm_fleet, plain_server, prio_server) -> None:
    wait_until(lambda: engine_metric(plain_server.url, "vllm:num_requests_running") == 0, 30, "idle servers")
    with run_gateway([plain_server.url, prio_server.url]) as gateway:
        _kill_under_streams(gateway, plain_server, prio_server)


def _kill_under_streams(gateway, plain_server, prio_server) -> None:  # noqa: ANN001
    client = gateway.client(timeout=STREAM_END_S)
    wait_until(lambda: all(w["healthy"] and w["engine"]["sleep_state"] == "awake" for w in gateway.workers())
               and len(gateway.workers()) == 2, 30, "both workers in rotation and awake")
    watches = [StreamWatch(client, i) for i in range(STREAMS)]
    for w in watches:
        w.thread.start()

    def plain_generating() -> bool:
        failed = [w.error for w in watches if w.error]
        assert not failed, f"streams failed before the kill: {failed}"
        return engine_metric(plain_server.url, "vllm:num_requests_running") >= 1

    # least_tokens spreads the streams (two each); the plain server runs its share at once (prio queues them
    # one by one).
    try:
        wait_until(plain_generating, 30, "a stream to be generating on the server about to die")
    except BaseException:
        print(f"gateway's workers: {gateway.workers()}\nstreams: {[(w.chunks, w.error) for w in watches]}\n"
              f"gateway log:\n{gateway.log_tail(40)}")
        raise
    wait_until(lambda: sum(w.chunks > 0 for w in watches) >= 1, 30, "a stream to deliver chunks")
    killed_at = time.monotonic()
    plain_server.kill()
    # A request right after the kill: a refused connection before any byte is retried on the survivor.
    resp = client.completions.create(model=MODEL, prompt="right after", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 4

    for w in watches:
        assert w.ended.wait(max(0.0, killed_at + STREAM_END_S - time.monotonic())), \
            f"stream {w.index} still open {STREAM_END_S:.0f} s after the kill ({w.chunks} chunks so far)"
    outcomes = [w.outcome for w in watches]
    print(f"stream outcomes after the kill: {outcomes}; errors: {[w.error for w in watches if w.error]}")
    assert all(w.chunks > 0 or w.error for w in watches)

    # The gateway notices the dead worker and stops routing to it.
    dead_id = gateway.worker_for(plain_server.url)["id"]
    wait_until(lambda: not gateway.worker_for(plain_server.url)["healthy"], 30,
               "the gateway to mark the killed worker unhealthy")
    healthy = {labels["worker"]: v for labels, v in metric_samples(gateway.metrics(), "fleetgate_worker_healthy")}
    assert healthy[dead_id] == 0 and sum(healthy.values()) == 1

    served_before = engine_metric(prio_server.url, "vllm:request_success_total")
    for i in range(3):
        resp = client.completions.create(model=MODEL, prompt=f"after {i}", max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 4
    wait_until(lambda: engine_metric(prio_server.url, "vllm:request_success_total") >= served_before + 3, 10,
               "the survivor to have served the new requests")
