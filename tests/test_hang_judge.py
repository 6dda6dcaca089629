"""HangJudge on hand-made reports: the race between a sample and a collective ending
must never read as a hang (seen in CI: rank 0 passed the barrier and returned, while
rank 1's last sample, taken just before, still showed it in that barrier). The reports
that real ranks write, and the judge's verdicts on them: tests/test_hang_watch.py."""

from __future__ import annotations

from typing import Any

from ddpkit.processes.report import HangJudge

NOW = 1000.0


def _finished(since: float, done: int) -> dict[str, Any]:
    return {"state": "finished", "since": since, "collectives_done": done, "collective": None}


def _waiting(seq: int, since: float) -> dict[str, Any]:
    return {
        "state": "running",
        "sampled": NOW - 0.5,
        "moved": since,
        "active": since,
        "collective": {"name": "barrier", "seq": seq, "where": "job.py:3", "since": since},
    }


def test_a_rank_that_just_finished_is_not_a_hang_for_a_rank_in_a_long_collective() -> None:
    judge = HangJudge(hang_timeout=5.0, world_size=2)
    statuses = {0: _finished(NOW, done=1), 1: _waiting(seq=1, since=NOW - 20)}
    assert judge.judge(statuses, now=NOW) == (None, None)


def test_a_rank_waiting_for_one_that_finished_long_ago_is_a_hang() -> None:
    judge = HangJudge(hang_timeout=5.0, world_size=2)
    statuses = {0: _finished(NOW - 6, done=0), 1: _waiting(seq=1, since=NOW - 20)}
    hang, _ = judge.judge(statuses, now=NOW)
    assert hang is not None and "finished" in hang.why


def test_ranks_in_different_collectives_are_a_hang_once_the_last_has_waited() -> None:
    judge = HangJudge(hang_timeout=5.0, world_size=2)
    statuses = {0: _waiting(seq=4, since=NOW - 60), 1: _waiting(seq=5, since=NOW - 1)}
    assert judge.judge(statuses, now=NOW)[0] is None  # rank 1 was busy until a second ago
    hang, _ = judge.judge(statuses, now=NOW + 5)
    assert hang is not None and "different collectives" in hang.why


def _parked(since: float) -> dict[str, Any]:
    """Idle at one line since `since`: no CPU, no reading, no child, in no collective."""
    return {"state": "running", "sampled": NOW - 0.5, "moved": since, "active": since}


def test_rank_0_alone_after_launch_released_the_others_is_never_a_hang() -> None:
    # Under `ddpkit run`, ranks 1.. end after `launch` ("released") and rank 0 goes on
    # alone (an upload, an idle wait) as long as it likes: no rank waits for it.
    judge = HangJudge(hang_timeout=5.0, world_size=3)
    released = {**_finished(NOW - 60, 1), "state": "released"}
    statuses = {0: _parked(NOW - 60), 1: released, 2: released}
    assert judge.judge(statuses, now=NOW) == (None, None)
    # A rank that merely finished still waits for the others: then it is a hang.
    hang, _ = judge.judge({**statuses, 2: _finished(NOW - 60, 1)}, now=NOW)
    assert hang is not None and "stayed at one line" in hang.why


def test_a_rank_waiting_for_an_idle_child_is_uncertain_and_said_so() -> None:
    # Its stack is still, yet the child (a sleep, a stalled download) may end: the
    # watch reports it as moving, with child_wait, as a polling rank.
    judge = HangJudge(hang_timeout=5.0, world_size=2, collective_timeout=30.0)
    child = {**_parked(NOW - 20), "moved": NOW - 0.5, "child_wait": True, "where": "job.py:5"}
    statuses = {0: child, 1: _waiting(seq=1, since=NOW - 20)}
    hang, notice = judge.judge(statuses, now=NOW)
    assert hang is None and notice is not None
    assert "rank 0 is waiting for an idle child process at job.py:5" in notice
    hang, _ = judge.judge({**statuses, 1: _waiting(seq=1, since=NOW - 28)}, now=NOW)
    assert hang is not None
    assert "kept waiting for an idle child process; stopped at the collective timeout" in hang.why
