"""Loading a config file, the checks across sections a schema cannot express (policies, aliases, discovery,
re-planning, deployments, keys), and `fleetgate check-config`: a validation error in words, a summary of
the config.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gateway.config.base import ConfigError
from gateway.config.gateway import _FILE_DATA, GatewayConfig
from gateway.config.keys import digest
from gateway.config.priors import known_profile


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError([f"{path}: cannot read the file ({e.strerror or e})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"{path}: YAML syntax error at {where}: {problem}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of settings, got {type(data).__name__}"])
    return data


def load_config(path: Path | str | None = None, **overrides: Any) -> GatewayConfig:
    """Build the configuration from a YAML file (optional), the environment and `overrides`.

    Raises ConfigError with one line per problem (field path, what was expected, the bad value).
    """
    data = read_yaml(Path(path)) if path is not None else {}
    token = _FILE_DATA.set(data)
    try:
        cfg = GatewayConfig(**overrides)
    except ValidationError as e:
        # Report unknown policy names in the same pass as the schema errors (they need no valid config).
        raw = {**data, **overrides}
        raise ConfigError(describe_validation_error(e, GatewayConfig) + unknown_policy_problems(raw)) from None
    finally:
        _FILE_DATA.reset(token)
    problems = semantic_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def _policy_refs(raw: dict[str, Any]) -> list[tuple[str, Any]]:
    """(where, name) of every policy a raw (unvalidated) config names."""
    refs = [("default_policy", raw.get("default_policy"))]
    models = raw.get("models")
    if isinstance(models, dict):
        refs += [(f"models.{m}.policy", mc.get("policy")) for m, mc in models.items() if isinstance(mc, dict)]
    pd = raw.get("pd")
    if isinstance(pd, dict):
        refs.append(("pd.decode_policy", pd.get("decode_policy")))
    return [(w, n) for w, n in refs if isinstance(n, str)]


def unknown_policy_problems(raw: dict[str, Any]) -> list[str]:
    """Unknown policy names in a raw config, in semantic_problems' words."""
    from policies.base import policy_names

    try:
        known = policy_names()
    except ImportError:
        return []
    return [f"{where}: unknown policy {name!r}; expected one of: {', '.join(known)}"
            for where, name in _policy_refs(raw) if name not in known]


def semantic_problems(cfg: GatewayConfig) -> list[str]:
    """Checks that need more than types: policy names and their parameters."""
    from policies.base import make_policy, policy_names

    problems: list[str] = (key_problems(cfg) + deployment_problems(cfg) + replan_problems(cfg)
                           + discovery_problems(cfg) + alias_problems(cfg) + engine_problems(cfg))
    try:
        known = policy_names()
    except ImportError as e:  # the policy package is incomplete; report, don't crash
        return [f"cannot load the routing policies to check names: {e}"]
    checks = [("default_policy", cfg.default_policy, cfg.default_policy_params)]
    for name, mc in cfg.models.items():
        if mc.policy is not None:
            checks.append((f"models.{name}.policy", mc.policy, mc.params))
    if cfg.pd.decode_policy is not None:
        checks.append(("pd.decode_policy", cfg.pd.decode_policy, cfg.pd.decode_policy_params))
    for where, name, params in checks:
        if name not in known:
            problems.append(f"{where}: unknown policy {name!r}; expected one of: {', '.join(known)}")
            continue
        try:
            policy = make_policy(name, **params)
        except Exception as e:  # noqa: BLE001 - any constructor complaint is a config problem
            problems.append(f"{where}: policy {name!r} rejects its params {params!r}: {e}")
            continue
        if policy.needs_perf_models:
            problems += unmodelled_workers(cfg, where, name)
    return problems


def configured_models(cfg: GatewayConfig) -> set[str]:
    """The model names a configuration names: `models`, the workers' and shared hosts' models, the deployment
    groups' models, and the LoRA adapters."""
    names = set(cfg.models) | set(cfg.adapter_parents())
    names.update(m for w in cfg.all_workers() for m in w.models)
    names.update(g.model for g in (cfg.deployment.groups if cfg.deployment is not None else ()))
    return names


def alias_problems(cfg: GatewayConfig) -> list[str]:
    """An alias names a configured model and is no model's own name; fallbacks name other configured models."""
    known = configured_models(cfg)
    problems = []
    for alias, target in cfg.aliases.items():
        if alias in known:
            problems.append(f"aliases.{alias}: shadows the served model {alias!r} (an alias needs a name of its own)")
        if target not in known:
            problems.append(f"aliases.{alias}: unknown model {target!r} (name it under `models` or in a worker's "
                            "`models`)")
    for model, mc in cfg.models.items():
        for key in ("fallbacks", "context_window_fallbacks"):
            for j, other in enumerate(getattr(mc, key)):
                target = cfg.aliases.get(other, other)
                if target == model:
                    problems.append(f"models.{model}.{key}[{j}]: {other!r} is the model itself")
                elif target not in known:
                    problems.append(f"models.{model}.{key}[{j}]: unknown model {other!r} (name it under `models` "
                                    "or in a worker's `models`)")
    return problems


def engine_problems(cfg: GatewayConfig) -> list[str]:
    """No engine listed twice (gateway/config/engine_identity.py)."""
    from gateway.config.engine_identity import duplicate_engine_problems

    entries = [(f"workers[{i}]", w.id, w.url) for i, w in enumerate(cfg.workers)]
    entries += [(f"shared_hosts[{i}].engines.{m}", h.worker_id(m), h.engine(m).url)
                for i, h in enumerate(cfg.shared_hosts) for m in h.engines]
    return duplicate_engine_problems(entries)


def discovery_problems(cfg: GatewayConfig) -> list[str]:
    """`worker_discovery` entries with `nameservers` need dnspython (the `dns` extra)."""
    import importlib.util

    if importlib.util.find_spec("dns") is not None:
        return []
    return [f"worker_discovery[{i}].nameservers: needs dnspython (pip install 'fleetgate[dns]')"
            for i, e in enumerate(cfg.worker_discovery) if e.nameservers]


def replan_problems(cfg: GatewayConfig) -> list[str]:
    """Re-planning runs in the autoscaler's leader, over a GPU stock, against the configured SLO."""
    rc = cfg.replan
    if not rc.enabled:
        return []
    from policies.replan import parse_stock

    problems = []
    if not cfg.autoscale.enabled:
        problems.append("replan.enabled needs autoscale.enabled (the autoscaler's leader re-plans)")
    if cfg.slo.ttft_ms is None or cfg.slo.tpot_ms is None:
        problems.append("replan.enabled needs slo.ttft_ms and slo.tpot_ms (the plan is sized for them)")
    try:
        parse_stock(rc.gpus)
    except ValueError as e:
        problems.append(f"replan.gpus: {e}")
    return problems


def deployment_problems(cfg: GatewayConfig) -> list[str]:
    """Each deployment group's model and GPU are known and the model fits `tp` of those GPUs."""
    from policies.hardware import derive_profile

    problems = []
    for i, g in enumerate(cfg.deployment.groups if cfg.deployment is not None else ()):
        try:
            derive_profile(g.model, g.gpu, g.tp)
        except ValueError as e:
            problems.append(f"deployment.groups[{i}]: {e}")
    return problems


def unmodelled_workers(cfg: GatewayConfig, where: str, policy: str) -> list[str]:
    """An SLO-aware policy needs each worker's own performance model: never another GPU's defaults. A worker
    whose profile is not a built-in profile, a profile file or a `learning.priors` entry is refused."""
    out = []
    for i, w in enumerate(cfg.workers):
        if not known_profile(w.profile, cfg.learning.priors):
            out.append(f"workers[{i}].profile: {where} {policy!r} needs each worker's performance model, and "
                       f"{w.profile or '(none)'!r} is no built-in profile, profile file or learning.priors entry "
                       "(fleetgate sim --list-profiles lists the built-in ones)")
    return out
def key_problems(cfg: GatewayConfig) -> list[str]:
    """The same key twice, or the admin key also an inference key (it would then not be an admin-only key)."""
    problems, seen = [], {}
    named = [(f"api_keys[{i}]", k) for i, k in enumerate(cfg.api_keys)]
    named += [(f"auth.keys[{i}].key", k.key) for i, k in enumerate(cfg.auth.keys)]
    for where, key in named:
        d = digest(key)
        if d in seen:
            problems.append(f"{where}: the same key as {seen[d]}")
        seen.setdefault(d, where)
    admin = cfg.auth.admin_key
    if admin is not None and digest(admin) in seen:
        problems.append(f"auth.admin_key: must differ from every inference key (it equals {seen[digest(admin)]})")
    return problems


def describe_validation_error(err: ValidationError, model: type[BaseModel]) -> list[str]:
    lines = []
    for e in err.errors(include_url=False):
        path = format_loc(e["loc"])
        if e["type"] == "extra_forbidden":
            known = _known_fields(model, e["loc"][:-1])
            hint = f" (known fields here: {', '.join(known)})" if known else ""
            lines.append(f"{path}: unknown field{hint}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            lines.append(f"{path}: required field is missing")
        elif path:
            lines.append(f"{path}: {msg} (got {_short(e.get('input'))})")
        else:
            lines.append(msg)
    return lines


def format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _known_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the sub-model that `loc` points into (for 'unknown field' hints)."""
    cur: Any = model
    for part in loc:
        if cur is None:
            return []
        if isinstance(part, int):
            continue  # a list index: `cur` already is the item model
        if isinstance(cur, _DictOf):
            cur = cur.value_type  # a dict key such as models.<name>
            continue
        field = cur.model_fields.get(part)
        if field is None:
            return []
        cur = _model_type(field.annotation)
    return list(cur.model_fields) if isinstance(cur, type) and issubclass(cur, BaseModel) else []


def _model_type(annotation: Any) -> Any:
    """Model for `Model`, the item model for list[Model], _DictOf(Model) for dict[str, Model], else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = getattr(annotation, "__args__", ())
    inner = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
    if inner is not None and getattr(annotation, "__origin__", None) is dict:
        return _DictOf(inner)
    return inner


class _DictOf:
    """Marker for dict[str, Model] while walking an error location."""

    def __init__(self, value_type: type[BaseModel]) -> None:
        self.value_type = value_type


def summarize(cfg: GatewayConfig) -> str:
    models = sorted({m for w in cfg.workers for m in w.models})
    lines = [
        f"listen {cfg.listen.host}:{cfg.listen.port}",
        f"{len(cfg.workers)} worker(s): " + (", ".join(f"{w.id} ({w.role}) {w.url}" for w in cfg.workers) or "none"),
        "models configured on workers: " + (", ".join(models) or "none (discovered from /v1/models)"),
        f"default policy {cfg.default_policy}"
        + "".join(f"; {name}: {mc.policy or cfg.default_policy}" for name, mc in cfg.models.items()),
        f"state: {'redis ' + cfg.redis_url if cfg.redis_url else 'in-memory'}; "
        f"api keys: {len(cfg.api_keys) + len(cfg.auth.keys) or 'none (open)'}; "
        f"admin API: {'on' if cfg.auth.admin_key else 'off (no auth.admin_key)'}",
    ]
    if cfg.shared_hosts:
        lines.append("shared hosts: " + "; ".join(f"{h.id} ({', '.join(h.engines)}; max_awake {h.max_awake}; {h.scheduling})"
                                                  for h in cfg.shared_hosts))
    if cfg.deployment is not None:
        lines.append("deployment: " + ", ".join(f"{g.count}x {g.model} on {g.tp}x {g.gpu} ({g.role})"
                                                for g in cfg.deployment.groups))
    return "\n".join(lines)


def check_config_cli(path: Path) -> int:
    """`fleetgate config check FILE`: 0 and a summary when valid, 1 and one line per problem otherwise."""
    try:
        cfg = load_config(path)
    except ConfigError as e:
        print(f"{path}: invalid configuration ({len(e.problems)} problem(s)):", file=sys.stderr)
        for p in e.problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(f"{path}: OK")
    print(summarize(cfg))
    return 0
