"""The 30-minute soak (outside CI): two gateway replicas sharing a Redis of their own, four simulated workers
(`fleetgate sim --workers 1` each), two tenants, mixed traffic, batches, for `--minutes`.

    python -m bench.soak --minutes 30        # writes bench/results/soak_tenants.json

Traffic: 6 closed-loop streaming clients of an unlimited key over both replicas (every failure counted: a
status other than 200, a transport error, a stream without [DONE] or with an error event); one client of a
key limited to 300 requests/min and 4 in flight, sending 8 requests/s open loop (429s expected and counted
apart from failures); a 50-line batch every minute (lost and duplicated lines counted). Every 30 s: RSS and
CPU of both gateways. bench/chaos_state.py puts the figures into bench/results/chaos.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from bench.chaos_procs import MODEL, Load, RedisServer, ServeProcess, proc_stats
from bench.report import git_commit, machine_info
from simulator.fleet import FleetProcess

OUT = Path(__file__).resolve().parent / "results" / "soak_tenants.json"
ADMIN_KEY = "soak-admin-key-0123456789"


async def soak(minutes: float) -> dict:
    commit = git_commit()
    tmp = Path(tempfile.mkdtemp(prefix="fleetgate-soak-"))
    redis_server = RedisServer(tmp)
    redis_server.start()
    sims = [FleetProcess(1, time_scale=2.0) for _ in range(4)]
    gws: list[ServeProcess] = []
    try:
        urls = [s.start()[0] for s in sims]
        cfg = tmp / "gw.yaml"
        cfg.write_text(json.dumps({
            "workers": [{"id": f"w{i}", "url": u, "cap": 32} for i, u in enumerate(urls)],
            "auth": {"admin_key": ADMIN_KEY, "keys": [{"key": "sk-soak-free", "name": "free"},
                                                      {"key": "sk-soak-limited", "name": "limited", "rpm": 300,
                                                       "max_concurrency": 4}]},
            "batch": {"poll_s": 0.1}}))
        gws = [ServeProcess(cfg, "--redis-url", redis_server.url) for _ in range(2)]
        gw_urls = [g.url for g in gws]
        load = Load(gw_urls, clients=6, max_tokens=60, headers={"authorization": "Bearer sk-soak-free"})
        limited = {"200": 0, "429": 0, "other": 0}
        batches = {"created": 0, "completed": 0, "lines": 0, "lost": 0, "duplicated": 0}
        samples: list[dict] = []
        t0 = time.monotonic()
        end = t0 + minutes * 60

        async def limited_client() -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "soak"}], "max_tokens": 8}
            async with httpx.AsyncClient(timeout=60, headers={"authorization": "Bearer sk-soak-limited"}) as http:
                pending: set[asyncio.Task] = set()
                i = 0

                async def one(url: str) -> None:
                    try:
                        r = await http.post(url + "/v1/chat/completions", json=body)
                        key = str(r.status_code) if r.status_code in (200, 429) else "other"
                    except httpx.HTTPError:
                        key = "other"
                    limited[key] += 1
                while time.monotonic() < end:
                    t = asyncio.create_task(one(gw_urls[i % 2]))
                    pending.add(t)
                    t.add_done_callback(pending.discard)
                    i += 1
                    await asyncio.sleep(1 / 8)
                await asyncio.gather(*pending)

        async def batch_client() -> None:
            async with httpx.AsyncClient(timeout=60, headers={"authorization": "Bearer sk-soak-free"}) as http:
                n = 0
                while time.monotonic() < end - 90:
                    url = gw_urls[n % 2]
                    lines = [json.dumps({"custom_id": f"b{n}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                         "body": {"model": MODEL, "max_tokens": 16,
                                                  "messages": [{"role": "user", "content": f"batch {n} {i}"}]}})
                             for i in range(50)]
                    f = (await http.post(url + "/v1/files", data={"purpose": "batch"},
                                         files={"file": ("b.jsonl", "\n".join(lines).encode())})).json()
                    b = (await http.post(url + "/v1/batches", json={"input_file_id": f["id"], "completion_window": "1h",
                                                                   "endpoint": "/v1/chat/completions"})).json()
                    batches["created"] += 1
                    while True:
                        await asyncio.sleep(2)
                        b = (await http.get(url + f"/v1/batches/{b['id']}")).json()
                        if b["status"] in ("completed", "failed", "expired", "cancelled"):
                            break
                    if b["status"] == "completed" and b.get("output_file_id"):
                        text = (await http.get(url + f"/v1/files/{b['output_file_id']}/content")).text
                        ids = [json.loads(x)["custom_id"] for x in text.splitlines() if x.strip()]
                        batches["completed"] += 1
                        batches["lines"] += len(ids)
                        batches["duplicated"] += len(ids) - len(set(ids))
                        batches["lost"] += 50 - len(set(ids))
                    else:
                        batches["lost"] += 50
                    await http.delete(url + f"/v1/files/{f['id']}")
                    n += 1
                    await asyncio.sleep(max(0.0, 60 - (time.monotonic() - t0) % 60))

        async def sampler() -> None:
            cpu0 = [proc_stats(g.proc.pid)[1] for g in gws]
            while time.monotonic() < end:
                stats = [proc_stats(g.proc.pid) for g in gws]
                samples.append({"t_min": round((time.monotonic() - t0) / 60, 1),
                                "rss_mb": [round(s[0], 1) for s in stats],
                                "cpu_s": [round(s[1] - c, 1) for s, c in zip(stats, cpu0, strict=True)],
                                "ok": load.ok, "failed": load.failed})
                await asyncio.sleep(30)

        stream_task = load.start()
        others = [asyncio.create_task(c()) for c in (limited_client, batch_client, sampler)]
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        load.stop()
        await stream_task
        await asyncio.gather(*others)
        elapsed = time.monotonic() - t0
        lat = sorted(load.latencies)
        final = [proc_stats(g.proc.pid) for g in gws]
        return {
            "command": f"python -m bench.soak --minutes {minutes:g}", "commit": commit, "machine": machine_info(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "minutes": round(elapsed / 60, 1),
            "streams_ok": load.ok, "streams_failed": load.failed, "failures": load.failures,
            "stream_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
            "stream_p99_s": round(lat[int(len(lat) * 0.99)], 3) if lat else None,
            "limited_key": limited, "limited_rps": round(limited["200"] / elapsed, 2), "batches": batches,
            "rss_mb_first": samples[0]["rss_mb"] if samples else None, "rss_mb_last": [round(s[0], 1) for s in final],
            "cpu_s_total": [round(s[1], 1) for s in final], "samples": samples,
            "gateway_warnings": sum(1 for g in gws for x in g.lines if " WARNING " in x or " ERROR " in x),
            "gateway_tracebacks": sum(1 for g in gws for x in g.lines if "Traceback" in x),
        }
    finally:
        for g in gws:
            g.stop()
        for s in sims:
            s.stop()
        redis_server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    result = asyncio.run(soak(args.minutes))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
