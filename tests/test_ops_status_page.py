"""The status page, loaded in headless Chromium (Debian's `chromium`) against a running `fleetgate demo`:
the fleet table names the workers and their health, the models table shows the SLO attainment the JSON
endpoint reports. Chromium missing is a failure, not a skip (.ci/run installs it)."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import MODEL, CliProcess, free_port_range, poll_sync

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


@pytest.mark.slow  # a demo process and a browser
def test_status_page_shows_the_fleet_and_slo_attainment(tmp_path) -> None:
    chromium()
    base = free_port_range(3)
    url = f"http://127.0.0.1:{base}"
    with CliProcess("demo", "--port", str(base), "--workers", "2", "--time-scale", "20", merge_stderr=True) as demo:
        demo.wait_for("fleetgate listening on", timeout=60)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20)
        for _ in range(6):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           stream=False)
        status = poll_sync(lambda: _judged(url), 10, "SLO-judged requests in the status JSON", every=0.1)
        dom = render(url + "/", tmp_path / "chromium-profile", tmp_path / "status.png")
    fleet = table_rows(dom, "fleet")
    assert sorted(r[0] for r in fleet) == ["sim-0", "sim-1"], fleet
    assert all(r[4] == "healthy" for r in fleet) and all(r[1] == "mixed" for r in fleet)
    models = table_rows(dom, "models")
    row = next(r for r in models if r[0] == MODEL)
    slo = status["models"][0]["slo"]["interactive"]
    assert row[4] == "interactive"
    assert row[5] == f"{100 * slo['attainment']:.1f}%"
    assert row[6] == f"{slo['met']} / {slo['missed']}" and slo["met"] + slo["missed"] >= 6
    assert "TTFT 1000 ms" in row[7]
    assert (tmp_path / "status.png").stat().st_size > 10_000  # the screenshot rendered something


def _judged(url: str) -> dict | None:
    s = httpx.get(url + "/ui/status.json", timeout=5).json()
    slo = s["models"][0]["slo"].get("interactive") if s["models"] else None
    return s if slo and slo["met"] + slo["missed"] >= 6 else None
