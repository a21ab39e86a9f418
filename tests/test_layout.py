"""gateway/'s layout (docs/design.md, "Where things live"): subpackages in layers
that import one way, few modules at the top level, no long modules.

- A module imports only from its own layer and the layers below it (`LAYERS`, lowest first), at run time or
  under `TYPE_CHECKING`; the only upward imports are the type-only ones `TYPE_ONLY_UP` lists with a reason.
- At most 10 modules at gateway/'s top level; no module in gateway/ or its subpackages is over
  800 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_repo_hygiene import gateway_sources

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ['wire', 'config', 'state', 'ops', 'fleet', 'request', 'tenancy', 'pipeline', 'batch', 'control', 'core', 'api', 'app', 'server', 'demo', 'cli']
TYPE_ONLY_UP = {
    ('pipeline', 'control'): "the dispatcher is handed the swap controller (a model's wake time)",
    ('ops', 'fleet'): 'the status history samples the registry it is handed',
}
MAX_TOP_LEVEL = 10
MAX_LINES = 800


def unit(mod: str) -> str:
    """`gateway.pipeline.dispatch` -> `pipeline`; `gateway.core` -> `core`."""
    return mod.split(".")[1] if mod.count(".") else mod


def imports_of(text: str):
    """(imported gateway module or name, line, type-only) for each absolute import of gateway.<something>."""
    tree = ast.parse(text)
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            type_only.update(id(n) for sub in node.body for n in ast.walk(sub))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "gateway" else [f"gateway.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("gateway."):
                yield name, node.lineno, id(node) in type_only


def layer_violations(sources: dict[str, str]) -> list[str]:
    rank = {u: i for i, u in enumerate(LAYERS)}
    bad = []
    for mod, text in sorted(sources.items()):
        if mod == "gateway":
            continue
        here = unit(mod)
        for name, line, type_only in imports_of(text):
            there = unit(name)
            if there not in rank or here not in rank:
                bad.append(f"{mod}:{line}: {here} or {there} is in no layer (add it to LAYERS)")
            elif rank[there] > rank[here] and not (type_only and (here, there) in TYPE_ONLY_UP):
                kind = "type-only " if type_only else ""
                bad.append(f"{mod}:{line}: {kind}import of {name} goes up from {here} to {there}")
    return bad


def test_layers_import_one_way():
    bad = layer_violations(gateway_sources())
    assert not bad, "imports against the layer order (LAYERS, lowest first):\n" + "\n".join(bad)


def test_layer_checker_sees_what_it_must():
    src = {
        "gateway.wire.errors": "",
        "gateway.pipeline.dispatch": "from gateway.wire import errors\nfrom gateway.api.admin import x\n",
        "gateway.ops.status_history": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from gateway.fleet.registry import Registry\n",
        "gateway.fleet.registry": "from gateway.ops.metrics import GatewayMetrics\n"
                                  "from gateway.pipeline.dispatch import x\n",
    }
    assert layer_violations(src) == [
        "gateway.fleet.registry:2: import of gateway.pipeline.dispatch goes up from fleet to pipeline",
        "gateway.pipeline.dispatch:2: import of gateway.api.admin goes up from pipeline to api"]


def test_every_subpackage_is_in_a_layer():
    subpackages = {p.name for p in (ROOT / "gateway").iterdir() if (p / "__init__.py").is_file()}
    top = {p.stem for p in (ROOT / "gateway").glob("*.py")} - {"__init__"}
    assert subpackages <= set(LAYERS), subpackages - set(LAYERS)
    assert top <= set(LAYERS), top - set(LAYERS)


def test_few_modules_at_the_top_level():
    top = sorted(p.name for p in (ROOT / "gateway").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL, top


def test_no_long_modules():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / "gateway").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them):\n" + "\n".join(long)
