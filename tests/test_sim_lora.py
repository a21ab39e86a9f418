"""LoRA adapters in the simulator: vLLM's flags, /v1/models, the runtime load/unload API, adapter-named requests,
the max_loras batch limit, the host-memory LRU, load pricing and vllm:lora_requests_info.

Engine behaviour is checked in virtual time (EngineCore stepped by hand); the server over real HTTP with the
`openai` client. Expected prices are derived here from the published figures policies/adapters.py cites.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from policies.adapters import LORA_STEP_S, lora_costs
from simulator.engine import EngineConfig, EngineCore, SimRequest
from simulator.fleet import FleetProcess, fleet_from_dict, running_fleet
from simulator.vllm_api import ConfigError, ServerConfig, SimServer
from tests.helpers import MODEL
from tests.helpers import poll_sync as poll

PROFILE = "llama3-8b-h100"
# Llama-3.1-8B (config.json): hidden 4096, KV dim 8 x 128 = 1024, intermediate 14336, 32 layers. A rank-16 adapter
# on q, k, v, o, gate, up, down holds 16 x 32 x (2 x (4096 + 4096) + 2 x (4096 + 1024) + 3 x (4096 + 14336)) BF16
# parameters; PCIe Gen4 x16 moves ~25 GB/s (the profile's host link).
ADAPTER_BYTES = 16 * 32 * (2 * 8192 + 2 * 5120 + 3 * 18432) * 2
ACTIVATE_S = ADAPTER_BYTES / 25e9


# --- the engine in virtual time ------------------------------------------------------------------------
def lora_core(max_loras: int, max_cpu_loras: int | None = None) -> EngineCore:
    costs = lora_costs(MODEL, 16, 25e9)
    return EngineCore(PROFILE, EngineConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras or max_loras,
                                            lora_activate_s=costs.activate_s, lora_disk_s=costs.disk_s,
                                            lora_step_s=costs.step_s))


def lreq(rid: str, lora: int, out: int = 20, prompt: int = 64) -> SimRequest:
    return SimRequest(rid, prompt, [], 4096, out, lora_id=lora, lora_name=f"a{lora}" if lora else None)


def run_steps(core: EngineCore, reqs: list[SimRequest]) -> tuple[list[set[int]], dict[str, float]]:
    """Add everything at t=0 and step to the end: the adapter ids of each step, each request's first step time."""
    lora_of = {r.request_id: r.lora_id for r in reqs}
    for r in reqs:
        core.add(r, 0.0)
    now, steps, first = 0.0, [], {}
    while core.has_work():
        dur = core.plan_step(now)
        assert dur is not None
        now += dur
        events = core.finish_step(now)
        steps.append({lora_of[e.request_id] for e in events if lora_of[e.request_id]})
        for e in events:
            if e.record is not None:
                first[e.request_id] = e.record.first_scheduled
    return steps, first


def test_max_loras_1_never_puts_two_adapters_in_one_step():
    core = lora_core(1)
    steps, first = run_steps(core, [lreq("a-1", 1), lreq("b-1", 2), lreq("a-2", 1), lreq("base", 0)])
    assert all(len(s) <= 1 for s in steps)
    assert {1, 2} <= set().union(*steps)
    # b-1 keeps its place but waits: a-2 (same adapter as the running batch) and the base request go ahead of it
    assert first["a-1"] == first["a-2"] == first["base"] == 0.0
    assert first["b-1"] > 0.0
    assert core.stats.lora_activations == 2


def test_max_loras_2_runs_both_adapters_together():
    steps, first = run_steps(lora_core(2), [lreq("a-1", 1), lreq("b-1", 2), lreq("c-1", 3)])
    assert max(len(s) for s in steps) == 2
    assert first["a-1"] == first["b-1"] == 0.0 < first["c-1"]


def test_adapter_load_is_priced_from_its_size_and_the_host_link():
    costs = lora_costs(MODEL, 16, 25e9)
    assert costs.adapter_bytes == ADAPTER_BYTES
    assert costs.activate_s == pytest.approx(ACTIVATE_S)
    base, lora = lora_core(1), lora_core(1)
    t = lora.add_lora(1, 0.0)                  # a runtime load: disk to host memory, the engine busy meanwhile
    assert t == pytest.approx(costs.disk_s)
    base.add(lreq("x", 0), t)
    lora.add(lreq("x", 1), t)
    first_base, first_lora = base.plan_step(t), lora.plan_step(t)
    assert first_lora - first_base == pytest.approx(ACTIVATE_S + LORA_STEP_S)
    base.finish_step(t + first_base)
    lora.finish_step(t + first_lora)
    # the next step finds the adapter in its GPU slot: only the per-step LoRA kernels cost extra
    assert lora.plan_step(t + first_lora) - base.plan_step(t + first_base) == pytest.approx(LORA_STEP_S, abs=1e-6)


def test_host_memory_cache_evicts_least_recently_used_and_reloads_from_disk():
    core = lora_core(1, max_cpu_loras=2)
    costs = lora_costs(MODEL, 16, 25e9)
    assert core.add_lora(1, 0.0) == pytest.approx(costs.disk_s)
    assert core.add_lora(2, 1.0) == pytest.approx(costs.disk_s)
    assert core.add_lora(1, 2.0) == 0.0        # cached: touching it makes 2 the oldest
    core.add_lora(3, 3.0)
    assert core.has_lora(1)[0] and core.has_lora(3)[0] and not core.has_lora(2)[0]
    loads = core.stats.lora_disk_loads
    core.add(lreq("r", 2), 4.0)
    dur = core.plan_step(4.0)
    assert core.stats.lora_disk_loads == loads + 1
    assert dur > costs.disk_s + costs.activate_s


def test_static_modules_cost_the_engine_clock_nothing():
    server = SimServer(ServerConfig(enable_lora=True, max_loras=2, lora_modules="sql=/adapters/sql"))
    core = server.driver.core
    assert list(server.adapters) == ["sql"] and core.has_lora(1) == (True, False)
    base = EngineCore(PROFILE)
    core.add(lreq("r", 1), 0.0)
    base.add(lreq("r", 0), 0.0)
    # no disk read in the first step: only the slot copy and the LoRA kernels
    assert core.plan_step(0.0) - base.plan_step(0.0) == pytest.approx(ACTIVATE_S + LORA_STEP_S)


def test_runtime_load_waits_for_the_step_in_flight():
    core = lora_core(1)
    core.add(lreq("r", 0, out=50), 0.0)
    dur = core.plan_step(0.0)
    wait = core.add_lora(7, dur / 2)
    assert wait == pytest.approx(dur / 2 + lora_costs(MODEL, 16, 25e9).disk_s)


def test_lora_flags_are_checked_as_vllm_does():
    with pytest.raises(ConfigError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        SimServer(ServerConfig(enable_lora=True, max_loras=2, max_cpu_loras=1))
    with pytest.raises(ConfigError, match="needs --enable-lora"):
        SimServer(ServerConfig(lora_modules=["sql=/adapters/sql"]))
    with pytest.raises(ConfigError, match=r"max_lora_rank \(24\) must be one of"):
        SimServer(ServerConfig(enable_lora=True, max_lora_rank=24))
    with pytest.raises(ConfigError, match="name=path or JSON"):
        SimServer(ServerConfig(enable_lora=True, lora_modules=["sql"]))


# --- the server over HTTP ----------------------------------------------------------------------------------
LORA = {"enable_lora": True, "allow_runtime_lora_updating": True, "time_scale": 20,
        "lora_modules": ["sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat", "base_model_name": "'
                         + MODEL + '"}']}


def lora_series(url: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(url + "/metrics").text
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "vllm:lora_requests_info"]


def newest(url: str) -> dict[str, str]:
    """The label set with the newest timestamp, as a consumer of vllm:lora_requests_info reads it."""
    return max(lora_series(url), key=lambda item: item[1])[0]


def test_models_list_adapters_with_parent_and_root():
    with running_fleet(1, **LORA) as fleet:
        client = openai.OpenAI(base_url=fleet.urls[0] + "/v1", api_key="x")
        cards = {m.id: m for m in client.models.list().data}
        assert list(cards) == [MODEL, "sql", "chat"]
        assert cards[MODEL].parent is None and cards[MODEL].root == MODEL
        assert (cards["sql"].parent, cards["sql"].root) == (MODEL, "/adapters/sql")
        assert (cards["chat"].parent, cards["chat"].root) == (MODEL, "/adapters/chat")
        assert cards["sql"].max_model_len is None


def test_request_to_an_adapter_is_answered_in_its_name():
    with running_fleet(1, **LORA) as fleet:
        url = fleet.urls[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.model == "sql" and chat.usage.completion_tokens >= 1
        chunks = list(client.completions.create(model="chat", prompt="hello", max_tokens=3, stream=True))
        assert {c.model for c in chunks} == {"chat"}
        assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2).model == MODEL
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="nope", prompt="hello", max_tokens=2)
        assert err.value.body["message"] == "The model `nope` does not exist."
        state = httpx.get(url + "/sim/state").json()["lora"]
        assert state["activations"] >= 2 and state["adapters"]["sql"]["lora_int_id"] == 1


def test_runtime_load_and_unload_answers_and_errors():
    with running_fleet(1, **LORA) as fleet:
        url = fleet.urls[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        http = httpx.Client(base_url=url, timeout=10)
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": "/adapters/math"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'math' added successfully.")
        assert "content-type" not in r.headers
        assert client.completions.create(model="math", prompt="1+1", max_tokens=2).model == "math"
        assert [m.parent for m in client.models.list().data if m.id == "math"] == [MODEL]

        again = http.post("/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": "/other"})
        assert again.status_code == 400
        assert again.json()["error"] == {"message": "The lora adapter 'math' has already been loaded.",
                                         "type": "InvalidUserInput", "param": None, "code": 400}
        empty = http.post("/v1/load_lora_adapter", json={"lora_name": "", "lora_path": "/p"})
        assert empty.status_code == 400
        assert empty.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "x"}).json()["error"]["type"] == "Bad Request"

        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "math"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'math' removed successfully.")
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "math"})
        assert gone.status_code == 404
        assert gone.json()["error"] == {"message": "The lora adapter 'math' cannot be found.",
                                        "type": "NotFoundError", "param": None, "code": 404}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="math", prompt="1+1", max_tokens=2)
        assert "math" not in {m.id for m in client.models.list().data}
        # a name can be loaded again after its unload (with a new id, as vLLM counts them)
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": "/p"}).status_code == 200
        assert httpx.get(url + "/sim/state").json()["lora"]["adapters"]["math"]["lora_int_id"] == 4


def test_runtime_routes_need_the_runtime_switch_and_enable_lora():
    with running_fleet(1, enable_lora=True, allow_runtime_lora_updating=False) as fleet:
        r = httpx.post(fleet.urls[0] + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
        assert "vllm:lora_requests_info" in httpx.get(fleet.urls[0] + "/metrics").text
    with running_fleet(1, allow_runtime_lora_updating=True) as fleet:
        r = httpx.post(fleet.urls[0] + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "LoRA is not enabled. Use --enable-lora to enable LoRA."
        assert "vllm:lora_requests_info" not in httpx.get(fleet.urls[0] + "/metrics").text


def test_max_loras_1_over_http_the_gauge_shows_the_other_adapter_waiting():
    with running_fleet(1, **{**LORA, "max_loras": 1, "time_scale": 2}) as fleet:
        url = fleet.urls[0]
        http = httpx.Client(base_url=url, timeout=30)
        body = {"prompt": "tell me", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        first = http.send(http.build_request("POST", "/v1/completions", json={**body, "model": "sql"}), stream=True)
        lines = first.iter_lines()     # kept referenced: a collected generator would close the stream
        next(line for line in lines if '"text":"' in line)     # sql is running (for ~15 s)
        with http.stream("POST", "/v1/completions", json={**body, "model": "chat", "max_tokens": 3}) as second:
            labels = poll(lambda: (lambda s: s if s["waiting_lora_adapters"] == "chat" else None)(newest(url)),
                          what="chat waiting behind sql")
            assert labels == {"max_lora": "1", "running_lora_adapters": "sql", "waiting_lora_adapters": "chat"}
            first.close()      # sql's request goes away: chat gets the batch
            assert second.read().endswith(b"data: [DONE]\n\n")
        seen = lora_series(url)
        assert all("," not in labels["running_lora_adapters"] for labels, _ in seen)
        assert {labels["running_lora_adapters"] for labels, _ in seen} >= {"sql", "chat"}
        assert all(value > 1e9 for _, value in seen)    # a unix time, not a count


def test_fleetgate_sim_takes_vllm_lora_flags_and_the_env_switch(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    args = ["--enable-lora", "--lora-modules", "sql=/adapters/sql", "--lora-modules",
            '{"name": "chat", "path": "/adapters/chat"}', "--max-loras", "2", "--max-cpu-loras", "4"]
    with FleetProcess(1, time_scale=20, extra_args=args) as proc:
        url = proc.urls[0]
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [MODEL, "sql", "chat"]
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": "/adapters/math"})
        assert r.status_code == 200
        done = httpx.post(url + "/v1/completions", json={"model": "math", "prompt": "1+1", "max_tokens": 2})
        assert done.json()["model"] == "math"
        assert {labels["max_lora"] for labels, _ in lora_series(url)} == {"2"}


def test_fleet_file_takes_the_lora_keys():
    specs = fleet_from_dict({"defaults": {"enable_lora": True, "max_loras": 2},
                             "servers": [{"lora_modules": "sql=/adapters/sql", "max_cpu_loras": 4,
                                          "allow_runtime_lora_updating": True}, {}]})
    servers = [SimServer(s.config, s.name) for s in specs]
    assert [list(s.adapters) for s in servers] == [["sql"], []]
    assert [s.driver.core.max_loras for s in servers] == [2, 2]
    assert "/v1/load_lora_adapter" in servers[0]._routes
