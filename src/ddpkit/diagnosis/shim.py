"""What each worker of `ddpkit run` executes:
`python -m ddpkit.diagnosis.shim (SCRIPT | -m MODULE) ARGS`.

torchrun's agent starts it once per rank. It prepares the diagnosis (a watchdog that
reports progress, a record of the exception if the script raises), then runs the
user's script or module as `__main__`, exactly as `python SCRIPT` would.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpkit.errors import RUN_WORKER


def _status_folder() -> Path | None:
    root = os.environ.get(RUN_WORKER)
    if not root:
        return None
    # Each restart of the job by the elastic agent reports into a folder of its own.
    folder = Path(root) / f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _store_publisher(rank: int) -> Callable[[dict[str, Any]], None] | None:
    """With several nodes, reports also go to the rendezvous store (see ddpkit.agent)."""
    address = os.environ.get("DDPKIT_STATUS_STORE")
    if not address:
        return None
    from datetime import timedelta

    from ddpkit.diagnosis.report import status_key
    from ddpkit.launcher import TCPStore

    host, _, port = address.rpartition(":")
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    key = status_key(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), rank)
    return lambda report: store.set(key, json.dumps(report))


def main() -> None:
    from ddpkit.diagnosis.watchdog import Watchdog, record_error, write_json
    from ddpkit.errors import PREEMPTED_EXIT, Preempted
    from ddpkit.launcher import die_with_parent, exit_now

    # Never outlive the agent, even if it is killed with SIGKILL.
    parent = os.environ.get("DDPKIT_PARENT_PID")
    die_with_parent(int(parent) if parent else None)
    args = sys.argv[1:]
    as_module = bool(args) and args[0] == "-m"
    if as_module:
        args = args[1:]
    target, rest = args[0], args[1:]
    rank = int(os.environ.get("RANK", "0"))
    folder = _status_folder()
    watchdog = None
    if folder is not None and float(os.environ.get("DDPKIT_HANG_TIMEOUT", "0")) > 0:
        watchdog = Watchdog(folder, rank, publish=_store_publisher(rank)).start()
    sys.argv = [target, *rest]
    code = 0
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(target).resolve().parent)  # as `python SCRIPT` sets it
            runpy.run_path(target, run_name="__main__")
    except Preempted as exc:  # saved after a stop signal: the agent tells the user
        code = PREEMPTED_EXIT
        if folder is not None:
            write_json(folder / f"rank{rank}.preempted.json", {"message": str(exc)})
    except SystemExit as exc:
        if exc.code not in (0, None):
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
            code = exc.code if isinstance(exc.code, int) else 1
            if folder is not None:
                record_error(folder, rank, exc)
    except BaseException as exc:
        traceback.print_exc()
        code = 1
        if folder is not None:
            record_error(folder, rank, exc)
    if code == 0 and watchdog is not None:
        watchdog.finish()  # it now waits for the others: not hung
    # Like a spawned worker of `launch`: no interpreter shutdown, which gloo's threads
    # can turn into an abort (SIGABRT) even after a clean run.
    exit_now(code)


if __name__ == "__main__":
    main()
