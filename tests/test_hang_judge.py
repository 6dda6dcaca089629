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
    assert hang is not None
    assert (
        hang.why
        == "rank 1 waited 20 s in a collective that rank 0 will never call: it has finished"
    )
    summary = hang.summary(2)
    assert "rank 0: finished 6 s ago: it calls no more collectives" in summary
    assert "look for a `return` or `break` under a rank check, or a loop that runs" in summary
    assert "(it has finished: no stack to show)" in hang.stacks()


def test_ranks_in_different_collectives_are_a_hang_once_the_last_has_waited() -> None:
    judge = HangJudge(hang_timeout=5.0, world_size=2)
    statuses = {0: _waiting(seq=4, since=NOW - 60), 1: _waiting(seq=5, since=NOW - 1)}
    assert judge.judge(statuses, now=NOW)[0] is None  # rank 1 was busy until a second ago
    hang, _ = judge.judge(statuses, now=NOW + 5)
    assert hang is not None and hang.why == "the ranks have waited 65 s in different collectives"
    assert "every rank must call the same collectives in the same order" in hang.summary(2)


def test_ranks_in_the_same_collective_are_a_hang_that_names_what_to_check() -> None:
    judge = HangJudge(hang_timeout=5.0, world_size=2)
    statuses = {0: _waiting(seq=4, since=NOW - 60), 1: _waiting(seq=4, since=NOW - 30)}
    hang, _ = judge.judge(statuses, now=NOW)
    assert hang is not None and hang.why == "every rank has waited 60 s in the same collective"
    assert hang.summary(2).endswith(
        "  every rank called it, yet it does not complete: the connection between the ranks "
        "may be stuck (with NCCL, NCCL_DEBUG=INFO says more); if the collective is only slow, "
        "raise the hang timeout (--hang-timeout, or hang_timeout= in Python)"
    )


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
    assert "rank 1: done: `launch` let it go, and rank 0 goes on alone" in hang.summary(3)


def test_a_rank_idle_at_one_line_is_described_with_what_to_do() -> None:
    judge = HangJudge(hang_timeout=5.0, world_size=2)
    statuses = {0: {**_parked(NOW - 60), "where": "job.py:7"}, 1: _waiting(seq=2, since=NOW - 60)}
    hang, notice = judge.judge(statuses, now=NOW)
    assert hang is not None and notice is None
    assert hang.why == (
        "rank 1 waited 60 s while rank 0 stayed at one line without using the CPU (in any "
        "thread or child process) or reading data"
    )
    assert hang.summary(2).splitlines()[1:] == [
        "  rank 0: not in a collective: idle (no CPU, no data read) at job.py:7",
        "  rank 1: in barrier (collective #2) at job.py:3",
        "  rank 1 waits in barrier #2; rank 0 never reached it",
        "  rank 0 is blocked in a call (a deadlocked lock, a queue that stays empty, a long "
        "sleep): its stack below shows which; if that call would have returned, raise the hang "
        "timeout (--hang-timeout, or hang_timeout= in Python) above its wait",
    ]


def _working(where: str) -> dict[str, Any]:
    return {**_parked(NOW - 60), "active": NOW - 0.5, "where": where}


def test_a_notice_says_who_waits_for_whom_and_what_comes_of_it() -> None:
    judge = HangJudge(hang_timeout=5.0, world_size=3, collective_timeout=1800.0)
    waiting = _waiting(seq=1, since=NOW - 20)
    statuses = {0: _working("prep.py:4"), 1: waiting, 2: _working("prep.py:9")}
    hang, notice = judge.judge(statuses, now=NOW)
    assert hang is None
    assert notice == (
        "ddpkit: notice: rank 1 has waited 20 s for ranks 0, 2: rank 0 is busy (using the "
        "CPU or reading data) at prep.py:4; rank 2 is busy (using the CPU or reading data) "
        "at prep.py:9; waiting: rank 1: in barrier (collective #1) at job.py:3. Nothing is "
        "stopped while a rank works; work that rank 0 must do before the others (a download, "
        "a data cache) belongs in `ddpkit.rank_zero_first()`, where the wait is expected and "
        "no notice is printed"
    )
    # One rank that may wait for something that never comes: when the job is stopped.
    judge = HangJudge(hang_timeout=5.0, world_size=3, collective_timeout=1800.0)
    statuses[2] = {**_parked(NOW - 60), "moved": NOW - 0.5, "where": "poll.py:2"}
    _, notice = judge.judge(statuses, now=NOW)
    assert notice is not None
    assert "rank 2 is polling (it wakes up, but uses no CPU) at poll.py:2" in notice
    assert notice.endswith(
        "If rank 2 is waiting for something that never comes, the job is stopped at the "
        "collective timeout, in 1777 s"
    )
    # A rank whose watch has not reported for a while holds Python's lock.
    judge = HangJudge(hang_timeout=5.0, world_size=2)
    silent = {**_working("big.py:1"), "sampled": NOW - 30}
    _, notice = judge.judge({0: silent, 1: waiting}, now=NOW)
    assert notice is not None
    assert (
        "rank 0 is in one long call that holds Python's lock (ddpkit cannot tell whether it "
        "works) at big.py:1" in notice
    )
    assert notice.endswith("the job is stopped at the collective timeout")


def test_a_rank_waiting_for_an_idle_child_is_uncertain_and_said_so() -> None:
    # Its stack is still, yet the child (a sleep, a stalled download) may end: the
    # watch reports it as moving, with child_wait, as a polling rank.
    judge = HangJudge(hang_timeout=5.0, world_size=2, collective_timeout=30.0)
    child = {**_parked(NOW - 20), "moved": NOW - 0.5, "child_wait": True, "where": "job.py:5"}
    statuses = {0: child, 1: _waiting(seq=1, since=NOW - 20)}
    hang, notice = judge.judge(statuses, now=NOW)
    assert hang is None and notice is not None
    assert "rank 0 is waiting for a child process that uses no CPU at job.py:5" in notice
    hang, _ = judge.judge({**statuses, 1: _waiting(seq=1, since=NOW - 28)}, now=NOW)
    assert hang is not None
    assert hang.why == (
        "rank 1 waited 28 s for rank 0, which stayed waiting for a child process that uses no "
        "CPU; stopped at the collective timeout (30 s), where the waits would fail anyway"
    )
    assert hang.summary(2).endswith(
        "  its stack below shows what rank 0 waited for instead of the collective (a file, a "
        "service, a child process?)"
    )


def test_ranks_in_the_same_place_are_said_once_above_four_ranks() -> None:
    from ddpkit.processes.report import _grouped, _ranks

    assert _ranks([3]) == "rank 3"
    assert _ranks([1, 0]) == "ranks 0, 1"
    assert _ranks([*range(7), *range(8, 32)]) == "ranks 0-6, 8-31"
    assert _ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7, 8"
    few = {0: "in barrier", 1: "in barrier"}
    assert _grouped(few) == [("rank 0", "in barrier"), ("rank 1", "in barrier")]
    many = {rank: "in barrier" for rank in range(32) if rank != 7} | {7: "idle"}
    assert _grouped(many) == [("ranks 0-6, 8-31", "in barrier"), ("rank 7", "idle")]
