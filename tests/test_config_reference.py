"""docs/configuration.md is `fleetgate config reference`, generated from the config models; every key there has
a type, a default and a description, and the environment's FLEETGATE_* variables change nothing in it."""

from __future__ import annotations

import os

from pydantic import BaseModel

from gateway.config import GatewayConfig
from gateway.config.reference import REGENERATE, _nested, reference
from policies.admission import DEFAULT_QUEUE_SIZE
from tests.helpers import ROOT, run_cli

DOC = ROOT / "docs" / "configuration.md"


def _keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str | None]]:
    """(path, description) of every key, nested sections included, as the reference spells the paths."""
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        out.append((path, field.description))
        nested = _nested(field.annotation)
        if nested is not None:
            out += _keys(nested[0], f"{path}{nested[1]}.")
    return out


def test_every_key_has_a_description_and_a_row() -> None:
    keys = _keys(GatewayConfig)
    assert len(keys) > 200
    undocumented = [k for k, d in keys if not (d and d.strip())]
    assert not undocumented, f"give these keys Field(description=...): {undocumented}"
    text = reference()
    missing = [k for k, _ in keys if f"| `{k}` |" not in text]
    assert not missing, missing


def test_docs_configuration_md_is_the_generated_reference() -> None:
    assert DOC.read_text(encoding="utf-8") == reference(), (
        f"docs/configuration.md is out of date: regenerate it with `{REGENERATE}`")


def test_the_reference_ignores_the_environment() -> None:
    env = {"FLEETGATE_LISTEN__PORT": "9999", "FLEETGATE_LIMITS__QUEUE_SIZE": "3", "FLEETGATE_DEFAULT_POLICY": "x",
           "FLEETGATE_ADMIN_KEY": "an-admin-key-from-the-environment"}
    r = run_cli("config", "reference", env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    assert r.stdout == DOC.read_text(encoding="utf-8")
    assert f"| `limits.queue_size` | int, >= 0 | `{DEFAULT_QUEUE_SIZE}` |" in r.stdout
    assert "9999" not in r.stdout and "an-admin-key" not in r.stdout
