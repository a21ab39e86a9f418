"""Writing benchmark results: every report records the command, the commit and the machine."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parents[1])
        # a run's own outputs (bench/results, left by an earlier run) do not make the code it ran dirty
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)bench/results"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info() -> str:
    cpu = platform.processor() or "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 1024 / 1024:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return f"{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def write_report(path: Path, title: str, command: str, body: str, commit: str | None = None) -> None:
    """`commit`: the one the run started at, for runs long enough to outlast a commit (default: now)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        f"# {title}\n\n"
        f"- command: `{command}`\n"
        f"- commit: `{commit or git_commit()}`\n"
        f"- machine: {machine_info()}\n"
        f"- date: {now}\n\n"
    )
    path.write_text(header + body.rstrip() + "\n")


def write_section(path: Path, heading: str, command: str, body: str, commit: str | None = None) -> None:
    """Replace (or append) the section `## heading` at the end of an existing report, with its own command,
    commit, machine and date: for a report whose sections come from different runs."""
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    marker = f"## {heading}\n"
    old = path.read_text() if path.exists() else ""
    head = old.split(marker, 1)[0].rstrip()
    section = (f"{marker}\n- command: `{command}`\n- commit: `{commit or git_commit()}`\n"
               f"- machine: {machine_info()}\n- date: {now}\n\n{body.rstrip()}\n")
    path.write_text((head + "\n\n" if head else "") + section)
