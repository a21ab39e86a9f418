#!/usr/bin/env python3
"""Move gateway/ from flat modules into subpackages by responsibility, and rewrite every reference to them.

Run from the repository root, on a clean tree, after the branches that touch gateway/ are merged:

    python scripts/relayout.py --dry-run     # print the plan: moves, splits, unknown modules and definitions
    python scripts/relayout.py               # do it (git mv, split, rewrite references, ruff --fix on imports)

It is idempotent: a second run finds nothing to move or split and rewrites nothing. A module at gateway/'s top
level (or in gateway/state/) that the mapping below does not know stops the run before anything changes (exit
2): add it to `MOVES` (or to `TOP_LEVEL` to keep it where it is), or pass `--leave-unknown`.

What it does, in order:
1. `git mv` each module of `MOVES` to its place (creating the subpackage and its `__init__.py`).
2. Splits the modules of `SPLITS` by top-level definition (AST): each definition goes to the module its name is
   mapped to, with the comments above it; a definition the mapping does not know goes to the split's default
   module and is reported. Each part gets the imports it uses (the original's, pruned) and imports from the
   other parts; a split whose parts would import each other in a loop stops the run. `gateway.config` stays
   importable as before: its package `__init__` re-exports every name.
3. Rewrites references in every tracked text file: `from gateway.X import a` (per name, when X was split),
   `from gateway import X`, `import gateway.X`, string constants `"gateway.X..."` in Python, dotted names in
   other text files, and paths `gateway/X.py` everywhere (docs, comments, tests, Dockerfile, Makefile,
   pyproject). Attribute access such as `gw.config` or `self.gateway.registry` is never touched: in Python only
   import statements and string constants are rewritten.
4. Writes tests/test_layout.py (the layer order, at most `MAX_TOP_LEVEL` modules at the top, no module over
   `MAX_LINES` lines) and the "Where things live" table of docs/design.md, then runs `ruff check --fix` for
   import order and unused imports on the files it changed.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "gateway"
MAX_TOP_LEVEL = 10
MAX_LINES = 800

# --- the layout --------------------------------------------------------------------------------------------
# Layers, lowest first. A subpackage (or top-level module) imports only from its own layer and the ones below.
LAYERS = ["wire", "config", "state", "ops", "fleet", "request", "tenancy", "pipeline", "batch", "control",
          "core", "api", "app", "server", "demo", "cli"]

# Upward imports allowed only as type-only imports (under `if TYPE_CHECKING:`): the lower module is handed an
# object built above it and names its type for annotations; it never imports it at run time.
TYPE_ONLY_UP = {
    ("pipeline", "control"): "the dispatcher is handed the swap controller (a model's wake time)",
    ("ops", "fleet"): "the status history samples the registry it is handed",
}

PACKAGES = {
    "wire": "Bytes on the wire: the OpenAI error shape, the HTTP client to workers, headers, SSE resumption, "
            "prompt tokens, what one relay produced.",
    "config": "The gateway's configuration: one module per section, the loader and its checks, the generated "
              "reference. Imports no runtime module.",
    "state": "Cluster state shared by the gateway's parts: one interface, an in-memory and a Redis backend, the "
             "batch job store, the rate-limit buckets the store enforces, and what a loop does while it is down.",
    "ops": "What operators see: Prometheus metrics, logs, the access log, tracing, the status history.",
    "fleet": "The fleet as the gateway sees it: the worker registry, DNS discovery, KV-cache events, LoRA "
             "adapters on workers.",
    "request": "One request as the pipeline carries it: the parsed body, its context, the hook protocol, the "
               "admission queue.",
    "tenancy": "Who is asking: API keys and tenants, rate-limit tickets, service order between tenants.",
    "pipeline": "The request pipeline: dispatch, legs (plain and P/D), relay, moves, learning, SLO accounting, "
                "the hooks that observe each request.",
    "batch": "The batch API's work: the runner that feeds queued requests through the pipeline, progress logs.",
    "control": "Control loops that steer the fleet: autoscaling and its actuators, model pooling and turns, "
               "re-planning.",
    "api": "The HTTP routers beside the OpenAI routes: admin, batch and files, passthrough, the status page.",
}

# Modules that stay at gateway/'s top level (the assembly and entry points).
TOP_LEVEL = {"__init__", "cli", "core", "app", "server", "demo"}

# old module (dotted, under gateway.) -> new module. A module split by SPLITS maps here to its default part.
MOVES: dict[str, str] = {
    # wire
    "errors": "wire.errors", "forwarding": "wire.forwarding", "upstream": "wire.upstream",
    "resume": "wire.resume", "validation": "wire.validation", "prompt_tokens": "wire.prompt_tokens",
    "client_limits": "wire.client_limits",
    # config
    "config": "config", "keys": "config.keys", "priors": "config.priors", "config_reference": "config.reference",
    "responses_config": "config.responses", "engine_identity": "config.engine_identity",
    # state
    "outage": "state.outage", "ratelimit": "state.ratelimit",
    # ops
    "metrics": "ops.metrics", "logs": "ops.logs", "observe": "ops.observe", "tracing": "ops.tracing",
    "access_log": "ops.access_log", "status_history": "ops.status_history", "fd_limit": "ops.fd_limit",
    # fleet
    "registry": "fleet.registry", "dns_discovery": "fleet.discovery", "kv_events": "fleet.kv_events",
    "adapters": "fleet.adapters",
    # request
    "request": "request.parse", "context": "request.context", "hooks": "request.hooks",
    "admission": "request.admission",
    # tenancy
    "auth": "tenancy.auth", "tickets": "tenancy.tickets", "services": "tenancy.services",
    # pipeline
    "dispatch": "pipeline.dispatch", "legs": "pipeline.legs", "pd_legs": "pipeline.pd_legs",
    "relay": "pipeline.relay", "rebalancer": "pipeline.rebalancer", "observer": "pipeline.observer",
    "request_metrics": "pipeline.request_metrics", "learning": "pipeline.learning", "slo": "pipeline.slo",
    "attempts": "pipeline.attempts", "drain": "pipeline.drain",
    # batch
    "batch_runner": "batch.runner", "batch_progress": "batch.progress",
    # control
    "autoscaler": "control.autoscaler", "actuators": "control.actuators",
    "actuator_kinds": "control.actuator_kinds", "docker_actuator": "control.docker_actuator",
    "pooling": "control.pooling", "turns": "control.turns", "replanner": "control.replanner",
    # api
    "admin": "api.admin", "batch_api": "api.batch", "passthrough": "api.passthrough",
    "status_page": "api.status_page", "uploads": "api.uploads",
    "responses_api": "api.responses", "messages_api": "api.messages", "translated": "api.translated",
}


@dataclass
class Split:
    """Split one module by top-level definition name. `parts`: name -> new module (dotted, under gateway.);
    the rest goes to `default`. `docs`: a docstring for each new module (the default part keeps the
    original's unless `doc_to` names the part that takes it, then `docs[default]` is the default's).
    `reexport`: the split module becomes a package whose `__init__` re-exports every name (importers keep
    `from gateway.<module> import X`); otherwise importers are rewritten name by name."""

    default: str
    parts: dict[str, str]
    docs: dict[str, str]
    reexport: bool = False
    doc_to: str | None = None
    stays: set[str] = field(default_factory=set)   # names known to stay in the default part (not reported)


def _names(modname: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, modname)


SPLITS: dict[str, Split] = {
    "config": Split(
        default="config.sections", reexport=True,
        parts={
            **_names("config.base", "WORKER_ID_RE", "check_worker_id", "MiB", "_Strict", "_deprecated_key",
                     "_all_positive", "ConfigError"),
            **_names("config.workers", "KvEventsSource", "WorkerConfig", "WorkerDiscoveryConfig",
                     "parse_nameserver", "check_worker_url", "UpstreamTlsConfig", "UpstreamConfig",
                     "TimeoutsConfig", "HealthConfig"),
            **_names("config.models", "SloConfig", "SloClassName", "AdapterConfig", "RebalanceConfig",
                     "ModelConfig", "LearningConfig", "ResumeConfig", "PdConfig", "KvEventsConfig"),
            **_names("config.tenancy", "LimitsConfig", "ServiceSource", "ServicePriorityConfig", "ApiKeyConfig",
                     "AuthConfig"),
            **_names("config.pooling", "SharedSleepLevel", "SharedEngineConfig", "SharedHostConfig"),
            **_names("config.ops", "ListenConfig", "LoggingConfig", "TracingConfig", "AdminConfig",
                     "MetricsConfig", "StatusConfig", "ServerConfig", "BatchConfig"),
            **_names("config.autoscale", "SimActuatorConfig", "WebhookActuatorConfig", "DockerActuatorConfig",
                     "ActuatorConfig", "AutoscaleConfig", "ReplanConfig", "DeploymentGroupConfig",
                     "DeploymentServiceConfig", "DeploymentConfig"),
            **_names("config.gateway", "_FILE_DATA", "_FileSource", "_AliasSource", "GatewayConfig"),
            **_names("config.load", "read_yaml", "load_config", "_policy_refs", "unknown_policy_problems",
                     "semantic_problems", "configured_models", "alias_problems", "discovery_problems",
                     "replan_problems", "deployment_problems", "unmodelled_workers", "key_problems",
                     "engine_problems"),
            **_names("config.load", "describe_validation_error", "format_loc", "_short", "_known_fields",
                     "_model_type", "_DictOf", "summarize", "check_config_cli"),
        },
        docs={
            "config.base": "What every config section shares: the strict base model, worker ids, the config "
                           "error, small validators.",
            "config.workers": "Config of the workers and the connection to them: static workers, DNS "
                              "discovery, upstream client, TLS, timeouts, health checks.",
            "config.models": "Config per model: SLO classes, adapters, rebalancing, learning, resumption, "
                             "P/D, KV-cache events.",
            "config.tenancy": "Config of who may ask: API keys, auth, per-key limits, service order between "
                              "tenants.",
            "config.pooling": "Config of shared hosts: several engines of different models on one GPU host.",
            "config.ops": "Config of the gateway's own server and what operators see: listen, server, logs, "
                          "tracing, metrics, admin, status page, batch.",
            "config.autoscale": "Config of the control loops: autoscaling and its actuators, re-planning, "
                                "deployments.",
            "config.gateway": "The whole configuration (`GatewayConfig`) and where its values come from: the "
                              "YAML file, FLEETGATE_* environment variables, aliases.",
            "config.load": "Loading a config file, the checks across sections a schema cannot express "
                           "(policies, aliases, discovery, re-planning, deployments, keys), and `fleetgate "
                           "check-config`: a validation error in words, a summary of the config.",
            "config.sections": "Config sections not yet placed in a module of their own (scripts/relayout.py "
                               "put them here).",
        },
    ),
    "state.jobs": Split(
        default="state.jobs",
        stays={"QueuedRequest", "StoreUnavailableError", "new_id", "request_id_for", "BatchStats", "QueueSnapshot",
               "expired_line", "FILE_CHUNK", "CLAIM_SCAN", "Upload", "expired", "JobStore"},
        parts={
            **_names("state.jobs_memory", "_DiskUpload", "_MemJobs", "MemoryJobs"),
            **_names("state.jobs_redis", "_NOW_MS", "_CLAIM", "_RENEW", "_REQUEUE", "_REAP", "_FINISH",
                     "_DROP", "_LEASE", "_UNLEASE", "_ENQUEUE_CHUNK", "UNREACHABLE", "_UPLOAD_TTL_MS",
                     "_guard", "_RedisUpload", "RedisJobs"),
        },
        docs={
            "state.jobs_memory": "Batch work kept in this process (`MemoryJobs`, mixed into MemoryStore): "
                                 "uploads in a private temporary directory, the queue and batches in dicts. "
                                 "The interface is gateway/state/jobs.py's `JobStore`.",
            "state.jobs_redis": "Batch work in Redis (`RedisJobs`, mixed into RedisStore): the Lua scripts "
                                "that claim, renew, requeue, reap and finish queued requests atomically, and "
                                "streamed uploads. The interface and the key layout are in "
                                "gateway/state/jobs.py.",
        },
    ),
    "state.redis_store": Split(
        default="state.redis_store", doc_to="state.redis_scripts",
        stays={"REMIND_S", "RedisUnavailableError", "_redact", "_record_from", "_metrics_from", "RedisStore",
               "_or_none", "_glob_escape"},
        parts=_names("state.redis_scripts", "_DOWN_ERRORS", "_NOW_MS", "_TAKE_SLOT", "_RESERVE", "_LEASE",
                     "_RETURN", "_SETTLE", "_KEYED_RESERVE", "_RELEASE", "_HEARTBEAT", "_REFRESH", "_GET_DOCS"),
        docs={
            "state.redis_store": "`RedisStore`: the state store in Redis, shared by many gateway replicas. The "
                                 "key layout, the admission scripts, leases and failing open are described in "
                                 "gateway/state/redis_scripts.py, beside the scripts.",
        },
    ),
    "relay": Split(
        default="pipeline.relay",
        stays={"_BODY_END", "make_upstream_pool", "Relay", "_end", "LegSend"},
        parts=_names("wire.results", "STATUS_429", "TOO_LONG", "UpstreamFailure", "RelayResult", "ResponseState"),
        docs={
            "wire.results": "What one relay to a worker produced: the result of an answer relayed "
                            "(`RelayResult`), where the client's response is (`ResponseState`), and a worker's "
                            "failure before the client saw a byte (`UpstreamFailure` and its kinds). Plain data, "
                            "read by the pipeline, learning, SLO accounting, the access log and tracing.",
        },
    ),
    "dispatch": Split(
        default="pipeline.dispatch",
        stays={"STATUS_BROKEN_STREAM", "MOVED", "TOKENIZE_TIMEOUT_S", "RETRY", "MOVE", "FALL_BACK", "PLACE_AGAIN",
               "SERVED_MODEL", "NoRoom", "Dispatcher", "_admission_fallback_reason",
               "_failure_fallback_reason", "_none", "_join_legs"},
        parts={**_names("ops.metrics", "STATUS_CLIENT_GONE"),
               **_names("pipeline.client", "ClientGone", "_watch_disconnect", "_send_error")},
        docs={"pipeline.client": "The client's side of one request on its ASGI connection: a disconnect "
                                 "watched (it cancels the request's task), an error sent before the response "
                                 "started, the exception for a client gone before its body was complete."},
    ),
}



@dataclass
class Mixin:
    """Methods of a class that move into a mixin class of their own module, which the class then inherits
    (listed before its last base, so the mixin's methods satisfy an abstract interface that base declares).
    Module-level helpers only those methods use move with them."""

    module: str
    name: str
    doc: str
    methods: list[str]


# module (new name, under gateway.) -> class -> the mixin cut out of it
CLASS_SPLITS: dict[str, dict[str, Mixin]] = {
    "state.redis_store": {"RedisStore": Mixin(
        module="state.redis_records", name="RedisRecords",
        doc="The records RedisStore keeps for the gateway's parts: the worker registry, the scraped engine "
            "metrics and shared documents (fitted models, predictor state, admin-made API keys). Each is cached "
            "here too, so reads serve the last known state while Redis is down; a write made meanwhile is "
            "replayed when it is back. Mixed into RedisStore (gateway/state/redis_store.py), whose connection "
            "and outage handling these methods use.",
        methods=["upsert_worker", "remove_worker", "list_workers", "put_metrics", "get_metrics", "put_doc",
                 "get_doc", "get_docs", "delete_doc"])},
}

MARK_BEGIN = "<!-- where-things-live: written by scripts/relayout.py -->"
MARK_END = "<!-- /where-things-live -->"


# --- small helpers ---------------------------------------------------------------------------------------
def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, check=check, capture_output=True, text=True)


def mod_path(mod: str) -> Path:
    """gateway.<mod> as a file path (a package's `__init__.py` when that directory exists)."""
    p = ROOT / PKG / Path(*mod.split("."))
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def docstring(doc: str) -> str:
    """A module docstring: one of ours (a single long line) wrapped to the line length, an original as it was."""
    if "\n" not in doc and len(doc) > 104:
        doc = textwrap.fill(doc, 107) + "\n"
    return '"""' + doc.replace('"""', r'\"\"\"') + '"""\n'


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def unit_of(mod: str) -> str:
    """The layer unit of a module under gateway.: its subpackage, or itself at the top level."""
    return mod.split(".")[0]


def current_modules() -> list[str]:
    """Dotted names (under gateway.) of the modules at gateway/'s top level and in gateway/state/."""
    out = []
    for p in sorted((ROOT / PKG).glob("*.py")):
        out.append(p.stem)
    for p in sorted((ROOT / PKG / "state").glob("*.py")):
        out.append("state." + p.stem if p.stem != "__init__" else "state")
    return out


def known(mod: str) -> bool:
    # state/ is a subpackage already: its modules stay unless SPLITS splits them
    return mod in TOP_LEVEL or mod in MOVES or mod in SPLITS or mod == "state" or mod.startswith("state.")


# --- step 1: moves ---------------------------------------------------------------------------------------
_ANNOUNCED: set[str] = set()


def ensure_package(pkg: str, dry: bool) -> None:
    d = ROOT / PKG / Path(*pkg.split("."))
    init = d / "__init__.py"
    if init.exists() or pkg in _ANNOUNCED:
        return
    _ANNOUNCED.add(pkg)
    print(f"  new package gateway/{pkg.replace('.', '/')}/")
    if dry:
        return
    d.mkdir(parents=True, exist_ok=True)
    doc = PACKAGES.get(pkg, f"gateway.{pkg}.")
    init.write_text(docstring(doc))
    run("git", "add", rel(init))


def do_moves(dry: bool) -> list[str]:
    moved = []
    for old, new in MOVES.items():
        if old in SPLITS:
            continue   # the split step moves it
        src = ROOT / PKG / (old.replace(".", "/") + ".py")
        dst = ROOT / PKG / (new.replace(".", "/") + ".py")
        if not src.exists() or src == dst:
            continue
        if dst.exists():
            sys.exit(f"relayout: both {rel(src)} and {rel(dst)} exist; merge them by hand first")
        print(f"  git mv {rel(src)} {rel(dst)}")
        moved.append(old)
        if not dry:
            ensure_package(new.rsplit(".", 1)[0], dry)
            run("git", "mv", rel(src), rel(dst))
        else:
            ensure_package(new.rsplit(".", 1)[0], dry)
    return moved


# --- step 2: splits --------------------------------------------------------------------------------------
HEADER_TYPES = (ast.Import, ast.ImportFrom)


def is_type_checking_block(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") \
        and all(isinstance(n, HEADER_TYPES) for n in node.body) and not node.orelse


def defined_names(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def used_names(nodes: list[ast.stmt]) -> set[str]:
    """Names a piece of code reads: Name nodes, the roots of attribute chains, and identifiers inside string
    annotations."""
    out: set[str] = set()
    for top in nodes:
        for n in ast.walk(top):
            if isinstance(n, ast.Name):
                out.add(n.id)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"[\w\[\], .|]+",
                                                                                           n.value):
                out.update(re.findall(r"[A-Za-z_]\w*", n.value))
    return out


def bound_name(alias: ast.alias, is_import: bool) -> str:
    if alias.asname:
        return alias.asname
    return alias.name.split(".")[0] if is_import else alias.name


def filtered_import(node: ast.Import | ast.ImportFrom, used: set[str]) -> ast.stmt | None:
    keep = [a for a in node.names if bound_name(a, isinstance(node, ast.Import)) in used]
    if not keep:
        return None
    if isinstance(node, ast.Import):
        return ast.Import(names=keep)
    return ast.ImportFrom(module=node.module, names=keep, level=node.level)


@dataclass
class Chunk:
    names: list[str]
    node: ast.stmt
    text: str      # the statement with the comments and blank lines above it, as in the original
    index: int     # its place among the original's statements


def chunks_of(src: str, tree: ast.Module) -> tuple[str | None, list[ast.stmt], list[Chunk], str]:
    """(docstring, header statements (imports, a TYPE_CHECKING block), the other top-level statements with the
    comments above them, the header's original text)."""
    lines = src.splitlines(keepends=True)
    body = list(tree.body)
    doc = None
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        doc = body[0].value.value
        prev_end = body[0].end_lineno
        body = body[1:]
    else:
        prev_end = 0
    header: list[ast.stmt] = []
    chunks: list[Chunk] = []
    doc_end = prev_end
    header_end = prev_end
    for i, node in enumerate(body):
        if not chunks and (isinstance(node, HEADER_TYPES) or is_type_checking_block(node)):
            header.append(node)
            prev_end = header_end = node.end_lineno
            continue
        # the comments and blank lines above a statement go with it (a section banner too)
        text = "".join(lines[prev_end:node.end_lineno])
        chunks.append(Chunk(defined_names(node), node, text, i))
        prev_end = node.end_lineno
    return doc, header, chunks, "".join(lines[doc_end:header_end])


def plan_split(old: str, spec: Split, src: str) -> tuple[dict[str, list[Chunk]], list[str], list[str]]:
    """part -> its chunks; names the mapping does not know (sent to the default); mapped names not found."""
    tree = ast.parse(src)
    _, _, chunks, _ = chunks_of(src, tree)
    parts: dict[str, list[Chunk]] = {}
    unknown: list[str] = []
    seen: set[str] = set()
    last = spec.default
    for c in chunks:
        if c.names:
            targets = {spec.parts.get(n, spec.default) for n in c.names}
            for n in c.names:
                seen.add(n)
                if n not in spec.parts and n not in spec.stays and n not in ("__all__", "log", "logger"):
                    unknown.append(n)
            part = sorted(targets)[0] if len(targets) == 1 else spec.default
        else:
            part = last   # a loop or call after a definition stays with it
        parts.setdefault(part, []).append(c)
        last = part
    missing = sorted(set(spec.parts) - seen)
    return parts, unknown, missing


def part_deps(parts: dict[str, list[Chunk]]) -> dict[str, dict[str, set[str]]]:
    """part -> {other part: names it uses from it}."""
    where = {n: p for p, cs in parts.items() for c in cs for n in c.names}
    out: dict[str, dict[str, set[str]]] = {}
    for p, cs in parts.items():
        used = used_names([c.node for c in cs])
        deps: dict[str, set[str]] = {}
        for n in used:
            q = where.get(n)
            if q is not None and q != p:
                deps.setdefault(q, set()).add(n)
        out[p] = deps
    return out


def find_cycle(deps: dict[str, dict[str, set[str]]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(deps.get(v, {})):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (c := visit(w)) is not None:
                return c
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(deps):
        if v not in state and (c := visit(v)) is not None:
            return c
    return None


def join_chunks(chunks: list[Chunk]) -> str:
    """The chunks' text: neighbours in the original keep the spacing they had, others two blank lines."""
    out = []
    for k, c in enumerate(chunks):
        if k == 0:
            out.append(c.text.lstrip("\n"))
        elif c.index == chunks[k - 1].index + 1:
            out.append(c.text)
        else:
            out.append("\n\n" + c.text.lstrip("\n"))
    return "".join(out).rstrip("\n") + "\n"


def render_part(doc: str | None, header: list[ast.stmt], chunks: list[Chunk], imports: dict[str, set[str]]) -> str:
    used = used_names([c.node for c in chunks])
    lines: list[str] = []
    if doc:
        lines.append(docstring(doc) + "\n")
    head: list[str] = []
    tc: list[str] = []
    for node in header:
        if is_type_checking_block(node):
            for sub in node.body:
                f = filtered_import(sub, used)
                if f is not None:
                    tc.append("    " + ast.unparse(f) + "\n")
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            head.append(ast.unparse(node) + "\n")
            continue
        f = filtered_import(node, used | ({"TYPE_CHECKING"} if tc else set()))
        if f is not None:
            head.append(ast.unparse(f) + "\n")
    for mod, names in sorted(imports.items()):
        head.append(f"from {PKG}.{mod} import {', '.join(sorted(names))}\n")
    if tc and not any("TYPE_CHECKING" in h for h in head):
        head.append("from typing import TYPE_CHECKING\n")
    lines += head
    if tc:
        lines.append("\nif TYPE_CHECKING:\n" + "".join(tc))
    return "".join(lines) + "\n\n" + join_chunks(chunks)


def do_split(old: str, spec: Split, dry: bool) -> list[str]:
    """Split gateway/<old>.py; return what to report. Nothing to do when the file is gone (split already) or,
    for a split in place, when it defines none of the names mapped elsewhere."""
    src_path = ROOT / PKG / (old.replace(".", "/") + ".py")
    if not src_path.is_file():
        return []
    src = src_path.read_text()
    tree = ast.parse(src)
    doc, header, _, header_text = chunks_of(src, tree)
    parts, unknown, missing = plan_split(old, spec, src)
    if set(parts) == {spec.default} and not spec.reexport and spec.default == old:
        return []
    notes = [f"{old}: {n} is not in SPLITS[{old!r}]; it goes to {spec.default}" for n in unknown]
    notes += [f"{old}: {n} (mapped) is not defined there any more" for n in missing]
    deps = part_deps(parts)
    cycle = find_cycle(deps)
    if cycle:
        sys.exit(f"relayout: the parts of {old} would import each other: {' -> '.join(cycle)}; "
                 f"map the names involved to one part in SPLITS")
    print(f"  split {rel(src_path)} -> " + ", ".join(f"{p} ({len(cs)} statements)" for p, cs in parts.items()))
    if dry:
        return notes
    # git mv keeps the history with the default part (or the package __init__ when re-exporting)
    if spec.reexport:
        pkg_dir = ROOT / PKG / Path(*old.split("."))
        pkg_dir.mkdir(exist_ok=True)
        init = pkg_dir / "__init__.py"
        if init.exists():
            run("git", "rm", "-q", "-f", rel(init))
        run("git", "mv", rel(src_path), rel(init))
    else:
        dst = ROOT / PKG / (spec.default.replace(".", "/") + ".py")
        if dst != src_path:
            ensure_package(spec.default.rsplit(".", 1)[0], dry)
            run("git", "mv", rel(src_path), rel(dst))
    for p, cs in parts.items():
        path = ROOT / PKG / (p.replace(".", "/") + ".py")
        imports = deps.get(p, {})
        if p == spec.default and not spec.reexport:
            path.write_text(render_default(doc if not spec.doc_to else spec.docs[p], header_text, cs, imports))
        elif path.exists():
            append_to_module(path, header, cs, imports)   # moved down into a module of a lower layer
        else:
            ensure_package(p.rsplit(".", 1)[0], dry)
            path.write_text(render_part(doc if p == spec.doc_to else spec.docs.get(p), header, cs, imports))
        run("git", "add", rel(path))
    if spec.reexport:
        write_reexport(old, doc, parts)
    return notes


def render_default(doc: str | None, header_text: str, chunks: list[Chunk], imports: dict[str, set[str]]) -> str:
    """The default part: the original's header as it was (ruff drops what it no longer uses) and its
    statements with their spacing, plus imports from the other parts."""
    out = docstring(doc) if doc else ""
    head = header_text.rstrip("\n") + "\n"
    more = "".join(f"from {PKG}.{mod} import {', '.join(sorted(names))}\n" for mod, names in sorted(imports.items()))
    tc = head.find("\nif TYPE_CHECKING:")
    head = head[:tc + 1] + more + head[tc + 1:] if tc >= 0 else head + more
    return out + head + "\n\n" + join_chunks(chunks)


def append_to_module(path: Path, header: list[ast.stmt], chunks: list[Chunk], imports: dict[str, set[str]]) -> None:
    """Move definitions to the end of an existing module (a constant or type moved down a layer)."""
    text = path.read_text().rstrip("\n") + "\n"
    need = render_part(None, header, chunks, imports)
    head, _, body = need.partition("\n\n\n")
    tree = ast.parse(text)
    last_import = max((n.end_lineno for n in tree.body if isinstance(n, HEADER_TYPES)), default=0)
    lines = text.splitlines(keepends=True)
    extra = [h + "\n" for h in head.splitlines() if h and "__future__" not in h and h + "\n" not in lines]
    lines[last_import:last_import] = extra
    path.write_text("".join(lines) + "\n\n" + body.strip("\n") + "\n")


def write_reexport(old: str, doc: str | None, parts: dict[str, list[Chunk]]) -> None:
    init = ROOT / PKG / Path(*old.split(".")) / "__init__.py"
    lines = [docstring(doc or "") + "\n"]
    everything: list[str] = []
    for p in sorted(parts):
        names = sorted({n for c in parts[p] for n in c.names if n not in ("__all__",)})
        everything += names
        lines.append(f"from {PKG}.{p} import {', '.join(names)}\n")
    lines.append("\n__all__ = [" + ", ".join(repr(n) for n in sorted(everything)) + "]\n")
    init.write_text("".join(lines))
    run("git", "add", rel(init))


def do_class_split(mod: str, cls_name: str, mx: Mixin, dry: bool) -> list[str]:
    path = mod_path(mod)
    if not path.is_file():
        return [f"{mod}: not found, {cls_name} not split"]
    src = path.read_text()
    tree = ast.parse(src)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
    if cls is None or any(ast.unparse(b) == mx.name for b in cls.bases):
        return []
    lines = src.splitlines(keepends=True)
    members = [m for m in cls.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef) and m.name in mx.methods]
    notes = [f"{mod}.{cls_name}: method {n} not found" for n in mx.methods if n not in {m.name for m in members}]
    if not members:
        return notes
    spans = []
    for m in members:
        i = cls.body.index(m)
        start = cls.body[i - 1].end_lineno if i > 0 else cls.lineno
        spans.append((start, m.end_lineno, "".join(lines[start:m.end_lineno]).lstrip("\n")))
    # module-level helpers the moved methods use and the rest of the module does not
    moved_nodes = members
    rest_lines = [ln for k, ln in enumerate(lines, 1) if not any(a < k <= b for a, b, _ in spans)]
    rest_tree = ast.parse("".join(rest_lines))
    doc, header, chunks, _ = chunks_of(src, tree)
    used_by_moved = used_names(list(moved_nodes))
    helpers = [c for c in chunks if c.names and set(c.names) <= used_by_moved and c.node is not cls]
    used_by_rest = used_names([n for n in rest_tree.body if not any(
        isinstance(n, type(h.node)) and getattr(n, "name", None) in h.names for h in helpers)])
    print(f"  mixin {mx.name} ({len(members)} methods, {len(helpers)} helpers) out of {cls_name} -> {mx.module}")
    if dry:
        return notes
    # the new module
    header_used = used_by_moved | used_names([h.node for h in helpers])
    body = f"class {mx.name}:\n" + "".join(t for _, _, t in spans)
    fake = Chunk([mx.name], ast.parse(body).body[0], body, 10**6)
    new_src = render_part(mx.doc, header, helpers + [fake], {})
    del header_used
    out = ROOT / PKG / (mx.module.replace(".", "/") + ".py")
    out.write_text(new_src)
    # the old module: methods and moved helpers out, the mixin in the bases, imports back what it still uses
    drop = set()
    for a, b, _ in spans:
        drop.update(range(a + 1, b + 1))
    for h in helpers:
        n0 = h.node
        start = min([n0.lineno] + [d.lineno for d in getattr(n0, "decorator_list", [])])
        drop.update(range(start, n0.end_lineno + 1))
    last_base = cls.bases[-1]
    bl = lines[last_base.lineno - 1]
    col = len(bl.encode()[:last_base.col_offset].decode())
    lines[last_base.lineno - 1] = bl[:col] + mx.name + ", " + bl[col:]
    kept = [ln for k, ln in enumerate(lines, 1) if k not in drop]
    back = sorted({n for h in helpers for n in h.names} & used_by_rest)
    text = "".join(kept)
    t2 = ast.parse(text)
    last_import = max(n.end_lineno for n in t2.body if isinstance(n, HEADER_TYPES))
    kl = text.splitlines(keepends=True)
    kl.insert(last_import, f"from {PKG}.{mx.module} import {', '.join([mx.name, *back])}\n")
    path.write_text(re.sub(r"\n{4,}", "\n\n\n", "".join(kl)))
    run("git", "add", rel(out), rel(path))
    return notes


# --- step 3: rewriting references --------------------------------------------------------------------------
def destination(old: str, name: str | None) -> str:
    """Where `name` (or the module itself when None) of the old module gateway.<old> lives now."""
    spec = SPLITS.get(old)
    if spec is not None and not spec.reexport:
        return spec.parts.get(name, spec.default) if name else spec.default
    return MOVES.get(old, old)


def old_module(dotted: str) -> str | None:
    """The old module (under gateway.) a dotted reference `gateway.a.b...` starts with, if it was moved."""
    parts = dotted.split(".")[1:]
    for k in range(len(parts), 0, -1):
        cand = ".".join(parts[:k])
        moved = (cand in MOVES or cand in SPLITS) and destination(cand, None) != cand
        if moved or (cand in SPLITS and not SPLITS[cand].reexport):
            if k < len(parts) and is_module(parts[:k + 1]):
                return None   # gateway.request.parse...: already a module of the new layout
            return cand
    return None


def is_module(parts: list[str]) -> bool:
    p = ROOT / PKG / Path(*parts)
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def rewrite_import(node: ast.ImportFrom | ast.Import, indent: str) -> str | None:
    """The replacement text of one import statement, or None to leave it."""
    if isinstance(node, ast.Import):
        out, changed = [], False
        for a in node.names:
            old = old_module(a.name) if a.name.startswith(PKG + ".") else None
            if old is None:
                out.append(ast.unparse(ast.Import(names=[a])))
                continue
            changed = True
            rest = a.name[len(PKG) + 1 + len(old):]
            out.append(ast.unparse(ast.Import(names=[ast.alias(f"{PKG}.{destination(old, None)}{rest}",
                                                               a.asname)])))
        return ("\n" + indent).join(out) if changed else None
    if node.level != 0 or not node.module:
        return None
    if node.module == PKG:
        groups: dict[str, list[ast.alias]] = {}
        changed = False
        for a in node.names:
            if a.name in MOVES and destination(a.name, None) != a.name:
                new = destination(a.name, None)
                pkg, _, leaf = new.rpartition(".")
                if leaf != a.name and not a.asname:
                    groups.setdefault(f"{PKG}.{pkg}" if pkg else PKG, []).append(ast.alias(leaf, a.name))
                else:
                    groups.setdefault(f"{PKG}.{pkg}" if pkg else PKG, []).append(
                        ast.alias(leaf, a.asname if a.asname != leaf else None))
                changed = True
            else:
                groups.setdefault(PKG, []).append(a)
        if not changed:
            return None
        return ("\n" + indent).join(ast.unparse(ast.ImportFrom(module=m, names=ns, level=0))
                                    for m, ns in groups.items())
    if not node.module.startswith(PKG + "."):
        return None
    old = node.module[len(PKG) + 1:]
    if old not in MOVES and old not in SPLITS:
        return None
    groups = {}
    for a in node.names:
        dest = destination(old, a.name)
        groups.setdefault(dest, []).append(a)
    if list(groups) == [old]:
        return None
    return ("\n" + indent).join(ast.unparse(ast.ImportFrom(module=f"{PKG}.{m}", names=ns, level=0))
                                for m, ns in groups.items())


DOTTED = re.compile(r"(?<![\w./-])" + PKG + r"((?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(r"(?<![\w.-])" + PKG + r"/((?:state/)?[a-z_]\w*)\.py\b")


def rewrite_dotted(match: re.Match) -> str:
    dotted = PKG + match.group(1)
    old = old_module(dotted)
    if old is None:
        return match.group(0)
    rest = dotted[len(PKG) + 1 + len(old):]
    name = rest[1:].split(".")[0] if rest else None
    return f"{PKG}.{destination(old, name)}{rest}"


def new_path(old: str) -> str:
    spec = SPLITS.get(old)
    if spec is not None and spec.reexport:
        return f"{PKG}/{old.replace('.', '/')}/"
    return f"{PKG}/{destination(old, None).replace('.', '/')}.py"


def rewrite_path(match: re.Match) -> str:
    old = match.group(1).replace("/", ".")
    if old not in MOVES and old not in SPLITS:
        return match.group(0)
    new = new_path(old)
    return new if new != match.group(0) else match.group(0)


def rewrite_python(text: str) -> str:
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
            new = rewrite_import(node, indent)
            if new is not None:
                edits.append((node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, new))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.lineno == node.end_lineno:
            seg = ast.get_source_segment(text, node)
            if seg is None or not re.search(r"[\"']" + PKG + r"\.", seg):
                continue
            new = re.sub(r"(?<=[\"'])" + PKG + r"((?:\.[A-Za-z_]\w*)+)", rewrite_dotted, seg)
            if new != seg:
                edits.append((node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, new))
    for l1, c1, l2, c2, new in sorted(edits, reverse=True):
        # col offsets are in UTF-8 bytes
        start = lines[l1 - 1].encode()[:c1].decode()
        end = lines[l2 - 1].encode()[c2:].decode()
        lines[l1 - 1:l2] = [start + new + end]
    return PATH.sub(rewrite_path, "".join(lines))


def rewrite_text(text: str) -> str:
    return DOTTED.sub(rewrite_dotted, PATH.sub(rewrite_path, text))


SELF = "scripts/relayout.py"
NOT_REWRITTEN = {SELF, "tests/test_relayout.py"}   # this script and its test name the old modules on purpose
SKIP_SUFFIXES = {".png", ".gz", ".jpg", ".jpeg", ".ico", ".pdf", ".whl", ".zip", ".jsonl", ".csv", ".json"}


def tracked_files() -> list[str]:
    out = run("git", "ls-files", "-z").stdout.split("\0")
    return [f for f in out if f and f not in NOT_REWRITTEN and (ROOT / f).is_file() and Path(f).suffix not in SKIP_SUFFIXES]


def rewrite_all(dry: bool) -> list[str]:
    changed = []
    for name in tracked_files():
        path = ROOT / name
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if PKG not in text:
            continue
        new = rewrite_python(text) if name.endswith(".py") else rewrite_text(text)
        if new != text:
            changed.append(name)
            if not dry:
                path.write_text(new)
    return changed


# --- step 4: the layout test and the docs table ------------------------------------------------------------
def layout_table() -> str:
    rows = ["| where | what | modules |", "|---|---|---|"]
    for unit in LAYERS:
        d = ROOT / PKG / unit
        if d.is_dir():
            mods = sorted(p.stem for p in d.glob("*.py") if p.stem != "__init__")
            rows.append(f"| `gateway/{unit}/` | {PACKAGES.get(unit, '')} | {', '.join(mods)} |")
        elif (ROOT / PKG / f"{unit}.py").exists():
            rows.append(f"| `gateway/{unit}.py` | {top_doc(unit)} | |")
    order = " → ".join(LAYERS)
    return (f"{MARK_BEGIN}\n## Where things live\n\n`gateway/` is split by responsibility into subpackages, in "
            f"layers: a module imports only from its own layer and the ones below it (lowest first: {order}). "
            "A type-only import (under `TYPE_CHECKING`) may go up only where `tests/test_layout.py` lists it "
            "with its reason. No module is longer than 800 lines, and at most 10 modules sit at the top level. "
            "`scripts/relayout.py` made this layout from the flat one and holds the mapping.\n\n"
            + "\n".join(rows) + f"\n{MARK_END}\n")


def top_doc(mod: str) -> str:
    text = (ROOT / PKG / f"{mod}.py").read_text()
    doc = ast.get_docstring(ast.parse(text)) or ""
    return doc.split("\n")[0].replace("|", "/")


def write_design_table(dry: bool) -> None:
    path = ROOT / "docs" / "design.md"
    text = path.read_text()
    table = layout_table()
    if MARK_BEGIN in text:
        new = re.sub(re.escape(MARK_BEGIN) + r".*?" + re.escape(MARK_END) + r"\n", lambda _: table, text,
                     flags=re.S)
    elif "\n## The request lifecycle" in text:
        new = text.replace("\n## The request lifecycle", "\n" + table + "\n## The request lifecycle", 1)
    else:
        new = text.rstrip("\n") + "\n\n" + table
    if new != text and not dry:
        path.write_text(new)


LAYOUT_TEST = '''"""gateway/'s layout (docs/design.md, "Where things live"; made by scripts/relayout.py): subpackages in layers
that import one way, few modules at the top level, no long modules.

- A module imports only from its own layer and the layers below it (`LAYERS`, lowest first), at run time or
  under `TYPE_CHECKING`; the only upward imports are the type-only ones `TYPE_ONLY_UP` lists with a reason.
- At most {max_top} modules at gateway/'s top level; no module in gateway/ or its subpackages is over
  {max_lines} lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_repo_hygiene import gateway_sources

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {layers!r}
TYPE_ONLY_UP = {{
{type_only}
}}
MAX_TOP_LEVEL = {max_top}
MAX_LINES = {max_lines}


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
            names = [node.module] if node.module != "gateway" else [f"gateway.{{a.name}}" for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("gateway."):
                yield name, node.lineno, id(node) in type_only


def layer_violations(sources: dict[str, str]) -> list[str]:
    rank = {{u: i for i, u in enumerate(LAYERS)}}
    bad = []
    for mod, text in sorted(sources.items()):
        if mod == "gateway":
            continue
        here = unit(mod)
        for name, line, type_only in imports_of(text):
            there = unit(name)
            if there not in rank or here not in rank:
                bad.append(f"{{mod}}:{{line}}: {{here}} or {{there}} is in no layer (add it to LAYERS)")
            elif rank[there] > rank[here] and not (type_only and (here, there) in TYPE_ONLY_UP):
                kind = "type-only " if type_only else ""
                bad.append(f"{{mod}}:{{line}}: {{kind}}import of {{name}} goes up from {{here}} to {{there}}")
    return bad


def test_layers_import_one_way():
    bad = layer_violations(gateway_sources())
    assert not bad, "imports against the layer order (LAYERS, lowest first):\\n" + "\\n".join(bad)


def test_layer_checker_sees_what_it_must():
    src = {{
        "gateway.wire.errors": "",
        "gateway.pipeline.dispatch": "from gateway.wire import errors\\nfrom gateway.api.admin import x\\n",
        "gateway.ops.status_history": "from typing import TYPE_CHECKING\\nif TYPE_CHECKING:\\n"
                                      "    from gateway.fleet.registry import Registry\\n",
        "gateway.fleet.registry": "from gateway.ops.metrics import GatewayMetrics\\n"
                                  "from gateway.pipeline.dispatch import x\\n",
    }}
    assert layer_violations(src) == [
        "gateway.fleet.registry:2: import of gateway.pipeline.dispatch goes up from fleet to pipeline",
        "gateway.pipeline.dispatch:2: import of gateway.api.admin goes up from pipeline to api"]


def test_every_subpackage_is_in_a_layer():
    subpackages = {{p.name for p in (ROOT / "gateway").iterdir() if (p / "__init__.py").is_file()}}
    top = {{p.stem for p in (ROOT / "gateway").glob("*.py")}} - {{"__init__"}}
    assert subpackages <= set(LAYERS), subpackages - set(LAYERS)
    assert top <= set(LAYERS), top - set(LAYERS)


def test_few_modules_at_the_top_level():
    top = sorted(p.name for p in (ROOT / "gateway").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL, top


def test_no_long_modules():
    long = [f"{{p.relative_to(ROOT)}}: {{n}} lines" for p in sorted((ROOT / "gateway").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {{MAX_LINES}} lines (split them):\\n" + "\\n".join(long)
'''


def write_layout_test(dry: bool) -> None:
    type_only = "\n".join(f"    {k!r}: {v!r}," for k, v in TYPE_ONLY_UP.items())
    text = LAYOUT_TEST.format(layers=LAYERS, type_only=type_only, max_top=MAX_TOP_LEVEL, max_lines=MAX_LINES)
    path = ROOT / "tests" / "test_layout.py"
    if not dry and (not path.exists() or path.read_text() != text):
        path.write_text(text)
        run("git", "add", rel(path))


# --- main --------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    ap.add_argument("--leave-unknown", action="store_true",
                    help="leave modules the mapping does not know where they are (they are still reported)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    unknown = [m for m in current_modules() if not known(m)]
    for m in unknown:
        print(f"UNKNOWN module gateway/{m.replace('.', '/')}.py: add it to MOVES (or TOP_LEVEL)")
    if unknown and not args.leave_unknown:
        print("relayout: nothing changed (unknown modules above; --leave-unknown to go on)")
        return 2
    if not dry and run("git", "status", "--porcelain", "--untracked-files=no").stdout.strip():
        print("relayout: the tree has uncommitted changes; commit or stash them first")
        return 1
    print("moves:")
    do_moves(dry)
    print("splits:")
    notes: list[str] = []
    for old, spec in SPLITS.items():
        notes += do_split(old, spec, dry)
    for mod, classes in CLASS_SPLITS.items():
        for cls_name, mx in classes.items():
            notes += do_class_split(mod, cls_name, mx, dry)
    print("rewriting references:")
    changed = rewrite_all(dry)
    for name in changed:
        print(f"  {name}")
    write_layout_test(dry)
    write_design_table(dry)
    if not dry:
        py = [f for f in run("git", "ls-files", "-m", "-o", "--exclude-standard", "--", "*.py").stdout.split()
              if f not in NOT_REWRITTEN]
        py += [rel(p) for p in (ROOT / PKG).rglob("*.py")]
        venv_ruff = ROOT / ".venv" / "bin" / "ruff"
        ruff = [str(venv_ruff) if venv_ruff.exists() else shutil.which("ruff") or "ruff", "check", "--fix", "--select", "I,F401", "-q",
                *sorted(set(py))]
        run(*ruff, check=False)
        run("git", "add", "-A", PKG, "tests", "docs", check=False)
    for n in notes:
        print("NOTE " + n)
    print("done" if not dry else "dry run: nothing changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
