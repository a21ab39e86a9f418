"""bench/peers_thirdparty.py: the guidellm command line it builds, and how it reads guidellm's JSON report
(the shape guidellm 0.8.1 writes: benchmarks[0].metrics.<name>.successful.{median, percentiles})."""

from __future__ import annotations

from pathlib import Path

from bench.peers_thirdparty import Scenario, guidellm_command, metric, row


def _stat(median: float, p99: float) -> dict:
    return {"successful": {"median": median, "mean": median, "percentiles": {"p50": median, "p99": p99}}}


REPORT = {"benchmarks": [{"duration": 40.0, "metrics": {
    "request_totals": {"successful": 238, "errored": 2, "incomplete": 0, "total": 240},
    "time_to_first_token_ms": _stat(120.0, 900.0),
    "inter_token_latency_ms": _stat(9.5, 31.0)}}]}


def test_the_command_names_the_scenario_and_the_local_tokenizer():
    sc = Scenario(rate=6, requests=240, prompt=512, prefix_tokens=4096, prefix_count=8, output=128)
    cmd = guidellm_command(Path("/venv"), "http://127.0.0.1:9", Path("/tok"), sc, Path("/o.json"))
    assert cmd[:2] == ["/venv/bin/guidellm", "run"]
    opts = dict(zip(cmd[2::2], cmd[3::2], strict=False))
    assert opts["--profile"] == "kind=poisson,rate=6"
    assert opts["--constraint"] == "kind=max_requests,count=240"
    assert "prefix_count=8,prefix_tokens=4096" in opts["--data"] and "output_tokens=128" in opts["--data"]
    assert opts["--tokenizer"] == "kind=huggingface_auto,model=/tok"
    assert "target=http://127.0.0.1:9" in opts["--backend"] and opts["--output"] == "kind=json,path=/o.json"


def test_the_report_row_reads_guidellms_json_in_model_time():
    assert metric(REPORT, "time_to_first_token_ms", "p99") == 900.0
    assert metric(REPORT, "inter_token_latency_ms", "median") == 9.5
    assert metric(REPORT, "missing", "p99") != metric(REPORT, "missing", "p99")   # NaN
    # time scale 2: latencies x2, requests/s = 238 / 40 s x 2
    assert row("fleetgate x", REPORT, 2.0, 0.5) == "| fleetgate x | 238 | 2 | 11.90 | 240 | 1800 | 19.0 | 62.0 | 50.0% |"
