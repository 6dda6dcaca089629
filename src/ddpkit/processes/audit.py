"""The supervisor's side of `ddpkit run --audit` and `launch(audit=True)`: the findings
drawn from the files that every rank's hooks wrote (see `ddpkit.inrank.audit`), compared
across ranks, and the block printed after the job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddpkit.findings import Finding, Severity, format_text, summary
from ddpkit.inrank.audit import _shown

_SEVERITY = {
    "DDP101": Severity.WARNING,
    "DDP103": Severity.ERROR,
    "DDP104": Severity.WARNING,
    "DDP105": Severity.INFO,
    "DDP107": Severity.WARNING,
    "DDP109": Severity.ERROR,
    "DDP111": Severity.WARNING,
    "DDP112": Severity.ERROR,
}


def findings(folder: Path) -> list[Finding]:
    """What the ranks' audit files show, as the checker's findings, sorted."""
    logs = []
    for file in sorted(folder.glob("rank*.audit.json")):
        try:
            logs.append(json.loads(file.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue  # a rank killed while it wrote: what the others saw still counts
    logs.sort(key=lambda log: int(log["rank"]))
    found: dict[tuple[str, str, int], Finding] = {}

    def add(code: str, site: list[Any] | tuple[Any, ...], message: str) -> None:
        key = (code, str(site[0]), int(site[1]))
        if key not in found:
            path = _shown(str(site[0]))
            via = str(site[2]) if len(site) > 2 else ""
            if via:  # the library's frame, second
                message = f"{message} (from this line, inside {via})"
            found[key] = Finding(path, int(site[1]), 1, code, _SEVERITY[code], message)

    # A rank that crashed never reached its teardown: its group alive is no finding.
    crashed = any(log.get("failed") for log in logs)
    for log in logs:
        for e in log["events"]:
            if crashed and e["code"] == "DDP111":
                continue
            ranks = [str(other["rank"]) for other in logs if _has_event(other, e)]
            add(
                e["code"],
                (e["path"], e["line"], e.get("via", "")),
                f"{e['message']} (seen on rank {', '.join(ranks)})",
            )
    writers: dict[str, list[tuple[int, list[Any]]]] = {}
    for log in logs:
        for save in log["saves"]:
            writers.setdefault(save["path"], []).append((int(log["rank"]), save["site"]))
    for path, by in writers.items():
        savers = sorted({rank for rank, _ in by})
        if len(savers) > 1:
            add(
                "DDP103",
                by[0][1],
                f"ranks {', '.join(map(str, savers))} all wrote {_shown(path)} here: the same "
                "file from several processes at once (a torn or clobbered file); save on rank "
                "0 only",
            )
    _compare_weights(logs, add)
    return sorted(found.values())


def report(found: list[Finding]) -> str:
    """The block printed after an audited job: a summary line, then one line each."""
    return f"ddpkit audit: {summary(found, None)}\n{format_text(found)}"


def _has_event(log: dict[str, Any], event: dict[str, Any]) -> bool:
    return any(
        (e["code"], e["path"], e["line"]) == (event["code"], event["path"], event["line"])
        for e in log["events"]
    )


def _compare_weights(logs: list[dict[str, Any]], add: Any) -> None:
    """DDP112: the stepped parameters differ between ranks after training."""
    if len(logs) < 2:
        return
    count = min(len(log["optimizers"]) for log in logs)
    first = logs[0]
    for i in range(count):
        reference = first["optimizers"][i]
        differ = [
            log for log in logs[1:] if log["optimizers"][i]["digests"] != reference["digests"]
        ]
        if not differ:
            continue
        tensors = sum(
            a != b
            for a, b in zip(
                reference["digests"], differ[0]["optimizers"][i]["digests"], strict=False
            )
        )
        ranks = ", ".join(str(log["rank"]) for log in differ)
        unwrapped = [str(log["rank"]) for log in logs if not log["optimizers"][i]["wrapped"]]
        if len(unwrapped) == len(logs):
            cause = (
                "no DistributedDataParallel or FSDP wrapped these parameters on any rank, so "
                "nothing averaged their gradients: wrap the model "
                "(`DistributedDataParallel(model)`), or average the gradients yourself"
            )
        elif unwrapped:
            cause = (
                f"likely cause: no DistributedDataParallel wraps these parameters on rank "
                f"{', '.join(unwrapped)}, so their gradients were never averaged (a path that "
                "skips the DDP wrap, such as a CPU branch)"
            )
        else:
            cause = (
                "likely cause: a rank-dependent update: a step, a change or a random draw "
                "made on some ranks only"
            )
        add(
            "DDP112",
            reference["site"],
            f"the ranks trained different weights: after training, rank {ranks} holds "
            f"{tensors} tensor(s) stepped by this optimizer that differ from rank 0's; {cause}",
        )
