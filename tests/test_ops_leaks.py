"""What a key may see, and misconfigurations that used to pass silently, over real HTTP on
loopback and real `fleetgate` processes:

- `/ui/status.json` shows an inference key only its own batches and no worker URL; the admin key sees all;
- a request refused because its key may not use the model carries no `x-served-model` and its body names the
  model as the client sent it, never an alias's target;
- the same engine listed twice is a config error (`fleetgate config check`, `fleetgate serve -w U -w U`);
- `fleetgate serve` raises its soft open-file limit to the hard one, logs it, and warns when it cannot hold
  `server.max_connections` streams."""

from __future__ import annotations

import resource
from pathlib import Path

import httpx
import yaml
from openai import AsyncOpenAI

from tests.helpers import ADMIN, ADMIN_KEY, CliProcess, run_cli, running_gateway

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _a_batch(url: str, key: str) -> str:
    client = AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    try:
        line = ('{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m-a", '
                '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}\n')
        upload = await client.files.create(file=("in.jsonl", line.encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        return batch.id
    finally:
        await client.close()


async def test_status_json_shows_a_tenant_its_own_batches_and_worker_urls_only_to_the_admin(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": "m-a"}]}, time_scale=50)
    keys = [{"key": KEY_A}, {"key": KEY_B}]
    async with running_gateway(fleet.urls, auth={"admin_key": ADMIN_KEY, "keys": keys}) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
        batch_a, batch_b = await _a_batch(gw.url, KEY_A), await _a_batch(gw.url, KEY_B)

        async def doc(headers: dict[str, str]) -> dict:
            r = await http.get("/ui/status.json", headers=headers)
            assert r.status_code == 200, r.text
            return r.json()

        admin = await doc(ADMIN)
        assert {b["id"] for b in admin["batches"]} == {batch_a, batch_b}
        assert [w["url"] for w in admin["fleet"]] == fleet.urls
        for key, own in ((KEY_A, batch_a), (KEY_B, batch_b)):
            seen = await doc(bearer(key))
            assert [b["id"] for b in seen["batches"]] == [own], seen["batches"]
            assert seen["fleet"] and all("url" not in w for w in seen["fleet"]), seen["fleet"]
            assert fleet.urls[0] not in (await http.get("/ui/status.json", headers=bearer(key))).text
        assert (await http.get("/ui/status.json")).status_code == 401                        # keys set: no key, no page
        assert (await http.get("/ui/status.json", headers=bearer("sk-wrong"))).status_code == 401
        # the admin API will not add the same engine under a second id either
        r = await http.post("/admin/workers", headers=ADMIN, json={"id": "again", "url": fleet.urls[0] + "/"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "engine_exists", r.text


async def test_a_refused_model_names_nothing_the_key_may_not_see(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": "m-a"}, {"model": "m-b"}]}, time_scale=50)
    keys = [{"key": KEY_B, "models": ["m-b"]}]
    workers = [{"id": f"w{i}", "url": u, "models": [m]}
               for i, (u, m) in enumerate(zip(fleet.urls, ("m-a", "m-b"), strict=True))]
    async with running_gateway(workers=workers, auth={"admin_key": ADMIN_KEY, "keys": keys},
                               aliases={"fast": "m-a"}) as gw, httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
        for asked in ("fast", "m-a"):
            r = await http.post("/v1/chat/completions", headers=bearer(KEY_B),
                                json={"model": asked, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
            assert "x-served-model" not in r.headers, dict(r.headers)
            assert "m-a" not in r.text if asked == "fast" else f"`{asked}`" in r.text, r.text
        ok = await http.post("/v1/chat/completions", headers=bearer(KEY_B),
                             json={"model": "m-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert ok.status_code == 200 and ok.headers["x-served-model"] == "m-b"


def test_the_same_engine_twice_is_a_config_error(tmp_path: Path) -> None:
    url = "http://127.0.0.1:9"
    twice = tmp_path / "twice.yaml"
    twice.write_text(yaml.safe_dump({"workers": [{"id": "a", "url": url}, {"id": "b", "url": url + "/"}]}))
    r = run_cli("config", "check", str(twice))
    assert r.returncode == 1 and "workers[1]: worker 'b' names the same engine as workers[0] ('a')" in r.stdout + r.stderr
    # a shared host's engine that is also a plain worker
    shared = tmp_path / "shared.yaml"
    shared.write_text(yaml.safe_dump({"workers": [{"id": "a", "url": "http://localhost:9/"}],
                                      "shared_hosts": [{"id": "h", "engines": {"m": {"url": "http://LOCALHOST:9"}}}]}))
    r = run_cli("config", "check", str(shared))
    assert r.returncode == 1 and "shared_hosts[0].engines.m" in r.stdout + r.stderr, r.stdout + r.stderr
    # two engines on one host are two workers
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump({"workers": [{"id": "a", "url": url}, {"id": "b", "url": "http://127.0.0.1:10"}]}))
    assert run_cli("config", "check", str(two)).returncode == 0
    # serve -w given twice refuses to start, saying why
    r = run_cli("serve", "--port", "0", "-w", url, "-w", url + "/", timeout=60)
    assert r.returncode == 1 and "names the same engine" in r.stderr, (r.returncode, r.stderr)


def _limit(soft: int, hard: int):  # noqa: ANN202 - a preexec function
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _nofile(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    return int(line.split()[3])


def test_serve_raises_its_open_file_limit_logs_it_and_warns_when_max_connections_cannot_be_served() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = 2048 if hard == resource.RLIM_INFINITY else min(hard, 2048)
    assert cap > 1024, "the test needs a hard open-file limit above 1024"
    # 4096 connections need 2 x 4096 + 256 descriptors: more than the hard limit allows
    with CliProcess("serve", "--port", "0", merge_stderr=True, preexec_fn=_limit(1024, cap)) as p:
        line = p.wait_for("open-file limit", 60, anywhere=True)
        assert "WARNING" in line and f"open-file limit {cap} (raised from 1024)" in line, line
        assert "server.max_connections=4096" in line and f"about {(cap - 256) // 2} streams" in line, line
        p.wait_for("fleetgate listening on", 60)
        assert _nofile(p.proc.pid) == cap
    # few enough connections: the limit in use, at INFO
    env = {"FLEETGATE_SERVER__MAX_CONNECTIONS": str((cap - 256) // 2)}
    with CliProcess("serve", "--port", "0", merge_stderr=True, env=env, preexec_fn=_limit(1024, cap)) as p:
        line = p.wait_for("open-file limit", 60, anywhere=True)
        assert "INFO" in line and f"open-file limit {cap} (raised from 1024)" in line and "enough" in line, line
