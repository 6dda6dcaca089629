"""What an NCCL job needs so that a hang says where it is.

An NCCL collective returns as soon as its kernel is queued: a rank whose peer never
comes waits on the GPU, not in Python, so ddpkit's watch sees only the calls that block
the CPU (barrier, the object collectives). NCCL's own watchdog sees every collective:
once one has waited the group's timeout, it prints which one ("Watchdog caught
collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, ...)"), its flight
recorder can write the last collectives of each rank to a file, and it ends the rank
(SIGABRT). With the group's timeout left at `launch(timeout=...)`, ddpkit's hang
timeout (shorter) stopped the job first, and nothing said which collective waited.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from ddpkit.versions import release

# How much of the hang timeout NCCL's watchdog gets before ddpkit's own stop, to print
# its message and write the dump: at most this many seconds, at most half of it.
_WATCHDOG_LEAD_S = 30.0
# Entries the flight recorder keeps (the default of torch 2.7 and later; 2.6 keeps none).
_TRACE_ENTRIES = "2000"

# torch renamed the flight recorder's settings (TORCH_NCCL_TRACE_BUFFER_SIZE became
# TORCH_FR_BUFFER_SIZE); newer releases read both but warn about the old names. 2.11 is
# the first release known to read the new ones; before it the old ones are used, which
# the releases in between still read.
_NEW_NAMES = release(torch.__version__) >= (2, 11)
_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
_DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
# The flight recorder's files, one per rank: this prefix and the rank.
TRACE_PREFIX = "nccl_trace_rank_"


def nccl_watch(
    backend: str,
    hang_timeout: float,
    collective_timeout: float,
    folder: Path | None,
    environ: Mapping[str, str],
) -> tuple[dict[str, str], float]:
    """(environment variables to add, the group's timeout) for a worker of `backend`.

    On NCCL the group's timeout is set below `hang_timeout`, so that NCCL's watchdog
    names the collective that waits before ddpkit stops the job (`hang_timeout` 0, the
    timer off: `collective_timeout` stays). With a `folder`, the flight recorder is on
    and dumps into it on a timeout. A setting the user made is never replaced: if any
    name of one is set (torch's old or new), it is left out. Other backends: nothing.
    """
    if backend != "nccl":
        return {}, collective_timeout
    timeout = collective_timeout
    if hang_timeout > 0:
        timeout = min(collective_timeout, hang_timeout - min(_WATCHDOG_LEAD_S, hang_timeout / 2))
    env: dict[str, str] = {}
    if folder is not None:
        wanted = {
            _BUFFER: _TRACE_ENTRIES,
            _DUMP_ON_TIMEOUT: "1",
            _DUMP_FILE: str(folder / TRACE_PREFIX),
        }
        for names, value in wanted.items():
            if not any(name in environ for name in names):
                env[names[0] if _NEW_NAMES else names[-1]] = value
    return env, timeout
