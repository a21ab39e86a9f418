"""Configuration: `fleetgate config check` on good and bad files, environment overrides, serve's checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config
from gateway.server import build_serve_config
from tests.helpers import ROOT
from tests.helpers import run_cli as fleetgate

EXAMPLE = ROOT / "examples" / "fleetgate.yaml"


def test_config_check_accepts_the_shipped_example() -> None:
    r = fleetgate("config", "check", str(EXAMPLE))
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout and "3 worker(s)" in r.stdout and "prefix_affinity" in r.stdout
    cfg = load_config(EXAMPLE)
    assert [w.id for w in cfg.workers] == ["gpu-0", "gpu-1", "gpu-2"] and cfg.workers[0].cap == 64


BAD = """\
listen: {host: 0.0.0.0, port: 70000}
workers:
  - {id: a, url: "http://127.0.0.1:8101", role: both}
  - {id: "b c", url: "ftp://example"}
  - {url: "http://h:1", capp: 3}
models:
  m1: {slo: {ttft_ms: -5, tpot: 3}}
limits: {queue_timeout_s: "soon"}
"""


def test_config_check_explains_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    r = fleetgate("config", "check", str(bad))
    assert r.returncode == 1
    err = r.stderr
    expected = [
        "listen.port: Input should be less than or equal to 65535 (got 70000)",
        "workers[0].role: Input should be 'mixed', 'prefill' or 'decode' (got 'both')",
        "workers[1].id: must be 1-128 characters",
        "workers[1].url: must be an http:// or https:// URL",
        "(got 'ftp://example')",
        "workers[2].id: required field is missing",
        "workers[2].capp: unknown field (known fields here: id, url, role, models, labels, profile, cap, kv_events)",
        "models.m1.slo.ttft_ms: Input should be greater than 0 (got -5)",
        "models.m1.slo.tpot: unknown field (known fields here: ttft_ms, tpot_ms)",
        "limits.queue_timeout_s: Input should be a valid number",
    ]
    for line in expected:
        assert line in err, (line, err)
    assert "9 problem(s)" in err


@pytest.mark.parametrize(("text", "message"), [
    ("workers: [\n  {id: a, url: 'http://x:1'\n", "YAML syntax error at line"),
    ("- just\n- a list\n", "the top level must be a mapping"),
    ("default_policy: fastest\n", "default_policy: unknown policy 'fastest'; expected one of:"),
    ("models: {m: {policy: round_robin, params: {speed: 3}}}\n", "models.m.policy: policy 'round_robin' rejects"),
    ("workers: [{id: a, url: 'http://x:1'}, {id: a, url: 'http://y:1'}]\n", "duplicate worker id 'a'"),
    ("redis_url: localhost:6379\n", "redis_url: expected redis://host:port/db"),
    ("worker_discovery: [{dns: 'sim x', port: 8000}]\n", "worker_discovery[0].dns: must be a DNS name"),
    ("worker_discovery: [{dns: sim, port: 0}]\n", "worker_discovery[0].port: Input should be greater than or equal"),
    ("worker_discovery: [{dns: sim, port: 8000, nameservers: [consul]}]\n", "nameserver 'consul': expected an IP"),
    ("worker_discovery: [{dns: sim, port: 8000, nameservers: ['10.0.0.1:99999']}]\n", "port must be 1-65535"),
    ("worker_discovery: [{dns: sim, port: 8000, intervals: 5}]\n", "worker_discovery[0].intervals: unknown field"),
    ("autoscale: {actuator: {kind: docker}}\n", "docker.services is required with kind: docker"),
    ("autoscale: {actuator: {kind: docker, docker: {services: {interactive: sim}}}}\n",
     "autoscale.actuator.docker.services.interactive"),
])
def test_config_semantic_and_syntax_errors(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    assert message in str(exc.value)


def test_missing_file_and_empty_file(tmp_path: Path) -> None:
    r = fleetgate("config", "check", str(tmp_path / "nope.yaml"))
    assert r.returncode == 1 and "cannot read the file" in r.stderr
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    r = fleetgate("config", "check", str(empty))
    assert r.returncode == 0 and "0 worker(s)" in r.stdout


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETGATE_LIMITS__QUEUE_SIZE", "7")
    monkeypatch.setenv("FLEETGATE_API_KEYS", '["k1", "k2"]')
    monkeypatch.setenv("FLEETGATE_DEFAULT_POLICY", "round_robin")
    cfg = load_config(EXAMPLE)
    assert cfg.limits.queue_size == 7 and cfg.limits.queue_timeout_s == 5.0  # the rest of limits from the file
    assert cfg.api_keys == ["k1", "k2"] and cfg.default_policy == "round_robin"
    assert len(cfg.workers) == 3
    monkeypatch.setenv("FLEETGATE_HEALTH__INTERVAL_S", "-1")
    with pytest.raises(ConfigError, match=r"health.interval_s: Input should be greater than 0 \(got '-1'\)"):
        load_config(EXAMPLE)


def test_serve_refuses_a_bad_config_with_the_same_messages(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    r = fleetgate("serve", "--config", str(bad), "--port", "0")
    assert r.returncode == 1 and "workers[0].role" in r.stderr and "workers[2].capp" in r.stderr
    with pytest.raises(ConfigError, match="--worker 'not-a-url': must be an http"):
        build_serve_config(workers=["not-a-url"])
    with pytest.raises(ConfigError, match="default_policy: unknown policy 'nope'"):
        build_serve_config(policy="nope")


def test_serve_command_line_on_top_of_the_file() -> None:
    cfg = build_serve_config(EXAMPLE, port=0, workers=["http://10.0.0.9:8000/a", "http://10.0.0.9:8000/b/"],
                             policy="round_robin", redis_url="redis://127.0.0.1:6379/15")
    assert cfg.listen.port == 0 and cfg.listen.host == "127.0.0.1"
    assert [w.id for w in cfg.workers][-2:] == ["10.0.0.9:8000", "10.0.0.9:8000-2"]
    assert cfg.workers[-1].url == "http://10.0.0.9:8000/b"
    assert cfg.default_policy == "round_robin" and cfg.redis_url.endswith("/15")
    # one engine given twice (with and without a trailing slash) would be counted twice: refused
    with pytest.raises(ConfigError, match="names the same engine"):
        build_serve_config(EXAMPLE, port=0, workers=["http://10.0.0.9:8000", "http://10.0.0.9:8000/"])


def test_serve_policy_flag_applies_before_the_files_policy_parameters_are_checked(tmp_path: Path) -> None:
    """A file with aladdin's parameters (and the default policy) is served with `--policy aladdin`; it was refused
    because the file was checked against its own default policy before the flag applied."""
    f = tmp_path / "gw.yaml"
    f.write_text("workers:\n  - {id: a, url: 'http://127.0.0.1:9', profile: llama3-8b-h100}\n"
                 "default_policy_params: {price_cache: true}\n")
    with pytest.raises(ConfigError, match="price_cache"):
        build_serve_config(f)
    cfg = build_serve_config(f, policy="aladdin")
    assert cfg.default_policy == "aladdin" and cfg.default_policy_params == {"price_cache": True}


def test_slo_aware_policies_refuse_workers_without_a_model(tmp_path) -> None:
    """aladdin and hetero place by each worker's own performance model: a profile nobody declared is refused,
    never silently replaced by another GPU's coefficients."""
    from gateway.config import ConfigError, load_config

    cfg = tmp_path / "gw.yaml"
    cfg.write_text("workers:\n  - {id: a, url: 'http://127.0.0.1:9', profile: mystery-gpu}\n"
                   "  - {id: b, url: 'http://127.0.0.1:10', profile: llama3-8b-h100}\ndefault_policy: aladdin\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert e.value.problems == [
        "workers[0].profile: default_policy 'aladdin' needs each worker's performance model, and 'mystery-gpu' is "
        "no built-in profile, profile file or learning.priors entry (fleetgate sim --list-profiles lists the "
        "built-in ones)"]
    cfg.write_text(cfg.read_text() + "learning: {priors: {mystery-gpu: {k1: 1.0e-4, c1: 0.02}}}\n")
    assert load_config(cfg).default_policy == "aladdin"          # declared coefficients: accepted
    cfg.write_text("workers:\n  - {id: a, url: 'http://127.0.0.1:9', profile: mystery-gpu}\n")
    assert load_config(cfg).default_policy == "least_tokens"   # a plain policy needs no model
def test_keys_are_checked_for_repeats_and_for_an_admin_key_that_is_also_an_inference_key() -> None:
    import hashlib

    from gateway.config import ConfigError, load_config

    hashed = "sha256:" + hashlib.sha256(b"sk-one-key-123").hexdigest()
    with pytest.raises(ConfigError) as e:
        load_config(None, api_keys=["sk-one-key-123"], auth={"admin_key": "sk-one-key-123-admin!", "keys": [
            {"key": hashed}, {"key": "sk-other-key", "rpm": 0}]})
    text = "\n".join(e.value.problems)
    assert "auth.keys[1].rpm" in text  # limits are positive
    with pytest.raises(ConfigError) as e:
        load_config(None, api_keys=["sk-one-key-123"], auth={"keys": [{"key": hashed}]})
    assert e.value.problems == ["auth.keys[0].key: the same key as api_keys[0]"]  # a digest of the same key
    with pytest.raises(ConfigError) as e:
        load_config(None, api_keys=["sk-admin-too-1234567"], auth={"admin_key": "sk-admin-too-1234567"})
    assert "auth.admin_key" in e.value.problems[0]
    with pytest.raises(ConfigError):
        load_config(None, server={"trusted_proxies": ["not-an-ip"]})


def test_deprecated_stall_knobs_still_load_with_a_warning(tmp_path: Path) -> None:
    f = tmp_path / "old.yaml"
    f.write_text("workers: [{id: w0, url: 'http://127.0.0.1:9'}]\n"
                 "resume: {suspect_hold_s: 3.0}\npd: {prefill_timeout_s: 20.0}\n")
    with pytest.warns(DeprecationWarning) as seen:
        cfg = load_config(f)
    assert {str(w.message).split(" is ")[0] for w in seen} == {"config key resume.suspect_hold_s",
                                                               "config key pd.prefill_timeout_s"}
    assert cfg.resume.ejection_base_s == 3.0  # the hold is now the base of the ejection backoff
    assert cfg.pd.prefill_timeout_s == 20.0   # now only the cap of the stall rule's wait for a prefill leg
    fresh = load_config(None)
    assert fresh.resume.ejection_base_s == 10.0 and fresh.pd.prefill_timeout_s is None
