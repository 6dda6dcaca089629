"""`ddpkit run --audit`: real training scripts on 2 CPU ranks, each finding where marked.

Every script in audit_scripts/ marks the line that the audit must report with a
trailing `# audit: DDPnnn`; the clean_*.py scripts have no marker and must come out
clean. All the scripts succeed, and a plain `--audit` never changes the exit status:
only `--audit=strict` turns findings into exit status 3.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli

SCRIPTS = Path(__file__).parent / "audit_scripts"
_MARKER = re.compile(r"# audit: (DDP\d{3})\b")

# The finding each faulty script is written to produce (a guard against a lost marker).
FAULTY = {
    "skips_ddp_wrap.py": "DDP112",
    "no_set_epoch.py": "DDP101",
    "save_every_rank.py": "DDP103",
    "wrapper_state_dict.py": "DDP104",
    "never_destroyed.py": "DDP111",
}
CLEAN = ("clean_tutorial.py", "clean_nanogpt.py")
FIELDS = {"path", "line", "col", "code", "severity", "message"}


def _markers(script: Path) -> set[tuple[str, int, str]]:
    """(file name, line, code) of every `# audit: CODE` in `script`."""
    return {
        (script.name, number, match.group(1))
        for number, line in enumerate(script.read_text().splitlines(), 1)
        for match in _MARKER.finditer(line)
    }


def _audit(script: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`ddpkit run --nproc 2 FLAGS SCRIPT` from `tmp_path`, the script's files there too.

    A single-node `ddpkit run` serves its rendezvous on a port the OS picks, so runs at
    the same time never collide; no MASTER_PORT is needed.
    """
    return run_cli(
        "run",
        "--nproc",
        "2",
        *flags,
        str(script),
        timeout=120,
        env={"AUDIT_OUT": str(tmp_path), "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )


def _findings(stdout: str) -> list[dict[str, Any]]:
    """The JSON list of findings that `--audit --format json` prints last on stdout
    (it may span lines; the ranks' own `[rank N] ...` lines come before it)."""
    decoder = json.JSONDecoder()
    starts = [0, *(match.end() for match in re.finditer("\n", stdout))]
    for start in reversed(starts):
        if not stdout.startswith("[", start):
            continue
        try:
            value, end = decoder.raw_decode(stdout, start)
        except json.JSONDecodeError:
            continue
        if isinstance(value, list) and not stdout[end:].strip():
            return value
    pytest.fail(f"no JSON list of findings at the end of stdout:\n{stdout[-3000:]}")


def test_every_script_marks_what_it_is_written_for() -> None:
    assert sorted(p.name for p in SCRIPTS.glob("*.py")) == sorted([*FAULTY, *CLEAN])
    for name, code in FAULTY.items():
        assert [c for _, _, c in _markers(SCRIPTS / name)] == [code], name
    for name in CLEAN:
        text = (SCRIPTS / name).read_text()
        assert _markers(SCRIPTS / name) == set(), name
        assert "BatchNorm" not in text, f"{name}: an unsynchronised BatchNorm is DDP105"


@pytest.mark.parametrize(
    "name", [*FAULTY, *(pytest.param(name, marks=pytest.mark.slow) for name in CLEAN)]
)
def test_the_audit_reports_exactly_the_marked_lines(name: str, tmp_path: Path) -> None:
    script = SCRIPTS / name
    out = _audit(script, tmp_path, "--audit", "--format", "json")
    assert out.returncode == 0, out.stderr[-3000:]  # the audit never changes it
    found = _findings(out.stdout)
    for finding in found:
        assert set(finding) == FIELDS, finding
        assert finding["severity"] in ("error", "warning", "info"), finding
    got = {(Path(f["path"]).name, f["line"], f["code"]) for f in found}
    expected = _markers(script)
    details = json.dumps(found, indent=1)
    assert got == expected, f"missing {sorted(expected - got)}, found:\n{details}"


def test_a_strict_audit_with_a_finding_exits_3(tmp_path: Path) -> None:
    script = SCRIPTS / "save_every_rank.py"
    out = _audit(script, tmp_path, "--audit=strict")
    assert out.returncode == 3, out.stderr[-3000:]
    ((_, line, code),) = _markers(script)
    where = re.compile(rf"save_every_rank\.py:{line}:\d+: {code} ")
    assert where.search(out.stdout + out.stderr), out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "model.pt").is_file()  # the script itself ran to its end


def test_without_audit_a_run_prints_no_findings(tmp_path: Path) -> None:
    out = _audit(SCRIPTS / "save_every_rank.py", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DDP103" not in out.stdout + out.stderr
    assert (tmp_path / "model.pt").is_file()


def test_check_marks_what_an_audited_run_confirmed(tmp_path: Path) -> None:
    script = SCRIPTS / "save_every_rank.py"
    logs = tmp_path / "logs"
    run = _audit(script, tmp_path, "--audit", "--log-dir", str(logs))
    assert run.returncode == 0, run.stderr
    checked = run_cli("check", "--audit-log", str(logs), str(script), cwd=tmp_path)
    (line,) = [ln for ln in checked.stdout.splitlines() if " DDP103 " in ln]
    assert line.startswith(f"{script}:62:") and line.endswith("[confirmed at run time]")
    missing = run_cli("check", "--audit-log", str(tmp_path / "none"), str(script))
    assert missing.returncode == 2 and "ddpkit run --audit --log-dir" in missing.stderr


def _train(model: Any, rank: int) -> None:
    """A few SGD steps on data of this rank's own."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 4, generator=generator)).pow(2).mean().backward()
        optimizer.step()


def _unwrapped_job(ctx: Any, path: str) -> None:
    """Each rank trains its own copy on its own data (no DDP) and saves to one path."""
    import torch

    model = torch.nn.Linear(4, 1)
    _train(model, ctx.rank)
    torch.save(model.state_dict(), path)


def _wrapped_job(ctx: Any, path: str) -> None:
    import torch

    import ddpkit

    model = ddpkit.prepare_model(torch.nn.Linear(4, 1), ctx)
    _train(model, ctx.rank)
    if ctx.rank == 0:
        torch.save(ddpkit.unwrap(model).state_dict(), path)


def test_launch_audits_its_workers(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    import ddpkit

    ddpkit.launch(_unwrapped_job, str(tmp_path / "m.pt"), nprocs=2, audit=True)
    err = capfd.readouterr().err
    assert "ddpkit audit: 2 findings (2 errors)" in err
    codes = re.findall(r"test_audit\.py:(\d+):1: (DDP\d{3}) ", err)
    assert [code for _, code in codes] == ["DDP112", "DDP103"]
    ddpkit.launch(_wrapped_job, str(tmp_path / "w.pt"), nprocs=2, audit=True)
    assert "ddpkit audit: no findings" in capfd.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("example", ["linear", "digits"])
def test_ddpkits_own_examples_come_out_clean(example: str, tmp_path: Path) -> None:
    run = run_cli(
        "run",
        "--nproc",
        "2",
        "--audit",
        "-m",
        "ddpkit",
        "train",
        "--example",
        example,
        "--epochs",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        timeout=300,
        env={"OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert "ddpkit audit: no findings" in run.stdout


def test_a_run_that_ended_well_keeps_a_static_hang_a_warning(tmp_path: Path) -> None:
    from ddpkit.findings import Finding, Severity, confirm, read_audit_log, write_audit_log

    hang = Finding("t.py", 7, 5, "DDP106", Severity.ERROR, "`dist.barrier()` runs only on ...")
    save = Finding("t.py", 9, 1, "DDP103", Severity.ERROR, "`torch.save` runs on every rank")
    write_audit_log(tmp_path, [save], 0)
    audited, status = read_audit_log(tmp_path)
    kept_hang, kept_save = confirm([hang, save], audited, status)
    assert kept_hang.severity is Severity.WARNING and "without a hang" in kept_hang.message
    assert kept_save.severity is Severity.ERROR
    assert kept_save.message.endswith("[confirmed at run time]")
    # A run that hung (124) contradicts nothing.
    (still,) = confirm([hang], [], 124)
    assert still == hang


# -- --audit=strict keeps the job's own exit status -----------------------------------
# A Trainer job that commits a pitfall, trains, then ends as `sys.argv[2]` says: "preempted" (a
# SIGTERM reaches rank 1, every rank saves and exits 75), "crash" (rank 1 raises),
# "hang" (rank 0 waits in a barrier that rank 1 never calls), "clean". Its pitfall:
# "error" (every rank saves one file: DDP103) or "info" (BatchNorm left unsynchronised
# in a DDP of the script's own: DDP105).
STRICT_JOB = """
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpkit


class Ending(ddpkit.Callback):
    def on_step_end(self, trainer, step):
        if step == 3 and sys.argv[2] == "preempted" and trainer.ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def main(ctx, folder, ending, pitfall):
    ddpkit.seed_everything(5)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.GELU(), nn.Linear(8, 1))
    g = torch.Generator().manual_seed(9)
    x = torch.randn(96, 6, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :3].sum(1, keepdim=True))
    config = ddpkit.TrainConfig(epochs=40 if ending == "preempted" else 1, batch_size=4,
                                checkpoint_dir=folder, progress=False)
    if pitfall == "error":
        os.makedirs(folder, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(folder, "initial.pt"))  # every rank
    else:
        bn = DDP(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)))
        bn(torch.randn(8, 6)).sum().backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ddpkit.Trainer(model, optimizer, data, ctx, config, loss_fn=nn.functional.mse_loss,
                   callbacks=[Ending()], log_fn=lambda s: None).fit()
    if ending == "crash" and ctx.rank == 1:
        raise ValueError("a bad batch")
    if ending == "hang" and ctx.rank == 0:
        dist.barrier()


if __name__ == "__main__":
    ddpkit.launch(main, sys.argv[1], sys.argv[2], sys.argv[3])
"""


@pytest.mark.parametrize(
    ("ending", "pitfall", "code"),
    [
        ("preempted", "error", 75),
        ("crash", "error", 1),
        ("hang", "error", 124),
        ("clean", "info", 0),
    ],
)
@pytest.mark.slow
def test_a_strict_audit_keeps_the_jobs_own_exit_status(
    tmp_path: Path, ending: str, pitfall: str, code: int
) -> None:
    # Strict fails (3) only a job that ended on its own with 0, and only for warnings
    # and errors: a preempted job must still end with 75 for its requeue, a crash with
    # 1 and a hang with 124; an info is no failure. The findings are still reported.
    script = tmp_path / "job.py"
    script.write_text(STRICT_JOB)
    folder = str(tmp_path / "ck")
    out = run_cli(
        *("run", "--nproc", "2", "--audit=strict", "--hang-timeout", "3"),
        *(str(script), folder, ending, pitfall),
        timeout=120,
        env={"OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert out.returncode == code, out.stderr[-3000:]
    said = out.stdout + out.stderr
    assert ("DDP103" if pitfall == "error" else "DDP105") in said, said[-3000:]


# -- findings inside a library point at the user's line (issue 42, item 7) ---------------
# A stand-in for an installed training library in Accelerate's shape: the calls that
# reach torch (the optimizer's step, torch.save) are made in its file, not the script's.
LIBRARY = """
import torch


class AcceleratedOptimizer:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        self.optimizer.step()  # library: step


class Accelerator:
    def prepare(self, optimizer):
        return AcceleratedOptimizer(optimizer)

    def save(self, obj, path):
        torch.save(obj, path)  # library: save
"""

# A torchrun-style script on that library. It wraps nothing in DDP (as a port that
# forgot `accelerator.prepare(model)`), each rank draws its own batches, and every rank
# saves: DDP112 at its step, DDP103 at its save, both reached inside the library.
LIBRARY_USER = """
import torch
import torch.distributed as dist
from torch import nn

from minacc import Accelerator


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.1), nn.GELU(), nn.Linear(12, 3))
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer.optimizer, T_max=4)
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        x = torch.randn(8, 6, generator=g)
        batch = {"x": x, "label": torch.randint(0, 3, (8,), generator=g)}
        loss = nn.functional.cross_entropy(model(batch["x"]), batch["label"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # audit: DDP112
        scheduler.step()
    accelerator.save(model.state_dict(), "model.pt")  # audit: DDP103
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def _line_of(text: str, marker: str) -> int:
    (line,) = [n for n, row in enumerate(text.splitlines(), 1) if marker in row]
    return line


@pytest.mark.slow
@pytest.mark.parametrize("installed", ["site-packages", "sys.path"])
def test_a_finding_inside_a_library_points_at_the_users_line(
    tmp_path: Path, installed: str
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    script = project / "train.py"
    script.write_text(LIBRARY_USER)
    # Installed in a venv inside the project (site-packages, even under the current
    # folder, is not the user's), or a folder on PYTHONPATH beside it.
    if installed == "site-packages":
        libs = project / ".venv" / "lib" / "python3.11" / "site-packages"
    else:
        libs = tmp_path / "vendor"
    (libs / "minacc").mkdir(parents=True)
    (libs / "minacc" / "__init__.py").write_text(LIBRARY)
    out = run_cli(
        *("run", "--nproc", "2", "--audit", "--format", "json", str(script)),
        timeout=120,
        env={"PYTHONPATH": os.pathsep.join([str(libs), os.environ.get("PYTHONPATH", "")])},
        cwd=project,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = _findings(out.stdout)
    got = {(Path(f["path"]).name, f["line"], f["code"]) for f in found}
    assert got == _markers(script), json.dumps(found, indent=1)
    by_code = {f["code"]: f["message"] for f in found}
    # The library's frame comes second, in the message.
    step, save = _line_of(LIBRARY, "library: step"), _line_of(LIBRARY, "library: save")
    assert f"minacc/__init__.py:{step}" in by_code["DDP112"], by_code["DDP112"]
    assert f"minacc/__init__.py:{save}" in by_code["DDP103"], by_code["DDP103"]
    # No DDP wrap on any rank: the finding names the missing wrap, not another cause.
    assert "no DistributedDataParallel or FSDP wrapped" in by_code["DDP112"], by_code["DDP112"]
    assert "on any rank" in by_code["DDP112"] and "rank-dependent" not in by_code["DDP112"]


@pytest.mark.slow
def test_a_ddp_wrap_skipped_on_every_rank_is_named(tmp_path: Path) -> None:
    # imagenet's main.py on CPU: the script destroys its group itself, after which the
    # audit no longer holds the parameters (it named "a rank-dependent update").
    out = _audit(SCRIPTS / "skips_ddp_wrap.py", tmp_path, "--audit", "--format", "json")
    assert out.returncode == 0, out.stderr[-3000:]
    (finding,) = _findings(out.stdout)
    assert finding["code"] == "DDP112"
    assert (
        "no DistributedDataParallel or FSDP wrapped these parameters on any rank"
        in (finding["message"])
    ), finding["message"]
    assert "wrap the model" in finding["message"]


# -- a crashed run is no forgotten teardown; the audit's frames stay out of tracebacks ----
# The DDP tutorial's multigpu_torchrun.py shape (its own group and DDP, destroyed at the
# end), that crashes as `sys.argv[1]` says: "raise" (rank 1 meets a bad batch at step 2),
# "load" (a resume from a checkpoint that is not there: torch.load raises in every rank).
CRASHING = """
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main(how):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(5, 7), nn.Dropout(0.2), nn.Tanh(), nn.Linear(7, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if how == "load":
        model.module.load_state_dict(torch.load("snapshot.pt"))  # crash: load
    for step in range(4):
        if how == "raise" and rank == 1 and step == 2:
            raise ValueError("a bad batch")  # crash: raise
        x = torch.randn(6, 5)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "load"])
def test_a_crashed_run_gets_no_teardown_warning_and_no_audit_frames(
    tmp_path: Path, how: str
) -> None:
    script = tmp_path / "multigpu_torchrun.py"
    script.write_text(CRASHING)
    out = run_cli(
        *("run", "--nproc", "2", "--audit", str(script), how),
        timeout=120,
        env={"OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    said = out.stdout + out.stderr
    assert out.returncode == 1, said[-3000:]
    # The script destroys its group at its end, which a crash never reaches.
    assert "DDP111" not in said and "still alive" not in said, said[-3000:]
    # The traceback shows the user's frames only: not the audit's hooks around torch.
    crash_line = _line_of(CRASHING, f"crash: {how}")
    assert f'multigpu_torchrun.py", line {crash_line}' in out.stderr, out.stderr[-3000:]
    assert "audit.py" not in out.stderr and "audited_" not in out.stderr, out.stderr[-3000:]
