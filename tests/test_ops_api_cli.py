"""CLI and API polish: --version, plain flag help, every config problem in one pass, /v1/models/{id}, the
workers' other OpenAI routes through the gateway, and sampling fields refused in OpenAI's error shape."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import MODEL, run_cli, running_gateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def test_version_and_readable_help() -> None:
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("fleetgate 0.")
    for cmd in ("demo", "serve", "simulate", "sim"):
        h = run_cli(cmd, "--help")
        assert h.returncode == 0, h.stderr
        assert "<bool>" not in h.stdout and "list[str]" not in h.stdout, h.stdout
    assert "--autoscale " in run_cli("demo", "-h").stdout


def test_config_check_reports_schema_and_policy_problems_together(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("default_policy: nope\nlisten: {port: -3}\nmodels:\n  m1: {policy: fancy}\n")
    r = run_cli("config", "check", str(bad))
    assert r.returncode == 1
    assert "3 problem(s)" in r.stderr
    assert "listen.port" in r.stderr and "unknown policy 'nope'" in r.stderr and "unknown policy 'fancy'" in r.stderr


async def test_model_card_by_id(sim_fleet, make_client) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls) as gw:
        client = make_client(gw.url)
        card = await client.models.retrieve(MODEL)
        assert card.id == MODEL
        with pytest.raises(openai.NotFoundError) as exc:
            await client.models.retrieve("no/such-model")
        assert exc.value.body["code"] == "model_not_found"


async def test_tokenize_detokenize_and_embeddings_pass_through(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=20)
    async with running_gateway(fleet.urls) as gw, httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/tokenize", json={"model": MODEL, "prompt": "hello there"})
        assert r.status_code == 200 and r.json()["count"] == 3 and len(r.json()["tokens"]) == 3
        r = await c.post(gw.url + "/tokenize", json={"prompt": "no model named: the only one"})
        assert r.status_code == 200 and r.json()["count"] > 0
        r = await c.post(gw.url + "/detokenize", json={"model": MODEL, "tokens": [1, 2, 3]})
        assert r.status_code == 200 and isinstance(r.json()["prompt"], str)
        r = await c.post(gw.url + "/tokenize", json={"model": "other", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # A generate model's embeddings route: vLLM 0.11 sends its error with HTTP 200; the client gets a 400.
        r = await c.post(gw.url + "/v1/embeddings", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "does not support Embeddings" in r.json()["error"]["message"]
        r = await c.get(gw.url + "/tokenize")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        metrics = (await c.get(gw.url + "/metrics")).text
    assert 'policy="passthrough",status="200"' in metrics


async def test_passthrough_with_no_worker_is_a_503(sim_fleet) -> None:
    async with running_gateway(workers=[{"id": "gone", "url": "http://127.0.0.1:9", "models": [MODEL]}],
                               health={"interval_s": 30}) as gw, httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/embeddings", json={"model": MODEL, "input": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", "abc"), ("temperature", -1), ("temperature", True), ("top_p", 0), ("top_p", "1"),
    ("n", 0), ("n", 1.5), ("presence_penalty", 3), ("seed", "x"), ("stop", 5), ("stop", ["a", 1]),
    ("top_k", -5), ("min_p", 2),
])
async def test_bad_sampling_fields_are_400_in_openai_shape(sim_fleet, field, value) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls) as gw, httpx.AsyncClient() as c:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": MODEL, "prompt": "x"})):
            r = await c.post(gw.url + path, json={**body, field: value})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == field, err


async def test_engine_refusal_comes_back_in_openai_shape(sim_fleet, make_client) -> None:
    """n=2 is valid for OpenAI; the simulator refuses it as vLLM would refuse any request: vLLM's body
    (type BadRequestError, code 400) reaches the client as OpenAI's (invalid_request_error)."""
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls) as gw, httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err == {"message": err["message"], "type": "invalid_request_error", "param": None, "code": None}
        ok = await c.post(gw.url + "/v1/chat/completions", json={**CHAT, "temperature": 0.7, "top_p": 0.9, "n": 1})
        assert ok.status_code == 200
        with pytest.raises(openai.BadRequestError):
            await make_client(gw.url).completions.create(model=MODEL, prompt="x", n=2)
