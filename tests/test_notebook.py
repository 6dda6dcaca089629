"""`launch` of a function defined where spawned workers cannot import it: a Jupyter
notebook's cell, `python -c`, a script read from stdin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddpkit.errors import ConfigError
from ddpkit.processes.start import start_method
from tests.conftest import ROOT

NOTEBOOK = ROOT / "tests" / "notebooks" / "launch.ipynb"

# What a user types: the function and the launch, in the interpreter's own __main__.
_INLINE = textwrap.dedent(
    """
    import threading, time
    import torch, torch.distributed as dist
    import ddpkit
    from ddpkit.errors import ConfigError

    def total(ctx, base):
        t = torch.tensor([base + ctx.rank])
        dist.all_reduce(t)
        return __name__, int(t.item())

    print("plain", *ddpkit.launch(total, 10, nprocs=2), flush=True)
    # A Jupyter kernel always runs threads of its own (heartbeat, iopub, control).
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    print("threads", *ddpkit.launch(total, 20, nprocs=2), flush=True)
    from tests.test_notebook import copy_of_main
    MARKER = True
    print("imported", ddpkit.launch(copy_of_main, nprocs=2), flush=True)
    try:
        ddpkit.launch(total, 30, nprocs=2, start="spawn")
    except ConfigError as exc:
        print("spawn:", exc, flush=True)
    """
)


def copy_of_main(ctx: object) -> str:
    """'forked' in a copy of the launching interpreter, 'spawned' in a new one."""
    return "forked" if hasattr(sys.modules["__main__"], "MARKER") else "spawned"


def _python(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return subprocess.run(
        # Python 3.12+ warns when a process with threads forks: launch forks on purpose
        # there and must not pass that warning on to the user (shown here if it does).
        [sys.executable, "-W", "always:This process:DeprecationWarning", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=ROOT,
    )


def _check_inline(out: subprocess.CompletedProcess[str], imported: str) -> None:
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # Forked: the workers are copies of this interpreter, whose __main__ has `total`.
    assert lines[:3] == ["plain __main__ 21", "threads __main__ 41", f"imported {imported}"], (
        out.stderr
    )
    assert len(lines) == 4, out.stdout
    assert lines[3].startswith("spawn: spawned workers cannot run 'total' from a notebook")
    assert "start='auto'" in lines[3] and ".py file" in lines[3]
    # No worker printed a traceback of its own (the raw pickling error).
    assert "Traceback" not in out.stderr and "Can't get attribute" not in out.stderr
    assert "multi-threaded" not in out.stderr


def test_a_function_defined_in_python_c_runs_even_with_threads() -> None:
    # A function from a file is spawned while threads run, as it is from a script.
    _check_inline(_python("-c", _INLINE), imported="spawned")


def test_a_script_read_from_stdin_runs_too() -> None:
    # From stdin no spawned worker starts (multiprocessing runs the file "<stdin>"
    # again in each): every function is forked.
    _check_inline(_python("-", stdin=_INLINE), imported="forked")


def _kernel_env(tmp_path: Path) -> dict[str, str]:
    """A kernelspec of this interpreter (the venv's), found before any installed one,
    and Jupyter's files kept out of the home folder."""
    spec = tmp_path / "jupyter" / "kernels" / "ddpkit-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "ddpkit test", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    return {
        **os.environ,
        "JUPYTER_PATH": str(tmp_path / "jupyter"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "IPYTHONDIR": str(tmp_path / "ipython"),
    }


def test_a_function_defined_in_a_notebook_cell_runs_on_two_ranks(tmp_path: Path) -> None:
    pytest.importorskip("nbconvert")
    pytest.importorskip("ipykernel")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute"),
            "--ExecutePreprocessor.kernel_name=ddpkit-test",
            "--ExecutePreprocessor.timeout=120",
            *("--output-dir", str(tmp_path), "--output", "executed"),
            str(NOTEBOOK),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        env=_kernel_env(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    cells = json.loads((tmp_path / "executed.ipynb").read_text())["cells"]
    outputs = [o for c in cells if c["cell_type"] == "code" for o in c["outputs"]]
    # A stream's text is stored as a string or as a list of lines.
    printed = "".join("".join(o["text"]) for o in outputs if o.get("name") == "stdout")
    assert printed == "result {'sum': 21, 'world': 2, 'backend': 'gloo'}\n", outputs
    # Neither a worker's traceback nor a warning about forking reached the notebook.
    assert not [o for o in outputs if o.get("name") == "stderr"], outputs


def test_a_notebook_after_cuda_was_initialised_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No GPU here: the rule itself, with torch told that CUDA is initialised. A fork
    # would copy a CUDA context the workers cannot use, and spawn cannot import `f`.
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError) as info:
        start_method("auto", "gloo", unimportable="f")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("cannot start workers from a notebook after CUDA was initialised")
    assert "restart the kernel" in message and "move 'f' into a .py file" in message
    with pytest.raises(ConfigError, match="forked ones cannot use CUDA"):
        start_method("auto", "nccl", unimportable="f")


def test_a_forkserver_asked_for_by_name_refuses_a_notebooks_function() -> None:
    # Its workers, like spawned ones, import `fn` from a file; one from a cell has none.
    with pytest.raises(ConfigError, match=r"^forkserver workers cannot run 'f' from a notebook"):
        start_method("forkserver", "gloo", unimportable="f")
