"""`fleetgate demo`: N simulated vLLM workers in a child process plus the gateway, one command.

The fleet runs as `python -m gateway.cli sim ...` in its own process (so it does not compete with the
gateway for the gateway's core); the gateway runs here with in-memory state. Ctrl-C or SIGTERM stops both and
removes the demo's temporary files (`/tmp/fleetgate-{pd,pooled,deployment}-*`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from gateway.config import ConfigError, load_config
from gateway.ops.logs import setup_logging
from gateway.server import bind_socket
from policies.base import DEFAULT_POLICY
from policies.pd import parse_pd_split

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 60.0


# The demo's SLO (milliseconds): loose enough that an unloaded llama3-8b-h100 worker meets it, so the
# attainment series (fleetgate_slo_attainment_ratio) have samples and fall when the fleet is overloaded.
DEMO_SLO_TTFT_MS = 1000.0
DEMO_SLO_TPOT_MS = 50.0
DEFAULT_POOLED_QUEUE_S = 30.0  # `demo --num-models`: a request may wait behind a few swaps
DEMO_MAX_CAP = 8  # `demo --autoscale`: requests in flight per simulated worker, at most and at start (see below)
DEMO_BURST_USERS = 32  # `demo --autoscale`: the banner's burst (fewer when --workers cannot take them warm)
DEMO_WARM_S = 300.0  # `demo --autoscale`: the --workers fleet is kept warm this long after the arrival rate (its
                     # window: 60 s) falls to 0
def demo_admin_key() -> str:
    """The demo's admin key: FLEETGATE_ADMIN_KEY if set, else a new one (printed in the banner)."""
    return os.environ.get("FLEETGATE_ADMIN_KEY") or "fg-admin-" + secrets.token_urlsafe(18)


def _stop_on_sigterm() -> None:
    """SIGTERM stops the demo as Ctrl-C does (KeyboardInterrupt), so its `finally` stops the fleet and removes the
    temporary files. Without it the default action ends the process at once: uvicorn, once it has stopped serving,
    raises the SIGTERM it caught again."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def run_demo(port: int = 8000, workers: int = 4, policy: str = DEFAULT_POLICY, profile: str = "llama3-8b-h100",
             model: str = "meta-llama/Llama-3.1-8B-Instruct", time_scale: float = 1.0, base_port: int = 8001,
             pd: str | None = None, autoscale: bool = False, log_format: str = "text",
             slo_ttft_ms: float = DEMO_SLO_TTFT_MS, slo_tpot_ms: float = DEMO_SLO_TPOT_MS) -> None:
    try:
        setup_logging("info", log_format)
    except ValueError as e:
        _fail(f"--log-format: {e}")
    _stop_on_sigterm()
    slo = {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms}
    roles = ["mixed"] * workers
    if pd is not None:  # P prefill + D decode workers replace --workers (gateway/pd.py)
        try:
            n_prefill, n_decode = parse_pd_split(pd)
        except ValueError as e:
            _fail(f"--pd: {e}")
        workers, roles = n_prefill + n_decode, ["prefill"] * n_prefill + ["decode"] * n_decode
    if autoscale:
        if pd is not None:
            _fail("--autoscale and --pd cannot be combined yet.")
        _run_autoscale_demo(port, workers, policy, profile, model, time_scale, base_port, slo)
        return
    if workers < 1:
        _fail(f"--workers must be at least 1, got {workers}.")
    urls = _worker_urls(port, base_port, workers)
    admin_key = demo_admin_key()
    try:
        cfg = load_config(None, listen={"host": "127.0.0.1", "port": port}, default_policy=policy, slo=slo,
                          auth={"admin_key": admin_key},
                          workers=[{"id": f"sim-{i}" if pd is None else f"{roles[i]}-{i}", "url": u,
                                    "profile": profile, "role": roles[i]} for i, u in enumerate(urls)])
    except ConfigError as e:
        _fail("; ".join(e.problems))
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--workers", str(workers), "--base-port", str(base_port),
           "--profile", profile, "--model", model, "--time-scale", str(time_scale)]
    fleet_file = _pd_fleet_file(roles) if pd is not None else None
    if fleet_file is not None:
        cmd += ["--fleet", str(fleet_file)]
    _serve_with_fleet(cfg, cmd, urls, port, model, admin_key, [fleet_file] if fleet_file is not None else [])


def _serve_with_fleet(cfg: Any, cmd: list[str], urls: list[str], port: int, model: str, admin_key: str,
                      cleanup: list[Path], banner: str | None = None) -> None:
    """Start the simulated fleet (`cmd`), wait for every worker, run the gateway until Ctrl-C, stop the fleet."""
    sim = None
    # SIGTERM is held while the fleet is forked: raised in the fork hooks, its KeyboardInterrupt would be lost
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        print(f"starting {len(urls)} simulated vLLM worker(s): {shlex.join(cmd[1:])}", flush=True)
        sim = subprocess.Popen(cmd, cwd=ROOT, preexec_fn=_fleet_child)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)      # one that came meanwhile stops the demo here
        _wait_healthy(sim, urls)
        if banner is not None:
            print(banner, flush=True)
        else:
            _print_banner(port, model, urls, admin_key)
        from gateway.server import run

        run(cfg)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)         # stopping already: another SIGTERM must not cut it
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if sim is not None:
            _stop(sim)
        for path in cleanup:
            if path.is_dir():
                for f in path.iterdir():
                    f.unlink(missing_ok=True)
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
        print("demo stopped", flush=True)


def run_deployment_demo(deployment: Path, port: int = 8000, base_port: int = 8001, time_scale: float = 1.0,
                        policy: str | None = None, log_format: str = "text") -> None:
    """`fleetgate demo --deployment FILE`: every instance of a plan as a simulated worker with the profile the
    plan derived for it (model, GPU, TP), behind the gateway with the plan's policy and SLO."""
    from policies.hardware import derive_profile, model_spec
    from simulator.deployment import deployment_defaults, load_deployment

    try:
        setup_logging("info", log_format)
        groups, _ = load_deployment(deployment)
    except ValueError as e:
        _fail(str(e))
    _stop_on_sigterm()
    plan = deployment_defaults(deployment)
    instances = [g for g in groups for _ in range(g.count)]
    if not instances:
        _fail(f"{deployment}: the deployment has no instances (every count is 0)")
    if not (base_port > 0 and base_port + len(instances) - 1 < 65536):
        _fail(f"--base-port {base_port} leaves no room for {len(instances)} worker port(s).")
    _require_free([(port, "gateway (--port)")] + [(base_port + i, "simulated worker (--base-port)")
                                                  for i in range(len(instances))])
    workdir = Path(tempfile.mkdtemp(prefix="fleetgate-deployment-"))
    atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    kv_role = {"mixed": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}
    servers, workers = [], []
    for i, g in enumerate(instances):
        prof = derive_profile(g.model, g.gpu, g.tp)
        path = workdir / f"{prof['name']}.yaml"
        if not path.exists():
            path.write_text(yaml.safe_dump(prof))
        hf = model_spec(g.model).hf_id
        servers.append({"name": f"{prof['name']}-{i}", "profile": str(path), "model": hf, "role": kv_role[g.role]})
        workers.append({"id": f"{prof['name']}-{i}", "url": f"http://127.0.0.1:{base_port + i}", "profile": str(path),
                        "role": g.role, "models": [hf]})
    fleet_file = workdir / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump({"servers": servers}))
    slo = {"ttft_ms": plan.get("slo_ttft_s", DEMO_SLO_TTFT_MS / 1000) * 1000,
           "tpot_ms": plan.get("slo_tpot_s", DEMO_SLO_TPOT_MS / 1000) * 1000}
    admin_key = demo_admin_key()
    try:
        cfg = load_config(None, listen={"host": "127.0.0.1", "port": port}, slo=slo, auth={"admin_key": admin_key},
                          default_policy=policy or plan.get("policy", DEFAULT_POLICY), workers=workers)
    except ConfigError as e:
        _fail("; ".join(e.problems))
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--fleet", str(fleet_file), "--base-port", str(base_port),
           "--time-scale", str(time_scale)]
    urls = [w["url"] for w in workers]
    _serve_with_fleet(cfg, cmd, urls, port, model_spec(instances[0].model).hf_id, admin_key, [workdir])


def run_pooled_demo(port: int = 8000, workers: int = 2, num_models: int = 4, policy: str = DEFAULT_POLICY,
                    profile: str = "llama3-8b-h100", model: str = "meta-llama/Llama-3.1-8B-Instruct",
                    time_scale: float = 1.0, base_port: int = 8001, log_format: str = "text",
                    slo: dict[str, float] | None = None, scheduling: str = "request") -> None:
    """`fleetgate demo --num-models M --workers N`: M models sharing N hosts (config `shared_hosts:`, one awake
    model per host). Each host runs one simulated engine per model (sleep mode on: the simulator's /sleep and
    /wake_up, its wake-up taking the profile's `wake_up_s` in model time, so / --time-scale here); with
    `scheduling` request the gateway's swap controller wakes a model's engine when its requests arrive
    (gateway/control/pooling.py), with turns the models with requests take Aegaeon's decode turns (gateway/control/turns.py)."""
    from simulator.profiles import load_profile

    try:
        setup_logging("info", log_format)
    except ValueError as e:
        _fail(f"--log-format: {e}")
    _stop_on_sigterm()
    if workers < 1 or num_models < 1:
        _fail(f"--workers and --num-models must be at least 1, got {workers} and {num_models}.")
    if scheduling not in ("request", "turns"):
        _fail(f"--scheduling must be request or turns, got {scheduling!r}.")
    n = workers * num_models
    if not (base_port > 0 and base_port + n - 1 < 65536):
        _fail(f"--base-port {base_port} leaves no room for {n} engine port(s).")
    if port and base_port <= port < base_port + n:
        _fail(f"the gateway port {port} collides with the simulator ports {base_port}-{base_port + n - 1}.")
    _require_free([(port, "gateway (--port)")] + [(base_port + i, "simulated engine (--base-port)") for i in range(n)])
    try:
        prof = load_profile(profile)
    except (OSError, ValueError) as e:
        _fail(f"--profile: {e}")
    models = [f"{model}-{j}" for j in range(num_models)]
    servers, hosts, urls = [], [], []
    for h in range(workers):
        engines = {}
        for j, m in enumerate(models):
            url = f"http://127.0.0.1:{base_port + h * num_models + j}"
            servers.append({"name": f"host{h}-m{j}", "model": m})
            engines[m] = {"url": url, "profile": profile, "weight_gb": prof.weight_bytes / 1e9,
                          "load_s": prof.wake_up_s / time_scale}
            urls.append(url)
        hosts.append({"id": f"host{h}", "max_awake": 1, "engines": engines, "scheduling": scheduling,
                      "link_gb_per_s": prof.host_link_bytes_per_s / 1e9})
    admin_key = demo_admin_key()
    try:
        cfg = load_config(None, listen={"host": "127.0.0.1", "port": port}, default_policy=policy,
                          slo=slo or {"ttft_ms": DEMO_SLO_TTFT_MS, "tpot_ms": DEMO_SLO_TPOT_MS},
                          auth={"admin_key": admin_key}, shared_hosts=hosts, scrape_interval_s=0.2,
                          limits={"queue_timeout_s": max(DEFAULT_POOLED_QUEUE_S, 4 * prof.wake_up_s / time_scale)})
    except ConfigError as e:
        _fail("; ".join(e.problems))
    fleet_file = _temp_yaml("fleetgate-pooled-", {"defaults": {"profile": profile}, "servers": servers})
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--fleet", str(fleet_file), "--base-port", str(base_port),
           "--time-scale", str(time_scale)]
    base = f"http://127.0.0.1:{port}" if port else "http://127.0.0.1:<port printed below>"
    how = ((f"(a swap: the idle engine sleeps, the wanted one wakes in {prof.wake_up_s / time_scale:g} s); ",
            "Send requests to any model; the first one to a sleeping model waits for its swap:")
           if scheduling == "request" else
           (f"(turns: the models with requests take time-quota turns, a switch {prof.wake_up_s / time_scale:g} s); ",
            "Send requests to any model; they run in their model's turns:"))
    banner = "\n".join(
        [f"\nfleetgate demo: {num_models} model(s) sharing {workers} host(s), one model awake per host at a time",
         how[0] + f"gateway {base}, admin key {admin_key}", how[1], ""]
        + [f"  curl -s {base}/v1/completions -H 'Content-Type: application/json' "
           f"-d '{{\"model\": \"{m}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'" for m in models]
        + ["", f"  curl -s {base}/metrics | grep -E '^fleetgate_(model_swaps_total|turns_total|engine_state)'", ""])
    _serve_with_fleet(cfg, cmd, urls, port, models[0], admin_key, [fleet_file], banner)


def autoscale_demo_settings(workers: int, profile: str, model: str, time_scale: float, base_port: int,
                            slo: dict[str, float]) -> dict[str, Any]:
    """The `autoscale:` section of `fleetgate demo --autoscale` (bench/autoscale_live.py replays its burst on it).

    Per-worker caps (Chiron Algorithm 1) are bounded to what the demo's burst can fill. Unbounded, the cap grows
    while the engine meets its ITL SLO, and a llama3-8b-h100 keeps a 256-token answer's ITL near 10 ms even at
    64 in flight: the cap went 16 -> 32 -> 64, interactive backpressure (in flight / cap) fell to ~0.2, below
    theta - delta = 0.4, and the scaler scaled in ("ibp_low") in the middle of the burst it should answer.
    With at most DEMO_MAX_CAP requests per worker, 32 users are 32 / 8 / theta = 8 workers' worth of load.

    The burst the banner suggests must not fail (0 errors, without counting on client retries): a new worker
    takes a 30 s cold start, far longer than the 1 s TTFT target a queued request may wait, so the burst has to
    land on warm workers while the scale-out it causes is under way. So the caps start at DEMO_MAX_CAP (starting
    at 4, half of the first requests queued past their TTFT target while the caps grew: 12 of 627 requests of a
    25 s burst got 429s), and the --workers fleet is kept warm while traffic is recent (`warm_min_interactive`, `warm_s`:
    DEMO_WARM_S without arrivals; before, an idle demo shrank to 1 worker within 13 s of its start, and the burst
    then met one worker and a cold start: 8 users of 32 out of retries, the banner's script dead after 17 s).
    """
    k = time_scale
    cold = 30.0 / k
    max_workers = max(8, workers)
    return {
        "enabled": True, "interval_s": 1.0, "local_interval_s": 1.0, "drain_timeout_s": 30.0,
        "rate_window_s": 60.0 / k, "throughput_window_s": 60.0 / k,
        "itl_slo_ms": slo["tpot_ms"], "local": {"initial_cap": DEMO_MAX_CAP, "max_cap": DEMO_MAX_CAP},
        # Like the engines, the scaler's clocks run --time-scale times faster (model seconds / K).
        "scaler": {"min_interactive": 1, "max_interactive": max_workers, "max_batch": 4, "max_step_in": 2,
                   "cooldown_out_s": 2.0 / k, "cooldown_in_s": 10.0 / k, "stabilization_s": 30.0 / k,
                   "cold_start_s": cold, "batch_settle_s": 10.0 / k, "batch_cooldown_s": 15.0 / k,
                   "deadline_margin_s": 10.0 / k, "burst_hold_s": 600.0 / k,
                   "warm_min_interactive": workers, "warm_s": DEMO_WARM_S / k},
        "actuator": {"kind": "sim", "sim": {"profile": profile, "model": model, "time_scale": time_scale,
                                            "cold_start_s": cold, "initial": {"mixed": workers},
                                            "base_port": base_port}}}


def _run_autoscale_demo(port: int, workers: int, policy: str, profile: str, model: str, time_scale: float,
                        base_port: int, slo: dict[str, float]) -> None:
    """The gateway with the autoscaler and the `sim` actuator: it starts and stops simulated workers itself
    (gateway/control/actuators.py), each with a 30 s cold start in model time (Chiron section 6: 30-60 s)."""
    if workers < 1:
        _fail(f"--workers must be at least 1, got {workers}.")
    cold = 30.0 / time_scale
    max_workers = max(8, workers)
    _require_free([(port, "gateway (--port)")] + [(base_port + i, "simulated worker (--base-port)")
                                                  for i in range(max_workers)])
    admin_key = demo_admin_key()
    try:
        cfg = load_config(None, listen={"host": "127.0.0.1", "port": port}, default_policy=policy, slo=slo,
                          auth={"admin_key": admin_key},
                          autoscale=autoscale_demo_settings(workers, profile, model, time_scale, base_port, slo))
    except ConfigError as e:
        _fail("; ".join(e.problems))
    base = f"http://127.0.0.1:{port}" if port else "http://127.0.0.1:<port printed below>"
    users = min(DEMO_BURST_USERS, workers * DEMO_MAX_CAP)   # what the warm fleet takes while more workers start
    print(f"""
fleetgate demo --autoscale: {workers} simulated worker(s) to start with, kept warm while traffic is recent (down to
1 about {(DEMO_WARM_S + 60) / time_scale:g} s after the last request); the autoscaler adds and removes workers (cold start {cold:g} s) as
load comes and goes. Watch it:

  {base}/        (the status page: workers, pools, caps, scale actions)
  watch -n1 "curl -s {base}/metrics | grep -E '^fleetgate_(desired|current)_workers|^fleetgate_backpressure'"

The fleet is logged below every time it changes (`fleet: ...`), with each scale action and its reason.
The workers through the admin API (admin key of this run only: {admin_key}):

  curl -s {base}/admin/workers -H 'Authorization: Bearer {admin_key}'

Make a one-minute burst of {users} concurrent users, then watch the fleet drain and shrink after it:

  python - <<'EOF'
  import asyncio, time
  from openai import AsyncOpenAI
  client = AsyncOpenAI(base_url="{base}/v1", api_key="unused", max_retries=5)
  async def user(end):
      while time.time() < end:
          await client.chat.completions.create(model="{model}", max_tokens=256,
                                               messages=[{{"role": "user", "content": "Hello!"}}])
  async def main():
      end = time.time() + 60
      await asyncio.gather(*(user(end) for _ in range({users})))
  asyncio.run(main())
  EOF

Ctrl-C stops the gateway and its workers.
""", flush=True)
    from gateway.server import run

    try:
        run(cfg)
    except KeyboardInterrupt:
        pass
    finally:
        print("demo stopped", flush=True)


def _fleet_child() -> None:
    """In the fleet's child process: SIGTERM unblocked (the demo held it while forking), and on Linux SIGTERM when
    the demo dies, however it dies (SIGKILL included), so no simulated worker outlives the demo holding its port
    (prctl PR_SET_PDEATHSIG)."""
    import ctypes

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG



def _worker_urls(port: int, base_port: int, workers: int) -> list[str]:
    """The simulated workers' URLs on base_port.., after checking the ports fit, miss the gateway's and are free."""
    if not (base_port > 0 and base_port + workers - 1 < 65536):
        _fail(f"--base-port {base_port} leaves no room for {workers} worker port(s).")
    if port and base_port <= port < base_port + workers:
        _fail(f"the gateway port {port} collides with the simulator ports {base_port}-{base_port + workers - 1}.")
    _require_free([(port, "gateway (--port)")] + [(base_port + i, "simulated worker (--base-port)")
                                                  for i in range(workers)])
    return [f"http://127.0.0.1:{base_port + i}" for i in range(workers)]

def _require_free(ports: list[tuple[int, str]]) -> None:
    """One line and exit 2 when a port the demo needs is taken, before anything is started."""
    for p, what in ports:
        if p == 0:
            continue
        try:
            bind_socket("127.0.0.1", p).close()
        except OSError as e:
            _fail(f"port {p} for the {what} is not free ({e.strerror or e}); choose another.")


def _pd_fleet_file(roles: list[str]) -> Path:
    """A fleet YAML (simulator/fleet.py) with the NIXL roles of the workers, in port order."""
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}
    servers = [{"name": f"{r}-{i}", "role": kv_role[r]} for i, r in enumerate(roles)]
    return _temp_yaml("fleetgate-pd-", {"servers": servers})


def _temp_yaml(prefix: str, doc: dict[str, Any]) -> Path:
    """A temporary YAML file, removed when the demo's interpreter exits however it exits short of a kill (the
    demo's `finally` removes it first; this covers a stop before that `try`)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=prefix, delete=False) as f:
        atexit.register(Path(f.name).unlink, missing_ok=True)
        yaml.safe_dump(doc, f)
    return Path(f.name)


def _wait_healthy(sim: subprocess.Popen, urls: list[str]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = list(urls)
    while pending:
        if sim.poll() is not None:
            _fail(f"the simulated fleet exited with status {sim.returncode} before it was ready (see above).")
        if time.monotonic() > deadline:
            _fail(f"simulated workers not healthy after {READY_TIMEOUT_S:.0f}s: {', '.join(pending)}")
        pending = [u for u in pending if not _healthy(u)]
        if pending:
            time.sleep(0.1)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _print_banner(port: int, model: str, urls: list[str], admin_key: str) -> None:
    base = f"http://127.0.0.1:{port}" if port else "http://127.0.0.1:<port printed below>"
    print(f"""
fleetgate demo: {len(urls)} simulated worker(s) at {urls[0]} .. {urls[-1]}
gateway: {base}   (metrics: {base}/metrics, workers: {base}/admin/workers)
admin key (this run only): {admin_key}
  curl -s {base}/admin/workers -H 'Authorization: Bearer {admin_key}'

  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  curl -s {base}/v1/responses -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "input": "Hello!", "max_output_tokens": 32}}'

  python - <<'EOF'
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="unused")
  for chunk in client.chat.completions.create(model="{model}", stream=True, max_tokens=32,
                                              messages=[{{"role": "user", "content": "Hello!"}}]):
      print(chunk.choices[0].delta.content or "", end="", flush=True)
  print()
  EOF

  # Anthropic's Messages API (an agent that speaks it: ANTHROPIC_BASE_URL={base} ANTHROPIC_API_KEY=unused)
  curl -s {base}/v1/messages -H 'Content-Type: application/json' -H 'x-api-key: unused' \
    -d '{{"model": "{model}", "max_tokens": 32, "messages": [{{"role": "user", "content": "Hello!"}}]}}'

Ctrl-C stops the gateway and the workers.
""", flush=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


def _fail(message: str) -> None:
    print(f"fleetgate demo: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def run_lora_demo(port: int = 8000, workers: int = 2, adapters: int = 4, policy: str = DEFAULT_POLICY,
                  profile: str = "llama3-8b-h100", model: str = "meta-llama/Llama-3.1-8B-Instruct",
                  time_scale: float = 1.0, base_port: int = 8001, log_format: str = "text",
                  slo: dict[str, float] | None = None, max_loras: int = 2) -> None:
    """`fleetgate demo --lora-adapters N`: N LoRA adapters of the model (config `models.<model>.adapters`) over
    simulated workers with `--max-loras` GPU slots and runtime updating on, no adapter loaded at start: the
    gateway loads each where it routes its first request (gateway/fleet/adapters.py)."""
    try:
        setup_logging("info", log_format)
    except ValueError as e:
        _fail(f"--log-format: {e}")
    if workers < 1 or adapters < 1:
        _fail(f"--workers and --lora-adapters must be at least 1, got {workers} and {adapters}.")
    urls = _worker_urls(port, base_port, workers)
    names = [f"{model.rsplit('/', 1)[-1].lower()}-lora-{i}" for i in range(adapters)]
    admin_key = demo_admin_key()
    try:
        cfg = load_config(None, listen={"host": "127.0.0.1", "port": port}, default_policy=policy,
                          slo=slo or {"ttft_ms": DEMO_SLO_TTFT_MS, "tpot_ms": DEMO_SLO_TPOT_MS},
                          auth={"admin_key": admin_key}, scrape_interval_s=0.2,
                          models={model: {"adapters": [{"name": n, "path": f"/adapters/{n}"} for n in names]}},
                          workers=[{"id": f"sim-{i}", "url": u, "profile": profile, "models": [model]}
                                   for i, u in enumerate(urls)])
    except ConfigError as e:
        _fail("; ".join(e.problems))
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--workers", str(workers), "--base-port", str(base_port),
           "--profile", profile, "--model", model, "--time-scale", str(time_scale), "--enable-lora",
           "--max-loras", str(max_loras), "--allow-runtime-lora-updating"]
    base = f"http://127.0.0.1:{port}" if port else "http://127.0.0.1:<port printed below>"
    banner = "\n".join(
        [f"\nfleetgate demo: {adapters} LoRA adapter(s) of {model} over {workers} simulated worker(s) "
         f"(--max-loras {max_loras}, none loaded yet: the gateway loads each where its first request goes)",
         f"gateway {base}, admin key {admin_key}", ""]
        + [f"  curl -s {base}/v1/completions -H 'Content-Type: application/json' "
           f"-d '{{\"model\": \"{n}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'" for n in names]
        + ["", f"  curl -s {base}/v1/models", f"  curl -s {base}/metrics | grep -E '^fleetgate_lora_'", ""])
    _serve_with_fleet(cfg, cmd, urls, port, model, admin_key, [], banner)
