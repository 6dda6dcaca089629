"""Shared helpers: run the CLI in a subprocess, check that processes are gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(
    *args: str, timeout: float = 240, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m ddpkit ARGS` as a user would run it; returns the finished process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
    )


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie awaiting its parent's wait()."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids: list[int], within: float = 10.0) -> list[int]:
    """The pids still alive after `within` seconds (empty when all are gone)."""
    deadline = time.monotonic() + within
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        time.sleep(0.1)
    return alive


def wait_for_files(paths: list[Path], within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not all(p.exists() and p.stat().st_size > 0 for p in paths):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {paths}")
        time.sleep(0.05)
