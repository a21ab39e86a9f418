"""`fleetgate` command line. Each command is a thin shim over a function in the module that owns it."""

from __future__ import annotations

from pathlib import Path

import typer

from policies.admission import DEFAULT_QUEUE_LOOKAHEAD
from policies.base import DEFAULT_POLICY

# Plain click help (rich_markup_mode=None): typer's rich help shows on/off flags as `<bool>`.
_HELP = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, context_settings=_HELP,
                  help="SLO-aware routing gateway for vLLM fleets.")
config_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, context_settings=_HELP,
                         help="Configuration files.")
app.add_typer(config_app, name="config")

LOG_FORMAT_HELP = "Log lines: text, logfmt or json (config logging.format)."
LOG_LEVEL_HELP = "Log level: debug, info, warning or error (config logging.level)."


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("fleetgate")
        except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
            v = "unknown (not installed)"
        typer.echo(f"fleetgate {v}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """SLO-aware routing gateway for vLLM fleets."""


@app.command()
def serve(
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML config file."),
    host: str | None = typer.Option(None, help="Address to listen on (default: config listen.host, 127.0.0.1)."),
    port: int | None = typer.Option(None, help="Port to listen on; 0 picks a free one (default: config, 8000)."),
    worker: list[str] = typer.Option([], "--worker", "-w", metavar="URL", help="Worker URL (repeatable); adds to the config."),
    policy: str | None = typer.Option(None, help="Default routing policy (overrides the config)."),
    redis_url: str | None = typer.Option(None, "--redis-url", help="Share state through Redis."),
    log_format: str | None = typer.Option(None, "--log-format", help=LOG_FORMAT_HELP),
    log_level: str | None = typer.Option(None, "--log-level", help=LOG_LEVEL_HELP),
) -> None:
    """Run the gateway in front of the workers named in the config (and/or --worker)."""
    from gateway.server import run_serve

    run_serve(config=config, host=host, port=port, workers=worker, policy=policy, redis_url=redis_url,
              log_format=log_format, log_level=log_level)


@app.command()
def demo(
    port: int = typer.Option(8000, help="Gateway port."),
    workers: int = typer.Option(4, help="Number of simulated workers."),
    policy: str = typer.Option(DEFAULT_POLICY, help="Routing policy."),
    profile: str = typer.Option("llama3-8b-h100", help="Simulator profile for the workers."),
    model: str = typer.Option("meta-llama/Llama-3.1-8B-Instruct", help="Model name the fleet serves."),
    time_scale: float = typer.Option(1.0, "--time-scale", help="Run the simulated engines K times faster."),
    base_port: int = typer.Option(0, "--base-port", help="First simulator port; worker n listens on base + n "
                                  "(0: gateway port + 1)."),
    pd: str | None = typer.Option(None, "--pd", help="P:D, e.g. 2:2 — prefill and decode workers."),
    autoscale: bool = typer.Option(False, "--autoscale", help="Run the autoscaler with the sim actuator."),
    num_models: int = typer.Option(1, "--num-models", help="M > 1: M models sharing the --workers hosts, one "
                                   "awake per host, swapped through sleep mode (shared_hosts)."),
    scheduling: str = typer.Option("request", "--scheduling", help="With --num-models: request (swap an idle "
                                   "engine for a waiting model) or turns (Aegaeon's decode turns)."),
    log_format: str = typer.Option("text", "--log-format", help=LOG_FORMAT_HELP),
    slo_ttft_ms: float = typer.Option(1000.0, "--slo-ttft-ms", help="The fleet's TTFT SLO (attainment metrics)."),
    slo_tpot_ms: float = typer.Option(50.0, "--slo-tpot-ms", help="The fleet's time-per-output-token SLO."),
    lora_adapters: int = typer.Option(0, "--lora-adapters", help="N > 0: N LoRA adapters of --model, loaded by "
                                      "the gateway on demand on workers with --max-loras 2."),
    deployment: Path | None = typer.Option(None, "--deployment", help="Start a plan's instances (`fleetgate plan "
                                           "--out` JSON or YAML) with their derived profiles; the plan's policy "
                                           "and SLO unless --policy is given."),
) -> None:
    """Gateway plus N simulated vLLM workers in one command; in-memory state, nothing else to start."""
    if deployment is not None:
        from gateway.demo import run_deployment_demo

        chosen = policy if policy != DEFAULT_POLICY else None
        run_deployment_demo(deployment, port=port, base_port=base_port or port + 1, time_scale=time_scale,
                            policy=chosen, log_format=log_format)
        return
    if lora_adapters > 0:
        from gateway.demo import run_lora_demo

        run_lora_demo(port=port, workers=workers, adapters=lora_adapters, policy=policy, profile=profile, model=model,
                      time_scale=time_scale, base_port=base_port or port + 1, log_format=log_format,
                      slo={"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms})
        return
    if num_models > 1:
        from gateway.demo import run_pooled_demo

        run_pooled_demo(port=port, workers=workers, num_models=num_models, policy=policy, profile=profile,
                        model=model, time_scale=time_scale, base_port=base_port or port + 1, log_format=log_format,
                        slo={"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms}, scheduling=scheduling)
        return
    from gateway.demo import run_demo

    run_demo(
        port=port, workers=workers, policy=policy, profile=profile, model=model,
        time_scale=time_scale, base_port=base_port or port + 1, pd=pd, autoscale=autoscale, log_format=log_format,
        slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
    )


@app.command()
def sim(
    workers: int = typer.Option(1, help="Number of simulated vLLM servers."),
    base_port: int = typer.Option(8100, "--base-port", help="First port; servers use P..P+N-1."),
    profile: str = typer.Option("llama3-8b-h100", help="Profile name or YAML file."),
    model: str = typer.Option("meta-llama/Llama-3.1-8B-Instruct", help="Served model name."),
    time_scale: float = typer.Option(1.0, "--time-scale", help="Run the timing model K times faster."),
    fleet: Path | None = typer.Option(None, "--fleet", help="YAML fleet file (mixes profiles, models, roles)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    seed: int = typer.Option(0, help="Random seed for output lengths."),
    list_profiles: bool = typer.Option(False, "--list-profiles", help="List built-in profiles and exit."),
    scheduling_policy: str = typer.Option("fcfs", "--scheduling-policy", help="vLLM scheduler: fcfs or priority."),
    kv_events_config: str | None = typer.Option(
        None, "--kv-events-config", help="vLLM's KV-events JSON, e.g. '{\"enable_kv_cache_events\": true, "
        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}'; server i publishes on the port + i."),
    kv_events_format: str = typer.Option("0.11", "--kv-events-format",
                                         help="KV-event wire format and hashing of vLLM 0.11 or 0.33."),
    hash_algo: str = typer.Option("sha256", "--prefix-caching-hash-algo", help="sha256 or sha256_cbor."),
    enable_lora: bool = typer.Option(False, "--enable-lora", help="Serve LoRA adapters (vLLM's flag)."),
    lora_modules: list[str] = typer.Option(
        [], "--lora-modules", metavar="NAME=PATH",
        help="An adapter served from the start: name=path or JSON {\"name\", \"path\", \"base_model_name\"}; "
             "repeat the option for more."),
    max_loras: int = typer.Option(1, "--max-loras", help="Distinct adapters in one engine step (vLLM default 1)."),
    max_cpu_loras: int | None = typer.Option(
        None, "--max-cpu-loras", help="Adapters kept in host memory, LRU (default: --max-loras)."),
    max_lora_rank: int = typer.Option(16, "--max-lora-rank", help="Largest adapter rank; sizes the GPU slots."),
    runtime_lora: bool | None = typer.Option(
        None, "--allow-runtime-lora-updating/--no-runtime-lora-updating",
        help="The /v1/load_lora_adapter and /v1/unload_lora_adapter routes; default: as the environment's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING."),
) -> None:
    """Run simulated vLLM servers (one process, many ports)."""
    from simulator.fleet import run_fleet_cli

    lora = None
    if enable_lora or lora_modules or runtime_lora is not None:
        lora = {"enable_lora": enable_lora, "lora_modules": list(lora_modules), "max_loras": max_loras,
                "max_cpu_loras": max_cpu_loras, "max_lora_rank": max_lora_rank,
                "allow_runtime_lora_updating": runtime_lora}
    run_fleet_cli(
        workers=workers, base_port=base_port, profile=profile, model=model, time_scale=time_scale,
        fleet=fleet, host=host, seed=seed, list_profiles=list_profiles, scheduling_policy=scheduling_policy,
        kv_events_config=kv_events_config, kv_events_format=kv_events_format, hash_algo=hash_algo, lora=lora,
    )


@app.command()
def simulate(
    trace: str | None = typer.Option(None, help="Trace file or built-in name (azure_conv, sharegpt, arxiv, mooncake)."),
    workers: int = typer.Option(8, help="Number of workers."),
    profile: str = typer.Option("llama3-8b-h100", help="Profile name or YAML file (comma-separated: a mixed fleet)."),
    policy: str | None = typer.Option(None, help="Routing policy (default least_tokens; with --deployment, the "
                                      "plan's)."),
    policy_param: list[str] = typer.Option([], "--policy-param", metavar="KEY=VALUE",
                                           help="A policy parameter KEY=VALUE (repeatable)."),
    rate: float | None = typer.Option(None, help="Synthetic arrival rate (req/s); lengths-only traces need one."),
    rate_scale: float = typer.Option(1.0, "--rate-scale", help="Multiply the trace's arrival rate."),
    arrival: str = typer.Option("poisson", help="Synthetic arrivals: poisson or gamma."),
    cv: float = typer.Option(1.0, help="Coefficient of variation for gamma arrivals."),
    duration: float | None = typer.Option(None, help="Simulated seconds of arrivals."),
    slo_ttft_ms: float | None = typer.Option(None, "--slo-ttft-ms", help="TTFT target (default 600; with "
                                             "--deployment, the plan's; with --pooling 10000, Aegaeon's)."),
    slo_tpot_ms: float | None = typer.Option(None, "--slo-tpot-ms", help="TPOT (ATGT) target (default 30; with "
                                             "--deployment, the plan's; with --pooling 100)."),
    ttft_slowdown: float | None = typer.Option(
        None, "--ttft-slowdown", help="TTFT target at least K x the prompt's prefill alone (long contexts)."),
    seed: int = typer.Option(0, help="Seed: the window of a timestamped trace, the draws of synthetic arrivals."),
    oracle_lengths: bool = typer.Option(False, "--oracle-lengths",
                                        help="Tell policies every request's true output length (an oracle)."),
    warmup: int = typer.Option(2000, help="Past (prompt, output) pairs of the trace the length predictor starts from."),
    queue_lookahead: int = typer.Option(DEFAULT_QUEUE_LOOKAHEAD, "--queue-lookahead",
                                        help="Admission queue look-ahead (the gateway's limits.queue_lookahead)."),
    rebalance_s: float | None = typer.Option(None, "--rebalance-s", help="Run Aladdin's Algorithm 2 (moves of "
                                             "requests not started) every this many seconds; off by default."),
    no_shed: bool = typer.Option(False, "--no-shed", help="Admit what will miss its SLO (the gateway's "
                                 "limits.shed_will_miss: false); by default such requests are refused (429)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    pd: str | None = typer.Option(None, "--pd", help="P:D prefill and decode workers (replaces --workers); "
                                     "--policy then places the decode legs."),
    deployment: Path | None = typer.Option(None, "--deployment", help="Simulate a plan (`fleetgate plan --out` JSON, "
                                           "or YAML): its instance groups instead of --workers/--profile."),
    services: str | None = typer.Option(
        None, "--services", help="Services sharing the engines, e.g. sharegpt,arxiv,azure_conv,code "
        "([name=]lengths[:share]); replaces --trace; --rate is their total."),
    service_priority: str | None = typer.Option(
        None, "--service-priority", help="Order of requests across services: fcfs, round_robin, seallm or vtc."),
    service_preempt: bool = typer.Option(
        False, "--service-preempt", help="Re-prioritise running requests by preemption (simulator only)."),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", help="The engines' --max-num-seqs."),
    num_models: int | None = typer.Option(None, "--num-models", help="Pooled serving: M models share the workers "
                                          "(with --pooling; --rate is the total over all models)."),
    model_skew: str = typer.Option("uniform", "--model-skew", help="Pooled: model popularity, uniform or zipf:S."),
    pooling: str | None = typer.Option(None, "--pooling", help="Pooled: dedicated, request, multiplex or aegaeon."),
    reinit: str = typer.Option("optimized", "--reinit", help="Pooled swap cost: optimized (Aegaeon eq. 4) or "
                               "sleep (vLLM sleep level 1 offload + reload + wake)."),
    prefetch: bool = typer.Option(True, "--prefetch/--no-prefetch", help="Pooled: load the next model's weights "
                                  "during the current work when memory allows (Aegaeon section 5.2)."),
    kv_overlap: bool = typer.Option(True, "--kv-overlap/--no-kv-overlap", help="Pooled aegaeon: swap the next "
                                    "batch's KV in during the current turn (Aegaeon section 5.3)."),
    shared_kv: bool = typer.Option(False, "--shared-kv", help="Pooled multiplex: the models share one KV pool "
                                   "(SeaLLM section 4.4), so more fit a host."),
    prefill_fraction: float | None = typer.Option(
        None, "--prefill-fraction", help="Pooled aegaeon: the share of workers that prefill (default 6/16, section "
        "7.2); 0 = no partition, Aegaeon's turns on colocated hosts (what the gateway's scheduling: turns runs)."),
    kv_kept: bool = typer.Option(False, "--kv-kept", help="Pooled aegaeon --prefill-fraction 0: keep a sleeping "
                                 "engine's KV in host memory and copy it back (simulator only; stock vLLM drops it)."),
    recompute_quota_on: bool = typer.Option(
        True, "--recompute-quota/--no-recompute-quota", help="Pooled aegaeon --prefill-fraction 0: the "
        "recomputation of a dropped KV counts as switching (eq. 3's c), as on the gateway's shared_hosts; always "
        "on (--no-recompute-quota is refused: the stock quota starves the turns)."),
    turns_placement: str = typer.Option("spread", "--turns-placement", help="Pooled aegaeon --prefill-fraction 0: "
                                        "spread (ceil(M/N) models per host) or all (every model on every host)."),
) -> None:
    """Virtual-time cluster simulation: the gateway's placement step and admission queue, the same engine model,
    no sockets. Attainment is over servable requests; progress goes to stderr. With --pooling (and --num-models),
    many models share the workers instead (simulator/pooled.py); with --deployment, a plan's instance groups."""
    if deployment is not None:
        from simulator.deployment import DeploymentRun, deployment_defaults, run_deployment_cli

        plan = deployment_defaults(deployment)
        run = DeploymentRun(trace=trace or "sharegpt", rate=rate, duration=duration, seed=seed,
                            policy=policy or plan.get("policy", "hetero"),
                            slo_ttft_s=plan.get("slo_ttft_s", 0.6) if slo_ttft_ms is None else slo_ttft_ms / 1000.0,
                            slo_tpot_s=plan.get("slo_tpot_s", 0.03) if slo_tpot_ms is None else slo_tpot_ms / 1000.0)
        run_deployment_cli(str(deployment), run, as_json)
        return
    from simulator.simulate import SimSpec, parse_params, run_simulate_cli

    if pooling is not None or num_models is not None:
        from policies.pooling.turns import RECOMPUTE_OFF_REMOVED
        from simulator.pooled import PooledSpec, run_pooled_cli

        # the gateway's rule where it applies: colocated turns, the KV dropped (shared_hosts[].recompute_quota)
        colocated = (pooling or "aegaeon") == "aegaeon" and prefill_fraction == 0
        recompute_quota = colocated and not kv_kept
        try:
            if not recompute_quota_on:
                raise ValueError(f"--no-recompute-quota: {RECOMPUTE_OFF_REMOVED}")
            if pd is not None:
                raise ValueError("--pd does not combine with --pooling (aegaeon splits its own workers)")
            if rate is None:
                raise ValueError("--pooling needs --rate (req/s over all models)")
            pspec = PooledSpec(num_models=num_models or 8, model_skew=model_skew, rate=rate, workers=workers,
                               pooling=pooling or "aegaeon", profile=profile, traces=trace or "sharegpt",
                               duration=duration or 300.0, seed=seed,
                               slo_ttft_s=(slo_ttft_ms or 10000.0) / 1000.0, slo_tpot_s=(slo_tpot_ms or 100.0) / 1000.0,
                               reinit=reinit, prefetch=prefetch, kv_overlap=kv_overlap,
                               service_priority=service_priority, shared_kv=shared_kv, kv_kept=kv_kept,
                               recompute_quota=recompute_quota, turns_placement=turns_placement,
                               **({} if prefill_fraction is None else {"prefill_fraction": prefill_fraction}))
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        run_pooled_cli(pspec, as_json)
        return
    slo_ttft_ms = 600.0 if slo_ttft_ms is None else slo_ttft_ms
    slo_tpot_ms = 30.0 if slo_tpot_ms is None else slo_tpot_ms
    try:
        spec = SimSpec(trace=trace or "azure_conv", rate=rate, rate_scale=rate_scale, arrival=arrival, cv=cv,
                       duration=duration, seed=seed, profile=profile, workers=workers,
                       policy=policy or DEFAULT_POLICY, policy_params=parse_params(policy_param),
                       slo_ttft_s=slo_ttft_ms / 1000.0, slo_tpot_s=slo_tpot_ms / 1000.0, ttft_slowdown=ttft_slowdown, pd=pd,
                       lengths="oracle" if oracle_lengths else "predicted", warmup=warmup,
                       queue_lookahead=queue_lookahead, rebalance_s=rebalance_s, services=services,
                       service_priority=service_priority, service_preempt=service_preempt, max_num_seqs=max_num_seqs,
                       shed=not no_shed)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    run_simulate_cli(spec, as_json)


@app.command()
def plan(
    model: list[str] = typer.Option([], "--model", "-m", metavar="NAME[:SHARE]",
                                    help="A model to serve and its share of the traffic (repeatable)."),
    gpus: list[str] = typer.Option([], "--gpus", "-g", metavar="TYPE:COUNT[:PRICE]",
                                   help="GPUs available: type (a100, h100, l4, v100, a800), count, USD/GPU-hour."),
    trace: str | None = typer.Option(None, help="Trace for lengths (and arrivals without --rate); default sharegpt."),
    rate: float | None = typer.Option(None, help="Total arrival rate (req/s); default: the trace's own."),
    slo_ttft_ms: float = typer.Option(600.0, "--slo-ttft-ms", help="TTFT target."),
    slo_tpot_ms: float = typer.Option(30.0, "--slo-tpot-ms", help="TPOT target."),
    objective: str = typer.Option("cost", help="cost (cheapest that meets --target) or throughput."),
    budget: float | None = typer.Option(None, "--budget", help="At most this many USD per hour."),
    target: float = typer.Option(0.95, help="SLO attainment the plan must reach in the simulator."),
    duration: float = typer.Option(120.0, help="Simulated seconds of arrivals per scored candidate."),
    seed: int = typer.Option(0, help="Seed of the simulated traffic."),
    policy: str = typer.Option("hetero", help="Routing policy the simulated fleets run."),
    score_top: int = typer.Option(3, "--score-top", help="Closed-form candidates the simulator scores."),
    score_seeds: int = typer.Option(2, "--score-seeds", help="Traffic draws pooled in each score (seed, seed+1000, "
                                    "...)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Also write the plan JSON (a deployment file) here."),
) -> None:
    """Capacity planning: instance groups (model, GPU type, TP, role, count) that serve the traffic at the SLOs,
    scored in the virtual-time simulator; prints the plan and the runner-ups with why they lost."""
    from simulator.deployment import DeploymentRun
    from simulator.planner import run_plan_cli

    try:
        if rate is not None and not rate > 0:
            raise ValueError("--rate must be > 0")
        if not duration > 0 or slo_ttft_ms <= 0 or slo_tpot_ms <= 0:
            raise ValueError("--duration and the SLOs must be > 0")
        if objective not in ("cost", "throughput"):
            raise ValueError("--objective must be cost or throughput")
        run = DeploymentRun(trace=trace or "sharegpt", rate=rate, duration=duration, seed=seed, policy=policy,
                            slo_ttft_s=slo_ttft_ms / 1000.0, slo_tpot_s=slo_tpot_ms / 1000.0)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    run_plan_cli(model, gpus, run, objective, budget, target, score_top, as_json, str(out) if out else None,
                 score_seeds)


@config_app.command("check")
def config_check(file: Path = typer.Argument(..., help="YAML config file to validate.")) -> None:
    """Validate a config file and explain what is wrong."""
    from gateway.config import check_config_cli

    raise typer.Exit(check_config_cli(file))


@config_app.command("reference")
def config_reference(
    out: Path | None = typer.Option(None, "--out", "-o", help="Write it to this file (docs/configuration.md) "
                                    "instead of printing it."),
) -> None:
    """Print every configuration key, its type, default and meaning, as markdown (from the config models)."""
    from gateway.config.reference import reference

    text = reference()
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    app()
