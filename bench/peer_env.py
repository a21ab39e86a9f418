"""The peer routers' own virtualenv: vllm-router and sglang-router from PyPI, pinned, cached outside the project.

    python -m bench.peer_env        # prints the venv path (builds it on first use, ~1 minute)

Like scripts/vllm_env.sh does for vLLM, the venv lives under ~/.cache/fleetgate (FLEETGATE_PEERS_VENV overrides),
so fresh clones and CI on this machine reuse it; a stamp file written last says the build completed with this
recipe, and a lock keeps parallel runs from building it twice. The peers never import anything from this
project: they only run as separate processes in front of the same backends (bench/peers.py). `cached_venv`
builds any such pinned tool venv (bench/loadgen_env.py uses it for a third-party load generator).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Pinned: the versions whose numbers bench/results/peers.md reports. Each maps to the command it installs.
PEER_PACKAGES: dict[str, str] = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}
RECIPE = "; ".join(f"{name}=={version}" for name, version in sorted(PEER_PACKAGES.items()))


def default_venv() -> Path:
    tag = "-".join(f"{name}-{version}" for name, version in sorted(PEER_PACKAGES.items()))
    return Path(os.environ.get("FLEETGATE_PEERS_VENV", Path.home() / ".cache" / "fleetgate" / f"peers-{tag}"))


def peer_command(venv: Path, name: str) -> Path:
    """The console script `name` (a key of PEER_PACKAGES) installed in `venv`."""
    return venv / "bin" / name


def _is_intact(venv: Path, recipe: str, commands: list[str]) -> bool:
    stamp = venv / ".fleetgate-ready"
    if not stamp.is_file() or stamp.read_text() != recipe:
        return False
    for name in commands:   # a half-deleted venv fails here
        try:
            subprocess.run([str(venv / "bin" / name), "--help"], capture_output=True, check=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return False
    return True


def _build(venv: Path, pins: list[str], recipe: str) -> None:
    print(f"peer_env: building {venv} ({recipe})", file=sys.stderr, flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", *pins],
                         capture_output=True, text=True)
    if pip.returncode != 0:   # pip's output only when it failed (it warns about the machine's local indexes)
        raise RuntimeError(f"installing {pins} failed:\n{pip.stdout[-2000:]}{pip.stderr[-2000:]}")
    (venv / ".fleetgate-ready").write_text(recipe)   # last: its presence means every step above completed


def cached_venv(venv: Path, pins: list[str], commands: list[str]) -> Path:
    """`venv` with `pins` installed (pip requirement strings), built if missing or not intact (each of
    `commands` must answer --help); returns its path."""
    recipe = "; ".join(sorted(pins))
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one builder at a time: parallel runs share the venv
        if not _is_intact(venv, recipe, commands):
            _build(venv, pins, recipe)
            if not _is_intact(venv, recipe, commands):
                raise RuntimeError(f"venv {venv} failed its check after the build")
    return venv


def ensure_peer_env(venv: Path | None = None) -> Path:
    """The peers' venv, built if missing or not intact; returns its path."""
    pins = [f"{name}=={version}" for name, version in sorted(PEER_PACKAGES.items())]
    return cached_venv(venv or default_venv(), pins, list(PEER_PACKAGES))


if __name__ == "__main__":
    print(ensure_peer_env())
