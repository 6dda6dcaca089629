"""On a torch whose FSDP2 cannot run on CPU ranks (before 2.7), strategy fsdp is one
line that names the fix, not a traceback from inside torch."""

from __future__ import annotations

import pytest

from ddpkit.parallel.fsdp import cpu_supported
from tests.conftest import run_cli


@pytest.mark.skipif(cpu_supported(), reason="this torch runs FSDP2 on CPU ranks")
def test_fsdp_on_cpu_with_an_old_torch_is_one_line() -> None:
    out = run_cli("train", "--example", "digits", "--strategy", "fsdp", "--nproc", "2")
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "needs torch 2.7 or newer" in lines[0], out.stderr
