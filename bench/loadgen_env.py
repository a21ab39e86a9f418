"""A third-party load generator's own virtualenv (guidellm from PyPI, pinned), cached outside the project.

    python -m bench.loadgen_env     # prints the venv path (builds it on first use)

Built like the peer routers' venv (bench/peer_env.py's cached_venv, under ~/.cache/fleetgate, FLEETGATE_LOADGEN_VENV
overrides). The tool only runs as a separate process against a router's URL (bench/peers_sched.py
--third-party), with the tokenizer scripts/make_tiny_model.py builds locally, so nothing is fetched at run time.
"""

from __future__ import annotations

import os
from pathlib import Path

from bench.peer_env import cached_venv

LOADGEN_PACKAGE, LOADGEN_VERSION = "guidellm", "0.8.1"


def default_venv() -> Path:
    tag = f"{LOADGEN_PACKAGE}-{LOADGEN_VERSION}"
    return Path(os.environ.get("FLEETGATE_LOADGEN_VENV", Path.home() / ".cache" / "fleetgate" / f"loadgen-{tag}"))


def ensure_loadgen_env(venv: Path | None = None) -> Path:
    """The load generator's venv, built if missing or not intact; returns its path."""
    return cached_venv(venv or default_venv(), [f"{LOADGEN_PACKAGE}=={LOADGEN_VERSION}"], [LOADGEN_PACKAGE])


if __name__ == "__main__":
    print(ensure_loadgen_env())
