"""`fleetgate plan` and `fleetgate simulate --deployment` as real processes: the plan's JSON is a deployment file
that simulates to the attainment the plan predicted, runner-ups say why they lost, bad input exits 2 with a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policies.hardware import GPUS
from tests.helpers import run_cli

QUIET = {"FLEETGATE_PROGRESS": "0"}
SMALL = ["--trace", "sharegpt", "--rate", "12", "--duration", "30", "--slo-ttft-ms", "800", "--slo-tpot-ms", "40"]


@pytest.fixture(scope="module")
def cost_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    # One traffic draw per score, so `simulate --deployment` on the same seed reproduces the prediction exactly.
    res = run_cli("plan", "--model", "llama3-8b", "--gpus", "a100:8", "--gpus", "l4:8:0.5", *SMALL,
                  "--score-seeds", "1", "--json", "--out", str(out), env=QUIET, timeout=180)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert json.loads(out.read_text()) == plan
    return plan, out


def test_cost_plan_meets_its_target_within_the_stock(cost_plan: tuple[dict, Path]) -> None:
    plan, _ = cost_plan
    pred = plan["predicted"]
    assert plan["meets_target"] is True and pred["slo_attainment"] >= 0.95
    groups = plan["deployment"]["groups"]
    assert groups and all(g["role"] == "mixed" and g["count"] >= 1 for g in groups)
    for gpu, stock in (("a100", 8), ("l4", 8)):
        assert sum(g["gpus"] for g in groups if g["gpu"] == gpu) <= stock
    prices = {"a100": GPUS["a100"].price_per_hour, "l4": 0.5}
    assert pred["cost_per_hour"] == pytest.approx(sum(g["gpus"] * prices[g["gpu"]] for g in groups), abs=1e-3)
    assert pred["gpus"] == sum(g["gpus"] for g in groups)
    # Every scored runner-up that costs less than the winner missed the target.
    for r in plan["runner_ups"]:
        assert r["why_lost"]
        if "slo_attainment" in r and r["cost_per_hour"] < pred["cost_per_hour"]:
            assert r["slo_attainment"] < 0.95
    assert plan["search"]["simulations"] >= 1


def test_the_plan_file_simulates_to_its_prediction(cost_plan: tuple[dict, Path]) -> None:
    plan, path = cost_plan
    res = run_cli("simulate", "--deployment", str(path), "--trace", "sharegpt", "--rate", "12", "--duration", "30",
                  "--json", env=QUIET, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["slo_attainment"] == pytest.approx(plan["predicted"]["slo_attainment"], abs=1e-3)
    assert got["gpus"] == plan["predicted"]["gpus"] and got["policy"] == "hetero"


def test_the_deployment_section_alone_in_yaml_runs_too(cost_plan: tuple[dict, Path], tmp_path: Path) -> None:
    import yaml

    plan, _ = cost_plan
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump({"deployment": plan["deployment"]}))
    res = run_cli("simulate", "--deployment", str(path), "--rate", "12", "--duration", "30", "--json",
                  env=QUIET, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["slo_attainment"] == pytest.approx(plan["predicted"]["slo_attainment"], abs=1e-3)


def test_two_models_share_the_gpus_and_throughput_uses_the_budget() -> None:
    res = run_cli("plan", "--model", "llama3-8b:3", "--model", "llama2-13b:1", "--gpus", "a100:8", "--gpus", "h100:4",
                  *SMALL, "--objective", "throughput", "--budget", "12", "--score-top", "2", "--score-seeds", "1", "--json",
                  env=QUIET, timeout=180)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["search"]["seeds_per_score"] == [0]
    models = {g["model"] for g in plan["deployment"]["groups"]}
    assert models == {"llama3-8b", "llama2-13b"}
    assert plan["predicted"]["cost_per_hour"] <= 12 + 1e-6
    shares = {s["model"]: s["share"] for s in plan["deployment"]["services"]}
    assert shares == pytest.approx({"llama3-8b": 0.75, "llama2-13b": 0.25})
    # Throughput at SLO: the largest offered rate whose simulated attainment still reaches the target.
    assert plan["predicted"]["slo_attainment"] >= 0.95 and plan["predicted"]["offered_rps"] > 0
    assert any(step.startswith("throughput at SLO") for step in plan["predicted"]["steps"])
    for r in plan["runner_ups"]:
        if "offered_rps" in r and r["slo_attainment"] >= 0.95:
            assert r["offered_rps"] <= plan["predicted"]["offered_rps"] + 1e-9


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "gpt-5", "--gpus", "a100:1"], "unknown model"),
    (["--model", "llama3-8b", "--gpus", "tpu:4"], "unknown GPU type"),
    (["--model", "llama3-8b", "--gpus", "a100"], "TYPE:COUNT"),
    (["--model", "llama3-8b", "--gpus", "a100:0"], "COUNT must be"),
    (["--model", "llama3-8b:-1", "--gpus", "a100:2"], "share must be"),
    (["--model", "llama3-8b", "--gpus", "a100:2", "--target", "1.5"], "--target"),
    (["--model", "llama3-8b", "--gpus", "a100:2", "--objective", "speed"], "--objective"),
    (["--model", "llama2-70b", "--gpus", "l4:1"], "none of the GPU types"),
    (["--gpus", "a100:2"], "at least one --model"),
])
def test_bad_input_is_refused_with_a_reason(args: list[str], message: str) -> None:
    res = run_cli("plan", *args, "--rate", "5", "--duration", "5", env=QUIET)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert message in res.stderr and "Traceback" not in res.stderr


def test_a_broken_deployment_file_is_refused_with_a_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    for content, message in (("{", "not valid JSON"), ('{"deployment": {"groups": []}}', "non-empty `groups`"),
                             ('{"groups": [{"model": "llama2-70b", "gpu": "a100", "tp": 1, "count": 1}]}',
                              "does not fit"),
                             ('{"groups": [{"model": "llama3-8b", "gpu": "a100", "tp": 1, "count": 1, '
                              '"role": "pooled"}]}', "role must be")):
        bad.write_text(content)
        res = run_cli("simulate", "--deployment", str(bad), "--rate", "2", "--duration", "5", env=QUIET)
        assert res.returncode == 2 and message in res.stderr, res.stderr


def test_the_plan_is_a_valid_gateway_config_section(cost_plan: tuple[dict, Path], tmp_path: Path) -> None:
    import yaml

    plan, _ = cost_plan
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(yaml.safe_dump({"workers": [{"id": "w0", "url": "http://127.0.0.1:9"}],
                                   "deployment": plan["deployment"]}))
    res = run_cli("config", "check", str(cfg))
    assert res.returncode == 0, res.stderr
    g = plan["deployment"]["groups"][0]
    assert f"{g['count']}x {g['model']} on {g['tp']}x {g['gpu']}" in res.stdout
    # The same file drives the simulator.
    sim = run_cli("simulate", "--deployment", str(cfg), "--rate", "12", "--duration", "30", "--json", env=QUIET,
                  timeout=120)
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["slo_attainment"] == pytest.approx(plan["predicted"]["slo_attainment"], abs=1e-3)
    # A group that cannot run is a config problem, named.
    bad = dict(plan["deployment"], groups=[dict(g, model="llama2-70b", gpu="l4", tp=1)])
    cfg.write_text(yaml.safe_dump({"deployment": bad}))
    res = run_cli("config", "check", str(cfg))
    assert res.returncode == 1 and "deployment.groups[0]" in res.stderr and "does not fit" in res.stderr


def test_demo_runs_a_two_model_deployment_behind_the_gateway(tmp_path: Path) -> None:
    import signal

    import httpx
    import openai

    from tests.helpers import ADMIN, ADMIN_KEY, CliProcess, free_port_range, refused

    plan = {"deployment": {"groups": [
        {"model": "llama3-8b", "gpu": "h100", "tp": 1, "role": "mixed", "count": 2},
        {"model": "llama2-13b", "gpu": "a100", "tp": 2, "role": "mixed", "count": 1}],
        "services": [{"model": "llama3-8b", "share": 0.7}, {"model": "llama2-13b", "share": 0.3}],
        "policy": "hetero", "slo": {"ttft_ms": 1000, "tpot_ms": 50}}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    base = free_port_range(4)
    with CliProcess("demo", "--deployment", str(path), "--port", str(base), "--base-port", str(base + 1),
                    "--time-scale", "20", env={"FLEETGATE_ADMIN_KEY": ADMIN_KEY}, merge_stderr=True) as demo:
        demo.wait_for("fleetgate listening on", timeout=90)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{base}/v1", api_key="x", max_retries=0, timeout=20)
        for hf in ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-2-13b-chat-hf"):
            r = client.chat.completions.create(model=hf, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert r.usage.completion_tokens >= 1
        workers = httpx.get(f"http://127.0.0.1:{base}/admin/workers", headers=ADMIN, timeout=5).json()
        text = json.dumps(workers)
        assert "llama3-8b-h100-0" in text and "llama3-8b-h100-1" in text and "llama2-13b-tp2-a100-2" in text
        assert demo.send_signal(signal.SIGINT, timeout=20) == 0
    assert all(refused(base + k) for k in range(4))


def test_pooled_scores_weigh_every_request_once() -> None:
    from simulator.planner import PlanRequest, pooled

    assert PlanRequest.score_seeds == 2               # the default: two traffic draws per score

    def run(met: int, servable: int, goodput: float) -> dict:
        return {"requests": servable, "servable": servable, "slo_met": met, "slo_attainment": met / servable,
                "goodput_rps": goodput, "throughput_rps": goodput, "output_tokens_per_s": 10 * goodput,
                "gpu_seconds": 100.0, "models": {"m": {"requests": servable, "slo_attainment": met / servable,
                                                       "goodput_rps": goodput, "throughput_rps": goodput}}}

    both = pooled([run(90, 100, 3.0), run(290, 300, 5.0)])
    assert both["slo_attainment"] == pytest.approx(380 / 400)
    assert both["models"]["m"]["slo_attainment"] == pytest.approx(380 / 400)
    assert both["goodput_rps"] == pytest.approx(4.0) and both["requests"] == 400


def test_demand_counts_only_what_the_model_can_serve() -> None:
    from simulator.deployment import DeploymentRun
    from simulator.planner import demands_for, parse_models
    from simulator.workload import trace_rows

    rows = trace_rows("sharegpt")
    short, long_ = demands_for(parse_models(["llama2-13b", "llama3-8b"]), DeploymentRun(trace="sharegpt", rate=10.0))
    servable = sum(1 for p, _ in rows if p < 4096) / len(rows)      # Llama 2's context
    assert short.rate == pytest.approx(5.0 * servable) and servable < 1.0
    assert long_.rate == pytest.approx(5.0)                            # Llama 3.1 holds every prompt of the trace
    assert short.mean_input < long_.mean_input


def test_a_plan_for_a_short_context_model_is_scored_on_the_traffic_it_will_see(tmp_path: Path) -> None:
    """Llama 2 refuses a fifth of ShareGPT's prompts (over 4096 tokens): the plan still replays the whole --rate, as
    `simulate --deployment` does, so the two agree."""
    out = tmp_path / "plan.json"
    res = run_cli("plan", "--model", "llama2-13b", "--gpus", "a100:4", "--rate", "3", "--duration", "30",
                  "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50", "--score-seeds", "1", "--out", str(out), "--json",
                  env=QUIET, timeout=180)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["predicted"]["offered_rps"] == 3 and plan["workload"]["demands"][0]["rate_rps"] < 3
    sim = run_cli("simulate", "--deployment", str(out), "--rate", "3", "--duration", "30", "--json", env=QUIET,
                  timeout=120)
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["slo_attainment"] == pytest.approx(plan["predicted"]["slo_attainment"], abs=1e-3)
