"""The deployment files stay consistent with the code: the dashboard only plots series the gateway exports,
and the shipped gateway configs pass `config check` (the compose and Kubernetes files: test_ops_deploy_files.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from gateway.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def exported_series() -> set[str]:
    """Every series a gateway can export: its own, the SLO book's and the P/D router's."""
    from gateway.core import Gateway
    from gateway.pipeline.pd_legs import PdMetrics

    gw = Gateway(load_config(None))
    PdMetrics.for_registry(gw.metrics.registry)
    names: set[str] = set()
    for family in gw.metrics.registry.collect():
        for sample in family.samples:
            names.add(sample.name)
        names.add(family.name)
    return names


def test_dashboard_is_generated_from_its_script() -> None:
    from deploy.grafana.make_dashboard import build

    on_disk = json.loads((ROOT / "deploy/grafana/dashboards/fleetgate.json").read_text())
    assert on_disk == build(), "run: python deploy/grafana/make_dashboard.py"


def test_dashboard_only_uses_exported_gateway_series() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/fleetgate.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    exprs += [r["expr"] for g in yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"]
              for r in g["rules"]]
    used = {m for e in exprs for m in re.findall(r"\bfleetgate_[a-z_]+", e)}
    assert used, "the dashboard plots no gateway series"
    exported = exported_series()
    # Series with labels appear only once a label set exists; accept the family name too.
    def base(m: str) -> str:
        for suffix in ("_bucket", "_count", "_sum", "_total"):
            m = m.removesuffix(suffix)
        return m

    missing = {m for m in used if m not in exported and base(m) not in exported}
    assert not missing, f"dashboard or alerts use series the gateway does not export: {sorted(missing)}"


def test_shipped_configs_are_valid() -> None:
    for path in (ROOT / "deploy/compose/fleetgate.yaml", ROOT / "deploy/compose/fleetgate-autoscale.yaml",
                 ROOT / "deploy/compose/fleetgate-gpu.yaml", ROOT / "examples/fleetgate.yaml"):
        cfg = load_config(path)
        assert cfg.workers or cfg.worker_discovery, path   # listed, or found by DNS (the compose stack's sim)
    # docker-compose.yml and deploy/kubernetes (with its gateway config): tests/test_ops_deploy_files.py
