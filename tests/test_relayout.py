"""scripts/relayout.py, the migration of gateway/ into layered subpackages: its reference rewriting and its
splitter, on made-up sources (the answers do not depend on whether the tree was migrated yet).

The rewriting must change imports, string constants naming a module and file paths, never attribute access
(`gw.config`, `self.gateway.registry`), and leave what it already rewrote alone (the script is re-run on a
tree that has grown since). The splitter must send each definition to the module its name is mapped to,
with the imports it uses, and stop on parts that would import each other.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def relayout():
    spec = importlib.util.spec_from_file_location("relayout", ROOT / "scripts" / "relayout.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["relayout"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("relayout", None)


def test_imports_are_rewritten_name_by_name(relayout):
    src = ("from gateway.relay import Relay, RelayResult as RR\n"
           "from gateway import errors, batch_api\n"
           "def f():\n"
           "    from gateway.registry import WorkerState\n"
           "from gateway.config import GatewayConfig\n")
    out = relayout.rewrite_python(src)
    assert out == ("from gateway.pipeline.relay import Relay\n"
                   "from gateway.wire.results import RelayResult as RR\n"
                   "from gateway.wire import errors\n"
                   "from gateway.api import batch as batch_api\n"
                   "def f():\n"
                   "    from gateway.fleet.registry import WorkerState\n"
                   "from gateway.config import GatewayConfig\n")
    ast.parse(out)
    assert relayout.rewrite_python(out) == out


def test_attribute_access_is_never_touched(relayout):
    src = ("gw.config.models\nself.gateway.registry.workers\ngateway = make()\ngateway.registry.get(1)\n"
           "x = gw.dispatch\n")
    assert relayout.rewrite_python(src) == src
    text = "see `self.gateway.registry` and gw.config, or the module gateway.registry\n"
    assert relayout.rewrite_text(text) == ("see `self.gateway.registry` and gw.config, or the module "
                                           "gateway.fleet.registry\n")


def test_strings_and_paths(relayout):
    src = ('monkeypatch.setattr("gateway.relay.UpstreamFailure", X)\n'
           'CMD = ["python", "-m", "gateway.cli"]\n'
           '"""Read gateway/dispatch.py and gateway/state/jobs.py; the YAML in gateway.yaml."""\n')
    out = relayout.rewrite_python(src)
    assert out == ('monkeypatch.setattr("gateway.wire.results.UpstreamFailure", X)\n'
                   'CMD = ["python", "-m", "gateway.cli"]\n'
                   '"""Read gateway/pipeline/dispatch.py and gateway/state/jobs.py; the YAML in gateway.yaml."""\n')
    assert relayout.rewrite_python(out) == out
    md = "| `gateway/config.py` | `gateway/request.py` and gateway/uploads.py |\n"
    assert relayout.rewrite_text(md) == "| `gateway/config/` | `gateway/request/parse.py` and gateway/api/uploads.py |\n"


def test_split_sends_each_definition_where_it_is_mapped(relayout):
    src = ('"""Doc."""\n\nfrom __future__ import annotations\n\nimport re\nfrom typing import TYPE_CHECKING\n\n'
           "if TYPE_CHECKING:\n    from gateway.core import Gateway\n\n"
           "PAT = re.compile('x')\n\n\n# the checker\ndef check(g: Gateway) -> bool:\n    return bool(PAT)\n\n\n"
           "def other() -> int:\n    return 1\n")
    spec = relayout.Split(default="x.main", parts={"PAT": "x.base"}, docs={"x.base": "Base."},
                          stays={"check"})
    parts, unknown, missing = relayout.plan_split("x", spec, src)
    assert {p: [c.names for c in cs] for p, cs in parts.items()} == {"x.base": [["PAT"]],
                                                                      "x.main": [["check"], ["other"]]}
    assert unknown == ["other"] and missing == []
    deps = relayout.part_deps(parts)
    assert deps == {"x.base": {}, "x.main": {"x.base": {"PAT"}}}
    doc, header, _, _ = relayout.chunks_of(src, ast.parse(src))
    main = relayout.render_part(doc, header, parts["x.main"], deps["x.main"])
    assert "import re\n" not in main and "from gateway.x.base import PAT\n" in main
    assert "if TYPE_CHECKING:\n    from gateway.core import Gateway\n" in main and "# the checker\n" in main
    base = relayout.render_part("Base.", header, parts["x.base"], {})
    assert base.startswith('"""Base."""\n') and "import re\n" in base and "TYPE_CHECKING" not in base
    ast.parse(main)
    ast.parse(base)


def test_split_parts_that_import_each_other_are_refused(relayout):
    deps = {"a": {"b": {"x"}}, "b": {"a": {"y"}}, "c": {}}
    assert relayout.find_cycle(deps) == ["a", "b", "a"]
    assert relayout.find_cycle({"a": {"b": {"x"}}, "b": {}}) is None


def test_every_layer_unit_is_described(relayout):
    """Each subpackage in the layer order has its one-line description (it becomes its __init__ docstring
    and its row in docs/design.md), and every move lands in a layer."""
    packages = {new.split(".")[0] for new in relayout.MOVES.values() if "." in new}
    assert packages <= set(relayout.PACKAGES) <= set(relayout.LAYERS)
    assert relayout.TOP_LEVEL - {"__init__"} <= set(relayout.LAYERS)
    assert len(relayout.TOP_LEVEL - {"__init__"}) <= relayout.MAX_TOP_LEVEL
