"""The status page, loaded in headless Chromium (Debian's `chromium`) against a running `fleetgate demo` under
traffic: the fleet table names the workers, their health, cap and throughput, the models table shows request
rate, TTFT / TPOT percentiles, errors and history sparklines, the SLO table the attainment the JSON endpoint
reports. Chromium missing is a failure, not a skip (.ci/run installs it). With FLEETGATE_SCREENSHOT_DIR set,
the screenshot is copied there (bench/results/status_page.png was taken so).

In this process: the JSON's numbers against requests whose outcome the test decides (429s from a key's limit,
5xx from failing workers, a client that leaves), and /metrics without `*_created` series."""

from __future__ import annotations

import html
import math
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.ops.metrics import TTFT_BUCKETS
from gateway.ops.status_history import quantile
from simulator.profiles import load_profile
from tests.helpers import (
    ADMIN_KEY,
    MODEL,
    CliProcess,
    free_port_range,
    metric,
    poll,
    poll_sync,
    running_gateway,
)

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage")


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Chromium is needed for this test: apt-get install chromium (.ci/run does)"
    return path


def render(url: str, profile: Path, screenshot: Path | None = None) -> str:
    """The page's DOM after its scripts ran (Chromium's virtual time lets the first fetches finish)."""
    args = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=8000"]
    if screenshot is not None:
        subprocess.run([*args, f"--screenshot={screenshot}", "--window-size=1400,1000", url],
                       capture_output=True, timeout=60, check=False)
    r = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def table_rows(dom: str, table_id: str) -> list[list[str]]:
    m = re.search(rf'<table id="{table_id}">(.*?)</table>', dom, re.S)
    assert m, f"no table {table_id} in the page"
    body = m.group(1).split("<tbody>", 1)[1]
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in re.findall(r"<tr>(.*?)</tr>", body, re.S)]


def _traffic(url: str, phases: tuple[tuple[int, float], ...]) -> int:
    """Streamed chat requests from `n` threads for `seconds`, phase after phase (a shape for the sparklines);
    how many were sent."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20)
    sent = [0]

    def loop(until: float) -> None:
        while time.monotonic() < until:
            for _ in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=24, stream=True):  # streams: TTFT and TPOT
                pass
            sent[0] += 1

    for n, seconds in phases:
        until = time.monotonic() + seconds
        threads = [threading.Thread(target=loop, args=(until,)) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return sent[0]


def _num(text: str) -> float:
    return float(text.split()[0].replace(",", ""))


@pytest.mark.slow  # a demo process and a browser
def test_status_page_shows_the_fleet_rates_latencies_history_and_slo_attainment(tmp_path) -> None:
    chromium()
    base = free_port_range(3)
    url = f"http://127.0.0.1:{base}"
    env = {"FLEETGATE_STATUS__SAMPLE_S": "0.5"}  # a sparkline point every half second: a short test draws lines
    with CliProcess("demo", "--port", str(base), "--workers", "2", "--time-scale", "20", env=env,
                    merge_stderr=True) as demo:
        demo.wait_for("fleetgate listening on", timeout=60)
        sent = _traffic(url, ((1, 2.0), (4, 3.0), (2, 2.0), (1, 1.5)))
        status = poll_sync(lambda: _judged(url, sent), 10, "SLO-judged requests in the status JSON", every=0.1)
        mistakes = _deliberate_4xx(url)
        poll_sync(lambda: _errors_seen(url, mistakes), 10, "the deliberate 4xx in the status JSON", every=0.1)
        shot = tmp_path / "status.png"
        dom = render(url + "/", tmp_path / "chromium-profile", shot)
    assert shot.stat().st_size > 10_000  # the screenshot rendered something
    if os.environ.get("FLEETGATE_SCREENSHOT_DIR"):  # bench/results/status_page.png is taken this way
        shutil.copy(shot, Path(os.environ["FLEETGATE_SCREENSHOT_DIR"]) / "status_page.png")

    fleet = table_rows(dom, "fleet")
    assert sorted(r[0] for r in fleet) == ["sim-0", "sim-1"], fleet
    assert all(r[4] == "healthy" for r in fleet) and all(r[1] == "mixed" for r in fleet)
    max_seqs = load_profile("llama3-8b-h100").max_num_seqs
    assert all(r[6] == f"{max_seqs} (engine)" for r in fleet), fleet  # no gateway cap: the engine's own limit
    assert sum(_num(r[10]) for r in fleet) > 0, fleet                 # tokens/s

    (row,) = [r for r in table_rows(dom, "models") if r[0] == MODEL]
    model = status["models"][0]
    assert row[1] == model["policy"] and _num(row[4]) > 0               # req/s
    assert 0 < _num(row[6]) <= _num(row[7])                           # TTFT p50 <= p99
    assert 0 < _num(row[9]) <= _num(row[10])                          # TPOT p50 <= p99
    assert row[11:15] == ["0", "0", "0", "0"], row                     # no 4xx, 429, 5xx or client gone
    models_table = re.search(r'<table id="models">(.*?)</table>', dom, re.S).group(1)
    assert models_table.count("<polyline") >= 2, "no sparkline drawn from the history"

    # The deliberate mistakes, by reason: unknown models, bad bodies, no route; and the unknown names themselves.
    errors = {(r[0], r[1], r[2]): int(r[3]) for r in table_rows(dom, "errors")}
    assert errors == mistakes, errors
    assert "gpt-4o-typo (5)" in dom and "llama-nope (3)" in dom, "the unknown model names are not on the page"
    tile = re.search(r'id="t-errors">([^<]*)<', dom).group(1)
    assert tile == f"{sum(mistakes.values())} · 0 · 0 · 0", tile

    (slo_row,) = [r for r in table_rows(dom, "slo") if r[0] == MODEL]
    slo = model["slo"]["interactive"]
    assert slo_row[1] == "interactive"
    assert slo_row[2] == f"{100 * slo['attainment']:.1f}%"
    assert slo_row[3] == f"{slo['met']} / {slo['missed']}" and slo["met"] + slo["missed"] == sent
    assert "TTFT 1000 ms" in slo_row[4]


def _deliberate_4xx(url: str) -> dict[tuple[str, str, str], int]:
    """What a newcomer gets wrong: models that do not exist, bodies without messages, a path with a typo; the
    (model, status, reason) rows the page should show for them."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20)
    for name, n in (("gpt-4o-typo", 5), ("llama-nope", 3)):
        for _ in range(n):
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    for _ in range(4):
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2}, timeout=20)
        assert r.status_code == 400, r.text
    for _ in range(2):
        assert httpx.post(url + "/v1/chat/complete", json={}, timeout=20).status_code == 404
    return {("_unknown", "404", "model_not_found"): 8, ("_unknown", "400", "invalid_request_error"): 4,
            ("_unknown", "404", "no_route"): 2}


def _errors_seen(url: str, want: dict[tuple[str, str, str], int]) -> bool:
    s = httpx.get(url + "/ui/status.json", timeout=5).json()
    return {(e["model"], str(e["status"]), e["reason"]): e["count"] for e in s["errors"]} == want


def _judged(url: str, n: int) -> dict | None:
    s = httpx.get(url + "/ui/status.json", timeout=5).json()
    slo = s["models"][0]["slo"].get("interactive") if s["models"] else None
    return s if slo and slo["met"] + slo["missed"] >= n else None


# --- the numbers behind the page, in this process ---------------------------------------------------------------
KEY = "fg-status-key-0123"


async def _stream_ttft(http: httpx.AsyncClient, url: str, tokens: int) -> float:
    """Seconds until the first content chunk of a streamed chat completion (read to its end)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    headers = {"authorization": f"Bearer {KEY}", "x-sim-output-tokens": str(tokens)}
    t0 = time.perf_counter()
    first = None
    async with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if first is None and '"content"' in line:
                first = time.perf_counter() - t0
    assert first is not None
    return first


async def test_status_json_has_rates_latencies_errors_throughput_and_history(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=20)
    profile = load_profile("llama3-8b-h100")
    workers = [{"id": "w0", "url": fleet.urls[0], "cap": 5, "profile": "llama3-8b-h100"},
               {"id": "w1", "url": fleet.urls[1], "profile": "llama3-8b-h100"}]
    ok, rpm = 8, 12
    cfg = {"workers": workers, "status": {"sample_s": 0.2, "window_s": 120, "history_s": 120},
           "auth": {"admin_key": ADMIN_KEY, "keys": [{"key": KEY, "rpm": rpm}]}}
    async with running_gateway(**cfg) as gw, httpx.AsyncClient(timeout=30) as http:
        workers_scraped = lambda: all(ws.metrics.scraped_at > 0 for ws in gw.gateway.registry.workers.values())  # noqa: E731
        await poll(workers_scraped, 10, "both workers scraped (their token counters are read from then on)")
        ttfts = [await _stream_ttft(http, gw.url, 16) for _ in range(ok)]
        # A client that leaves mid-stream.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000, "stream": True}
        hdr = {"authorization": f"Bearer {KEY}", "x-sim-output-tokens": "4000"}
        async with http.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=hdr) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                break
        # Two worker failures on every worker: 5xx answers.
        for u in fleet.urls:
            assert (await http.post(u + "/sim/faults", json={"error_status": 500})).status_code == 200
        for _ in range(2):
            r = await http.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                                json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            assert 500 <= r.status_code < 600, r.text
        for u in fleet.urls:
            assert (await http.delete(u + "/sim/faults")).status_code == 200
        # The key's requests per minute run out: 429s (counted as the client saw them: on a slow machine the
        # limit may have refilled a request meanwhile).
        total, refused = ok + 1 + 2, 0
        while refused < 3 and total < 4 * rpm:
            r = await http.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                                json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            assert r.status_code in (200, 429), r.text
            total, refused = total + 1, refused + (r.status_code == 429)
        assert refused == 3

        def settled() -> dict | None:
            s = gw.gateway.status_history
            h = s.describe()["models"].get(MODEL)
            scraped = any(s.current()[2].values())  # a scrape after the requests read the engines' counters
            return h if h and scraped and len(h["request_rate"]) >= 3 and \
                sum(x or 0 for x in h["errors_429"]) == refused and sum(x or 0 for x in h["client_gone"]) == 1 else None

        hist = await poll(settled, 10, "the 429s and the client that left in the history")
        doc = (await http.get(gw.url + "/ui/status.json", headers={"authorization": f"Bearer {KEY}"})).json()
        metrics_text = (await http.get(gw.url + "/metrics")).text

    m = next(x for x in doc["models"] if x["id"] == MODEL)
    assert m["errors"] == {"4xx": 0, "429": refused, "5xx": 2, "client_gone": 1}, m
    # The error table: the same answers by status and reason (the key's limit, the workers' failures, the client
    # that left), and fleetgate_responses_total with them.
    table = {(e["model"], e["status"], e["reason"]): e["count"] for e in doc["errors"]}
    fives = {k: n for k, n in table.items() if k[1] >= 500}   # the workers' 500 relayed (on a slow machine a
    assert sum(fives.values()) == 2 and all(k[2] in ("worker", "worker_failed") for k in fives), table  # 502)
    assert {k: n for k, n in table.items() if k[1] < 500} == {(MODEL, 429, "rate_limit_exceeded"): refused,
                                                             (MODEL, 499, "client_gone"): 1}, table
    assert metric(metrics_text, "fleetgate_responses_total",
                  {"model": MODEL, "status": "429", "class": "4xx", "reason": "rate_limit_exceeded"}) == refused
    assert metric(metrics_text, "fleetgate_responses_total",
                  {"model": MODEL, "status": "200", "class": "2xx", "reason": "ok"}) == total - refused - 2 - 1
    # The rate covers the window the JSON reports: requests = rate x window.
    assert abs(m["request_rate"] * doc["window_s"] - total) <= 0.02 * total, (m["request_rate"], doc["window_s"])
    # Percentiles: ordered, and p99 no later than the bucket holding the slowest TTFT the client saw (the gateway
    # measures from arrival to relay, a little less than the client).
    assert 0 < m["ttft_p50_ms"] <= m["ttft_p99_ms"] <= 1000 * next(b for b in TTFT_BUCKETS if b >= max(ttfts))
    assert 0 < m["tpot_p50_ms"] <= m["tpot_p99_ms"]
    # History: one point per sample, every request in exactly one of them.
    rates, t = hist["request_rate"], doc["history"]["t"]
    assert len(rates) == len(t) >= 3
    assert sum(x or 0 for x in hist["errors_5xx"]) == 2 and max(x or 0 for x in rates) > 0
    assert t == sorted(t) and len(hist["ttft_p99_ms"]) == len(t)
    # Workers: throughput from the engines' generated tokens, and the cap filled either way.
    fleet_rows = {w["id"]: w for w in doc["fleet"]}
    assert (fleet_rows["w0"]["cap"], fleet_rows["w0"]["cap_source"]) == (5, "gateway")
    assert (fleet_rows["w1"]["cap"], fleet_rows["w1"]["cap_source"]) == (profile.max_num_seqs, "engine")
    assert sum(w["throughput_tokens_s"] or 0 for w in doc["fleet"]) > 0, doc["fleet"]
    assert set(doc["history"]["workers"]) == {"w0", "w1"}
    # /metrics: the series are there, without their creation timestamps.
    assert "fleetgate_requests_total{" in metrics_text
    assert not [line for line in metrics_text.splitlines() if "_created" in line]


def test_quantiles_interpolate_within_buckets_as_prometheus_does() -> None:
    bounds = (0.1, 0.2, 0.5, math.inf)
    assert quantile(0.5, bounds, (0, 10, 0, 0)) == pytest.approx(0.15)      # half-way through (0.1, 0.2]
    assert quantile(0.99, bounds, (2, 6, 2, 0)) == pytest.approx(0.2 + 0.3 * (9.9 - 8) / 2)
    assert quantile(0.1, bounds, (4, 0, 0, 0)) == pytest.approx(0.1 * 0.4 / 4)  # the first bucket starts at 0
    assert quantile(0.99, bounds, (0, 0, 1, 9)) == 0.5                      # in +Inf: the largest finite bound
    assert quantile(0.5, bounds, (0, 0, 0, 0)) is None


async def test_the_history_keeps_a_bounded_number_of_samples() -> None:
    async with running_gateway(status={"sample_s": 1.0, "history_s": 10.0, "window_s": 4.0}) as gw:
        h = gw.gateway.status_history
        for _ in range(50):
            h.sample()
        assert len(h.points) == 10 and len(h.recent) == 5
        assert len(h.describe()["t"]) == 10


async def test_every_4xx_is_counted_by_reason_with_unknown_model_names_bounded(sim_fleet) -> None:
    """400, 401, 403, 404 (unknown model, a model the key may not use, no route) and 413 each land in the status
    JSON's error table and in fleetgate_responses_total with their reason; unknown model names share the
    `_unknown` label, and only the last 10 of them are kept, shown to the admin key but not to an inference key."""
    fleet = sim_fleet(fleet={"servers": [{"model": MODEL}, {"model": "other"}]}, time_scale=50)
    workers = [{"id": "w0", "url": fleet.urls[0], "models": [MODEL]}, {"id": "w1", "url": fleet.urls[1],
                                                                      "models": ["other"]}]
    cfg = {"workers": workers, "limits": {"max_body_bytes": 2048},
           "auth": {"admin_key": ADMIN_KEY, "keys": [{"key": KEY, "models": [MODEL]}]}}
    key, admin = {"authorization": f"Bearer {KEY}"}, {"authorization": f"Bearer {ADMIN_KEY}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with running_gateway(**cfg) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        sent = [
            await http.post("/v1/chat/completions", json=chat, headers={"authorization": "Bearer sk-nope"}),  # 401
            await http.post("/v1/chat/completions", json={"model": MODEL}, headers=key),                   # 400
            await http.post("/v1/chat/completions", content=b"{" + b" " * 4096 + b"}", headers=key),         # 413
            await http.post("/v1/chat/completions", json={**chat, "model": "other"}, headers=key),          # 404
            await http.post("/v1/chat/complete", json=chat, headers=key),                                  # 404
            await http.post("/admin/workers", json={"id": "x", "url": "http://10.9.9.9:8000"}, headers=admin),  # 403
            await http.post("/v1/chat/completions", json=chat, headers=key),                               # 200
        ]
        for i in range(12):                                                                                # 404
            sent.append(await http.post("/v1/chat/completions", json={**chat, "model": f"typo-{i}"}, headers=key))
        assert [r.status_code for r in sent[:7]] == [401, 400, 413, 404, 404, 403, 200], [r.text for r in sent]
        doc = (await http.get("/ui/status.json", headers=admin)).json()
        tenant_doc = (await http.get("/ui/status.json", headers=key)).json()
        metrics_text = (await http.get("/metrics", headers=admin)).text
    table = {(e["model"], e["status"], e["reason"]): e["count"] for e in doc["errors"]}
    assert table == {("_unknown", 401, "invalid_api_key"): 1, ("_unknown", 400, "invalid_request_error"): 1,
                     ("_unknown", 413, "request_too_large"): 1, ("other", 404, "model_not_found"): 1,
                     ("_unknown", 404, "no_route"): 1, ("_unknown", 403, "worker_host_not_allowed"): 1,
                     ("_unknown", 404, "model_not_found"): 12}, table
    assert [u["model"] for u in doc["unknown_models"]] == [f"typo-{i}" for i in range(11, 1, -1)]  # the last 10
    assert tenant_doc["unknown_models"] == []                  # other callers' typos are the admin's to see
    (m,) = [x for x in doc["models"] if x["id"] == MODEL]
    assert m["errors"]["4xx"] == 0 and [x for x in doc["models"] if x["id"] == "other"][0]["errors"]["4xx"] == 1
    assert metric(metrics_text, "fleetgate_responses_total",
                  {"model": "_unknown", "status": "404", "class": "4xx", "reason": "model_not_found"}) == 12
    assert metric(metrics_text, "fleetgate_responses_total",
                  {"model": "_unknown", "status": "404", "class": "4xx", "reason": "no_route"}) == 1
    assert not [line for line in metrics_text.splitlines() if "typo-" in line]   # names never become labels
