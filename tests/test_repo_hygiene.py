"""Repository hygiene: no paths of one machine, every reference citation resolvable, dependency arrows.

- No tracked text file names a location that exists only on a developer's machine (a home or scratch
  directory, a sibling checkout, a fixed directory under the system temp dir).
- Every file under `docs/` that another file names exists, and the reference notes are always cited by their place in
  the repo (`docs/reference/vllm-interface.md §4.2`), never by a bare file name a reader cannot find.
- Every `§N` cited for a reference note (full or short form, `vllm-interface §4.2`) is a section heading of
  that note.
- Imports run one way (docs/design.md, "Component boundaries"): `policies` imports no other component,
  `engine_adapters` only `policies`, the product (`gateway`) never `bench` and the simulator only lazily,
  inside the function that needs it (the `sim` actuator, `fleetgate sim`/`demo`/`simulate`, the priors).
- No two modules of `gateway/` import each other, directly or round a loop (type-only imports count).
- No Python file cites an issue number.
"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DIR = ROOT / "docs" / "reference"
BINARY_SUFFIXES = {".png", ".gz", ".jpg", ".jpeg", ".ico", ".pdf", ".whl", ".zip"}

# Built from pieces so this file does not match itself.
MACHINE_PATHS = [
    re.compile("/" + "work/"),
    re.compile("/" + "farm/"),
    re.compile(r"\.\./" + "shared"),
    re.compile("/" + "root/"),
    re.compile("/" + r"tmp/[A-Za-z0-9_.-]+/"),
]
# Notes that lived outside the repo; any mention must be the in-repo path.
RETIRED_NOTES = {"DESIGN.md", "STYLE.md"}
SELF = "tests/test_repo_hygiene.py"


@cache
def tracked_text_files() -> tuple[tuple[str, str], ...]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in out.decode().split("\0"):
        path = ROOT / name
        if not name or path.suffix in BINARY_SUFFIXES or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        files.append((name, data.decode("utf-8", errors="replace")))
    return tuple(files)


def reference_sections(note: Path) -> set[str]:
    """Section numbers of a reference note: `## 4. P/D`, `### 4.2 The protocol`, `### 6.5 A / 6.6 B`."""
    sections = set()
    for line in note.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            sections.update(re.findall(r"(?:^|/\s*)(\d+(?:\.\d+)*)\.?(?=\s)", title))
    return sections


def reference_notes() -> dict[str, set[str]]:
    return {p.stem: reference_sections(p) for p in sorted(REFERENCE_DIR.glob("*.md"))}


def cited_sections(text: str, note_names: list[str]):
    """(note, section, line number) for `docs/reference/<note>.md §N` and `<note> §N`, with follow-ups
    such as `§1.1 and §2.1` or `§4.2, §4.3`."""
    names = "|".join(re.escape(n) for n in note_names)
    head = re.compile(rf"(?:docs/reference/)?\b({names})(?:\.md)? §(\d+(?:\.\d+)*)")
    more = re.compile(r"\s*(?:,|and|/|or)\s*§(\d+(?:\.\d+)*)")
    for m in head.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        yield m.group(1), m.group(2), line
        pos = m.end()
        while (n := more.match(text, pos)) is not None:
            yield m.group(1), n.group(1), line
            pos = n.end()


def test_reference_notes_exist_with_sections():
    notes = reference_notes()
    assert {"vllm-interface", "peer-routers", "vllm-cpu"} <= set(notes)
    for name, sections in notes.items():
        assert {"1", "2"} <= sections, f"{name}: no numbered sections found"


def test_no_machine_paths():
    bad = [
        f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for name, text in tracked_text_files()
        for pattern in MACHINE_PATHS
        for m in pattern.finditer(text)
    ]
    assert not bad, "paths of one machine in tracked files:\n" + "\n".join(bad)


def test_docs_mentions_exist():
    """Every `docs/<path>.md` a file names is in the repo. The reference notes also name other projects'
    `docs/` files; in them only this repo's own notes are checked."""
    bad = []
    for name, text in tracked_text_files():
        ours = r"docs/(?:reference/[\w.-]+|design)\.md" if name.startswith("docs/reference/") else r"docs/[\w./-]+?\.md"
        for m in re.finditer(r"(?<![\w:/.-])" + ours + r"\b", text):
            if not (ROOT / m.group(0)).is_file():
                bad.append(f"{name}: {m.group(0)}")
    assert not bad, "cited docs that do not exist:\n" + "\n".join(bad)


def test_reference_notes_cited_by_repo_path():
    """`vllm-interface.md` alone (or a retired note's name) is a citation nobody can follow."""
    notes = {f"{stem}.md" for stem in reference_notes()} | RETIRED_NOTES
    pattern = re.compile(r"(?<![\w/.-])(" + "|".join(re.escape(n) for n in sorted(notes)) + r")\b")
    bad = []
    for name, text in tracked_text_files():
        if name == SELF:
            continue
        for m in pattern.finditer(text):
            bad.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    assert not bad, "bare reference-note names (write docs/reference/<note>.md):\n" + "\n".join(bad)


def test_cited_sections_exist():
    notes = reference_notes()
    bad = []
    for name, text in tracked_text_files():
        for note, section, line in cited_sections(text, list(notes)):
            if section not in notes[note]:
                bad.append(f"{name}:{line}: {note} §{section}")
    assert not bad, "citations of sections that do not exist:\n" + "\n".join(bad)


def test_section_citation_parser():
    """The parser finds full, short and follow-up forms, and nothing else."""
    text = ("see docs/reference/vllm-interface.md §4.2 step 1\n"
            "(peer-routers §1.1 and §2.1), vllm-cpu.md §3: x; §9 alone is not a citation")
    found = list(cited_sections(text, ["vllm-interface", "peer-routers", "vllm-cpu"]))
    assert found == [("vllm-interface", "4.2", 1), ("peer-routers", "1.1", 2), ("peer-routers", "2.1", 2),
                     ("vllm-cpu", "3", 2)]
    assert reference_sections(REFERENCE_DIR / "peer-routers.md") >= {"0", "6.5", "6.6", "8.4", "11"}


# --- dependency arrows -------------------------------------------------------------------------------------
COMPONENTS = ("gateway", "engine_adapters", "policies", "simulator", "bench")
FORBIDDEN_ANYWHERE = {
    "engine_adapters": {"gateway", "simulator", "bench"},
    "policies": {"gateway", "simulator", "engine_adapters", "bench"},
    "gateway": {"bench"},
}
FORBIDDEN_AT_TOP_LEVEL = {"gateway": {"simulator"}}


def imported_components(tree: ast.Module):
    """(component, line, at module top level) for every absolute import of a project component. Top level
    means executed on import: the module body, including its `if`/`try` blocks, but not function bodies."""

    def visit(node: ast.AST, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name.split(".")[0], child.lineno, top
            elif isinstance(child, ast.ImportFrom):
                if child.level == 0 and child.module:
                    yield child.module.split(".")[0], child.lineno, top
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from visit(child, False)
            else:
                yield from visit(child, top)

    for name, line, top in visit(tree, True):
        if name in COMPONENTS:
            yield name, line, top


def arrow_violations(source: str, component: str) -> list[str]:
    out = []
    for target, line, top in imported_components(ast.parse(source)):
        if target in FORBIDDEN_ANYWHERE.get(component, ()):
            out.append(f"{line}: {component} -> {target}")
        elif top and target in FORBIDDEN_AT_TOP_LEVEL.get(component, ()):
            out.append(f"{line}: {component} -> {target} at module top level (import it inside the function)")
    return out


def test_dependency_arrows():
    bad = []
    for name, text in tracked_text_files():
        component = name.split("/")[0]
        if name.endswith(".py") and component in FORBIDDEN_ANYWHERE:
            bad += [f"{name}:{v}" for v in arrow_violations(text, component)]
    assert not bad, "imports against the dependency arrows:\n" + "\n".join(bad)


def test_arrow_checker_sees_what_it_must():
    src = ("import policies.base\nfrom simulator.fleet import SimFleet\nif True:\n    import bench.harness\n"
           "def f():\n    from simulator.cluster import run\n    import gateway.app\n")
    assert arrow_violations(src, "gateway") == [
        "2: gateway -> simulator at module top level (import it inside the function)", "4: gateway -> bench"]
    assert arrow_violations(src, "engine_adapters") == [
        "2: engine_adapters -> simulator", "4: engine_adapters -> bench", "6: engine_adapters -> simulator",
        "7: engine_adapters -> gateway"]
    assert arrow_violations(src, "policies") == [
        "2: policies -> simulator", "4: policies -> bench", "6: policies -> simulator", "7: policies -> gateway"]
    assert arrow_violations("from engine_adapters.types import EngineMetrics\n", "policies") == [
        "1: policies -> engine_adapters"]


# --- import cycles inside gateway/ ---------------------------------------------------------------------------
# Every pair of gateway modules imports one way: the leg runner and the P/D legs take the request context
# (gateway/request/context.py) and typed collaborators, not the dispatcher; the turns driver takes the narrow `TurnHost`
# view of the swap controller that owns it.
CYCLE_EXEMPT: set[frozenset[str]] = set()


def module_imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules among `sources` it imports anywhere: at top level, under TYPE_CHECKING (a type is
    a dependency too) or inside a function. `from pkg import mod` counts as importing pkg.mod."""
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for mod, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[mod].update(n for n in names if n in sources and n != mod)
    return graph


def import_cycles(graph: dict[str, set[str]], exempt: set[frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), after dropping the exempt pairs'
    edges between each other."""
    edges = {m: {n for n in out if frozenset({m, n}) not in exempt} for m, out in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def gateway_sources() -> dict[str, str]:
    out = {}
    for name, text in tracked_text_files():
        if name.startswith("gateway/") and name.endswith(".py"):
            mod = name[:-3].replace("/", ".")
            out[mod.removesuffix(".__init__")] = text
    return out


def test_no_import_cycles_inside_gateway():
    sources = gateway_sources()
    assert "gateway.core" in sources and "gateway.app" in sources
    cycles = import_cycles(module_imports(sources), CYCLE_EXEMPT)
    assert not cycles, "gateway modules that import each other (directly or round a loop):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_cycle_finder_sees_what_it_must():
    src = {
        "g.app": "from g import router\nfrom g.core import Gateway\n",
        "g.router": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from g.app import Gateway\n",
        "g.core": "def f():\n    import g.leaf\n",
        "g.leaf": "",
        "g.a": "from g.b import x\n",
        "g.b": "from g.a import y\n",
    }
    graph = module_imports(src)
    assert graph["g.app"] == {"g.router", "g.core"} and graph["g.core"] == {"g.leaf"}
    assert import_cycles(graph, set()) == [["g.a", "g.b"], ["g.app", "g.router"]]
    assert import_cycles(graph, {frozenset({"g.a", "g.b"})}) == [["g.app", "g.router"]]


# --- no text cites an issue number -----------------------------------------------------------------------------
# A reader of the repository cannot look an issue number up: a comment, docstring or message says the reason.
ISSUE_CITATION = re.compile(r"\b[Ii]ss" + r"ue ?#?\d+")   # built from pieces so this file does not match itself


def issue_citations(text: str) -> list[int]:
    return [text.count("\n", 0, m.start()) + 1 for m in ISSUE_CITATION.finditer(text)]


def test_no_python_file_cites_an_issue_number():
    bad = [f"{name}:{line}" for name, text in tracked_text_files() if name.endswith(".py")
           for line in issue_citations(text)]
    assert not bad, "say the reason instead of the issue number:\n" + "\n".join(bad)


def test_issue_citation_finder():
    cited = "x = 1  # see " + "iss" + "ue 18 item 2\n" + '"""(' + "Iss" + 'ue #7)"""\n'
    assert issue_citations(cited) == [1, 2]
    assert issue_citations("# the issues/1177 page of an upstream tracker; tissue 3\n") == []
