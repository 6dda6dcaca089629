"""Config files (TOML) and `--job module:function`: what is accepted, and every error."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import textwrap
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ddpkit.cli.config_file import load_config_file, merge_config
from ddpkit.errors import ConfigError
from ddpkit.examples import linear as linear_example
from ddpkit.training.config import TrainConfig, validate_options
from ddpkit.training.jobspec import load_job
from tests.conftest import run_cli

VALID_KEYS = [f.name for f in dataclasses.fields(TrainConfig) if f.init]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(fn: Callable[[], object]) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    return str(info.value)


# -- load_config_file: accepted files -------------------------------------------------


def test_options_at_top_level(tmp_path: Path) -> None:
    path = write(
        tmp_path / "job.toml",
        """
        # a comment
        epochs = 3
        batch_size = 8
        checkpoint_dir = "ckpt"
        resume = true
        progress = false
        """,
    )
    values = load_config_file(path)
    assert values == {
        "epochs": 3,
        "batch_size": 8,
        "checkpoint_dir": "ckpt",
        "resume": True,
        "progress": False,
    }
    # The values build a TrainConfig as they are.
    assert TrainConfig(**values).epochs == 3


def test_options_under_train_table(tmp_path: Path) -> None:
    path = write(
        tmp_path / "job.toml",
        """
        [train]
        epochs = 5
        seed = 7
        """,
    )
    assert load_config_file(str(path)) == {"epochs": 5, "seed": 7}


def test_empty_file_and_empty_train_table_set_nothing(tmp_path: Path) -> None:
    assert load_config_file(write(tmp_path / "empty.toml", "")) == {}
    assert load_config_file(write(tmp_path / "table.toml", "[train]\n")) == {}


def test_int_for_a_float_field_is_taken_as_float(tmp_path: Path) -> None:
    hints = typing.get_type_hints(TrainConfig)
    floats = [f for f in VALID_KEYS if float in (hints[f], *typing.get_args(hints[f]))]
    if not floats:
        pytest.skip("TrainConfig has no float field")
    name = floats[0]
    values = load_config_file(write(tmp_path / "job.toml", f"{name} = 2\n"))
    assert values == {name: 2.0} and type(values[name]) is float


# -- load_config_file: errors ---------------------------------------------------------


def test_top_level_options_and_train_table_together_are_rejected(tmp_path: Path) -> None:
    path = write(
        tmp_path / "job.toml",
        """
        epochs = 3
        [train]
        batch_size = 8
        """,
    )
    message = error_of(lambda: load_config_file(path))
    assert str(path) in message
    assert "both a [train] table and options at the top level (epochs)" in message
    assert "put every option under [train]" in message


def test_another_table_beside_train_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path / "job.toml", "[train]\nepochs = 3\n[model]\nwidth = 4\n")
    assert "top level (model)" in error_of(lambda: load_config_file(path))


def test_train_that_is_not_a_table_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path / "job.toml", "train = 3\n")
    message = error_of(lambda: load_config_file(path))
    assert "'train' must be a table (got 3, an int)" in message
    assert "[train]" in message


def test_unknown_key_names_file_key_closest_and_all_valid(tmp_path: Path) -> None:
    path = write(tmp_path / "job.toml", "epochs = 3\nbatchsize = 8\n")
    message = error_of(lambda: load_config_file(path))
    assert f"config file '{path}'" in message
    assert "unknown option 'batchsize'" in message
    assert "did you mean 'batch_size'?" in message
    assert "valid options are " + ", ".join(VALID_KEYS) in message


def test_unknown_key_under_train_table(tmp_path: Path) -> None:
    path = write(tmp_path / "job.toml", "[train]\nepoch = 3\n")
    message = error_of(lambda: load_config_file(path))
    assert "unknown option 'epoch'" in message and "did you mean 'epochs'?" in message


def test_dashed_key_suggests_the_underscored_option(tmp_path: Path) -> None:
    path = write(tmp_path / "job.toml", "num-workers = 2\n")
    assert "did you mean 'num_workers'?" in error_of(lambda: load_config_file(path))


def test_unknown_key_with_nothing_close_has_no_guess(tmp_path: Path) -> None:
    path = write(tmp_path / "job.toml", "learning_rate_of_the_model = 0.1\n")
    message = error_of(lambda: load_config_file(path))
    assert "unknown option 'learning_rate_of_the_model'" in message
    assert "did you mean" not in message and "valid options are" in message


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('batch_size = "ten"', "batch_size must be an integer (got 'ten', a str)"),
        ("batch_size = true", "batch_size must be an integer (got True, a bool)"),
        ("batch_size = 2.5", "batch_size must be an integer (got 2.5, a float)"),
        ("batch_size = [1, 2]", "batch_size must be an integer (got [1, 2], a list)"),
        ("resume = 1", "resume must be a boolean (got 1, an int)"),
        ('resume = "yes"', "resume must be a boolean (got 'yes', a str)"),
        ("progress = 0", "progress must be a boolean or None (got 0, an int)"),
        ("checkpoint_dir = 3", "checkpoint_dir must be a string or None (got 3, an int)"),
        ("checkpoint_dir = 1979-05-27", "checkpoint_dir must be a string or None (got "),
        ("seed = {a = 1}", "seed must be an integer (got {'a': 1}, a dict)"),
        ('precision = "fp8"', "precision must be one of 32, bf16, fp16 (got 'fp8')"),
        ("precision = 16", "precision must be one of 32, bf16, fp16 (got 16, an int)"),
        ("batch_size = 0", "batch_size must be >= 1 (got 0)"),
        ("clip_grad_norm = -1", "clip_grad_norm must be > 0 (got -1)"),
    ],
)
def test_wrong_value_names_key_expected_type_and_value(
    tmp_path: Path, line: str, expected: str
) -> None:
    path = write(tmp_path / "job.toml", line + "\n")
    message = error_of(lambda: load_config_file(path))
    assert f"config file '{path}': " + expected in message


def test_wrong_value_shows_how_to_set_it(tmp_path: Path) -> None:
    message = error_of(lambda: load_config_file(write(tmp_path / "a.toml", "batch_size = true\n")))
    assert message.endswith("pass --batch-size 32")
    message = error_of(lambda: load_config_file(write(tmp_path / "b.toml", "progress = 1\n")))
    assert message.endswith("pass --progress or --no-progress, or leave it out")


def test_toml_dates_are_named(tmp_path: Path) -> None:
    path = write(tmp_path / "job.toml", "checkpoint_dir = 1979-05-27\n")
    assert "a date)" in error_of(lambda: load_config_file(path))


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    message = error_of(lambda: load_config_file(path))
    assert f"config file '{path}' not found" in message
    assert "pass --config" in message


def test_folder_instead_of_file(tmp_path: Path) -> None:
    message = error_of(lambda: load_config_file(tmp_path))
    assert f"config file '{tmp_path}' is a folder" in message


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path: Path) -> None:
    path = write(tmp_path / "job.toml", "epochs = 1\n")
    path.chmod(0)
    try:
        message = error_of(lambda: load_config_file(path))
    finally:
        path.chmod(0o600)
    assert f"cannot read config file '{path}'" in message
    assert "Permission denied" in message


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "job.toml", "epochs = 3\nbatch_size = = 8\n")
    message = error_of(lambda: load_config_file(path))
    assert f"config file '{path}' is not valid TOML" in message
    # The line quoted in the message itself: every error of the command is one line.
    assert "(at line 2, column 14): line 2 is 'batch_size = = 8': correct it" in message
    assert "\n" not in message


def test_empty_path_names_no_file() -> None:
    # Path("") is ".", which is a folder: "" must not read as "the current folder".
    message = error_of(lambda: load_config_file(""))
    assert message.startswith("--config '' names no file: pass --config"), message


def test_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    os.mkfifo(path)
    message = error_of(lambda: load_config_file(path))  # would block in open()
    assert f"config file '{path}' is not a regular file (a FIFO)" in message
    assert "pass --config" in message


# In a child with 1 GiB of address space: read to its end, /dev/zero is a MemoryError
# there, not the test machine's memory filled.
_READ_DEV_ZERO = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (2**30, resource.RLIM_INFINITY))
from ddpkit.cli.config_file import load_config_file
from ddpkit.errors import ConfigError
try:
    load_config_file("/dev/zero")
except ConfigError as exc:
    print(exc)
"""


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_device_is_refused_without_reading_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _READ_DEV_ZERO], capture_output=True, text=True, timeout=60
    )
    assert proc.stderr == "", proc.stderr
    assert "config file '/dev/zero' is not a regular file (a device)" in proc.stdout


def test_file_over_a_megabyte_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "job.toml", "#" * 2**20 + "\nepochs = 1\n")
    message = error_of(lambda: load_config_file(path))
    assert f"config file '{path}' is too large (1.0 MiB, over the limit of 1 MiB)" in message


def test_duplicate_key_is_a_syntax_error(tmp_path: Path) -> None:
    path = write(tmp_path / "job.toml", "epochs = 3\nepochs = 4\n")
    assert "is not valid TOML" in error_of(lambda: load_config_file(path))


def test_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_bytes(b'checkpoint_dir = "caf\xe9"\n')
    message = error_of(lambda: load_config_file(path))
    assert f"config file '{path}' is not UTF-8" in message


# -- validate_options with Python values (a job's DEFAULTS) ---------------------------


def test_none_only_where_the_type_allows_it() -> None:
    values = validate_options({"progress": None, "checkpoint_dir": None}, "DEFAULTS")
    assert values == {"progress": None, "checkpoint_dir": None}
    message = error_of(lambda: validate_options({"batch_size": None}, "DEFAULTS"))
    assert message == "DEFAULTS: batch_size must be an integer (got None): pass --batch-size 32"
    message = error_of(lambda: validate_options({"resume": 1}, "DEFAULTS"))
    assert "resume must be a boolean (got 1, an int)" in message
    message = error_of(lambda: validate_options({"checkpoint_dir": 1}, "DEFAULTS"))
    assert "checkpoint_dir must be a string or None (got 1, an int)" in message


def test_non_string_key_is_unknown() -> None:
    assert "unknown option '1'" in error_of(lambda: validate_options({1: 2}, "DEFAULTS"))  # type: ignore[dict-item]


# -- merge_config ---------------------------------------------------------------------


def test_merge_later_wins_and_none_flags_are_not_given() -> None:
    defaults = {"epochs": 10, "batch_size": 32, "progress": None}
    file_values = {"epochs": 5, "seed": 3, "checkpoint_dir": None}
    flags = {"epochs": None, "batch_size": 64, "seed": None, "resume": False}
    merged = merge_config(defaults, file_values, flags)
    assert merged == {
        "epochs": 5,  # file over default; the flag was not given
        "batch_size": 64,  # flag over default
        "progress": None,  # None in defaults is a value
        "seed": 3,
        "checkpoint_dir": None,  # None in the file is a value
        "resume": False,  # False is given, unlike None
    }
    assert defaults == {"epochs": 10, "batch_size": 32, "progress": None}  # not changed
    assert merge_config({}, {}, {}) == {}
    assert merge_config({"a": 1}, {"a": 2}, {"a": 3}) == {"a": 3}


# -- load_job -------------------------------------------------------------------------


@pytest.fixture
def clean_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Undo what a test's imports add to sys.path and sys.modules."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_builtin_example_with_its_defaults() -> None:
    build, defaults = load_job("ddpkit.examples.linear:build")
    assert build is linear_example.build
    assert defaults == linear_example.DEFAULTS
    assert defaults is not linear_example.DEFAULTS  # a copy the caller may change


JOB = """
    from ddpkit.training.job import Job
    from helper_for_job import WIDTH

    DEFAULTS = {"epochs": 2, "batch_size": 4}


    def build(ctx):
        return WIDTH


    def dataset(size=3):
        return size


    def _private(ctx):
        return None
"""


def test_job_from_a_file_path(tmp_path: Path, clean_imports: None) -> None:
    write(tmp_path / "jobs" / "helper_for_job.py", "WIDTH = 7\n")
    path = write(tmp_path / "jobs" / "my_file_job.py", JOB)
    build, defaults = load_job(f"{path}:build")
    assert defaults == {"epochs": 2, "batch_size": 4}
    assert build(None) == 7  # imported its sibling
    module = sys.modules["my_file_job"]
    assert module.build is build and module.__file__ == str(path)
    assert str(path.parent) == sys.path[0]
    # Pickled by reference, as spawned workers receive it.
    assert pickle.loads(pickle.dumps(build)) is build
    # Loading it again reuses the module.
    assert load_job(f"{path}:build")[0] is build


def test_job_from_a_relative_file_path(
    tmp_path: Path, clean_imports: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "rel_job.py", "def build(ctx):\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    build, defaults = load_job("rel_job.py:build")
    assert defaults == {} and build(None) == 1


def test_job_from_a_module_on_sys_path(tmp_path: Path, clean_imports: None) -> None:
    write(tmp_path / "pkg_for_job" / "__init__.py", "")
    write(tmp_path / "pkg_for_job" / "train.py", "class Jobs:\n    def build(ctx):\n        ...\n")
    sys.path.insert(0, str(tmp_path))
    build, defaults = load_job("pkg_for_job.train:Jobs.build")
    assert build is sys.modules["pkg_for_job.train"].Jobs.build and defaults == {}


@pytest.mark.parametrize(
    "spec",
    ["ddpkit.examples.linear", "ddpkit.examples.linear:", ":build", "mod:a-b", "C:\\x\\job.py"],
)
def test_spec_without_module_and_function(spec: str) -> None:
    message = error_of(lambda: load_job(spec))
    assert f"(got {spec!r})" in message
    assert "pass --job package.module:build" in message


def test_relative_module_name() -> None:
    assert "relative module name" in error_of(lambda: load_job(".linear:build"))


def test_no_such_module() -> None:
    message = error_of(lambda: load_job("no_such_pkg_xyz.jobs:build"))
    assert "no module named 'no_such_pkg_xyz' (for --job no_such_pkg_xyz.jobs:build)" in message
    assert "--job path/to/jobs.py:build" in message
    message = error_of(lambda: load_job("ddpkit.examples.no_such_example:build"))
    assert "no module named 'ddpkit.examples.no_such_example'" in message


def test_no_such_module_says_when_the_current_folder_is_not_searched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    assert "PYTHONPATH=." in error_of(lambda: load_job("no_such_pkg_xyz:build"))


def test_module_that_raises_import_error_shows_the_underlying_error(
    tmp_path: Path, clean_imports: None
) -> None:
    write(tmp_path / "broken_import_job.py", "import no_such_dependency_xyz\n")
    write(tmp_path / "bad_name_job.py", "from os import no_such_name_xyz\n")
    write(tmp_path / "syntax_job.py", "def build(ctx)\n")
    sys.path.insert(0, str(tmp_path))
    message = error_of(lambda: load_job("broken_import_job:build"))
    assert "module 'broken_import_job' raised ModuleNotFoundError while importing" in message
    assert "No module named 'no_such_dependency_xyz'" in message
    message = error_of(lambda: load_job("bad_name_job:build"))
    assert "raised ImportError while importing: cannot import name 'no_such_name_xyz'" in message
    message = error_of(lambda: load_job("syntax_job:build"))
    assert "raised SyntaxError while importing" in message


def test_file_that_raises_import_error(tmp_path: Path, clean_imports: None) -> None:
    path = write(tmp_path / "broken_file_job.py", "import no_such_dependency_xyz\n")
    message = error_of(lambda: load_job(f"{path}:build"))
    assert "raised ModuleNotFoundError while importing" in message
    assert "no_such_dependency_xyz" in message
    assert "broken_file_job" not in sys.modules


def test_other_errors_of_the_module_propagate(tmp_path: Path, clean_imports: None) -> None:
    path = write(tmp_path / "raising_job.py", "raise RuntimeError('boom at import')\n")
    with pytest.raises(RuntimeError, match="boom at import"):
        load_job(f"{path}:build")
    assert "raising_job" not in sys.modules


def test_job_file_that_is_a_fifo_or_a_folder(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo_job.py"
    os.mkfifo(fifo)
    message = error_of(lambda: load_job(f"{fifo}:build"))  # Python would wait for a writer
    assert f"'{fifo}' is a FIFO, not a Python file (for --job {fifo}:build)" in message
    folder = tmp_path / "folder_job.py"
    folder.mkdir()
    assert "is a folder, not a Python file" in error_of(lambda: load_job(f"{folder}:build"))


def test_no_such_file(tmp_path: Path) -> None:
    path = tmp_path / "missing_job.py"
    message = error_of(lambda: load_job(f"{path}:build"))
    assert f"no such file '{path}'" in message
    assert "pass --job path/to/file.py:build" in message


def test_file_that_is_not_python(tmp_path: Path, clean_imports: None) -> None:
    path = write(tmp_path / "job.txt", "x\n")
    assert "cannot load" in error_of(lambda: load_job(f"{path}:build"))


def test_file_named_like_a_module_already_imported(tmp_path: Path, clean_imports: None) -> None:
    path = write(tmp_path / "json.py", "def build(ctx):\n    ...\n")
    message = error_of(lambda: load_job(f"{path}:build"))
    assert "as module 'json': a different module of that name is already imported" in message
    assert "rename the file" in message


def test_missing_function_lists_functions_of_one_argument() -> None:
    message = error_of(lambda: load_job("ddpkit.examples.linear:buld"))
    assert "ddpkit.examples.linear has no attribute 'buld'" in message
    assert "one of its functions that take (ctx) or (ctx, config): " in message
    listed = message.rsplit(": ", 1)[1].split(", ")
    assert sorted(listed) == ["build", "dataset"]  # not Job, imported from ddpkit.training.job


def test_missing_function_in_a_module_without_candidates(
    tmp_path: Path, clean_imports: None
) -> None:
    path = write(tmp_path / "empty_job.py", "def three(a, b, c):\n    ...\n")
    message = error_of(lambda: load_job(f"{path}:build"))
    assert "empty_job has no attribute 'build'" in message
    assert "no function that takes (ctx) or (ctx, config)" in message
    assert "def build(ctx: ddpkit.DistContext) -> ddpkit.Job" in message


def test_missing_nested_attribute(tmp_path: Path, clean_imports: None) -> None:
    path = write(tmp_path / "nested_job.py", "class Jobs:\n    pass\n")
    message = error_of(lambda: load_job(f"{path}:Jobs.build"))
    assert "nested_job:Jobs has no attribute 'build'" in message


def test_not_callable() -> None:
    message = error_of(lambda: load_job("ddpkit.examples.linear:DEFAULTS"))
    assert "ddpkit.examples.linear:DEFAULTS is a dict, not a function" in message
    assert "pass --job ddpkit.examples.linear:build" in message


def test_function_that_cannot_take_one_argument(tmp_path: Path, clean_imports: None) -> None:
    path = write(tmp_path / "arity_job.py", "def build():\n    ...\n")
    message = error_of(lambda: load_job(f"{path}:build"))
    assert "cannot be called with one argument" in message
    assert "def build(ctx: ddpkit.DistContext) -> ddpkit.Job" in message


def test_defaults_are_validated_like_a_file(tmp_path: Path, clean_imports: None) -> None:
    bad_key = write(
        tmp_path / "defaults_key_job.py", 'DEFAULTS = {"epoch": 1}\ndef build(ctx): ...\n'
    )
    message = error_of(lambda: load_job(f"{bad_key}:build"))
    assert "defaults_key_job.DEFAULTS: unknown option 'epoch': did you mean 'epochs'?" in message
    bad_type = write(
        tmp_path / "defaults_type_job.py", 'DEFAULTS = {"batch_size": "2"}\ndef build(ctx): ...\n'
    )
    message = error_of(lambda: load_job(f"{bad_type}:build"))
    assert "defaults_type_job.DEFAULTS: batch_size must be an integer (got '2', a str)" in message
    bad_range = write(
        tmp_path / "defaults_range_job.py", 'DEFAULTS = {"keep_last": 0}\ndef build(ctx): ...\n'
    )
    message = error_of(lambda: load_job(f"{bad_range}:build"))
    assert "defaults_range_job.DEFAULTS: keep_last must be >= 1 (got 0)" in message
    not_dict = write(tmp_path / "defaults_list_job.py", "DEFAULTS = [1]\ndef build(ctx): ...\n")
    message = error_of(lambda: load_job(f"{not_dict}:build"))
    assert (
        "defaults_list_job.DEFAULTS must be a dict of TrainConfig options (got a list)" in message
    )


def test_callable_object_with_unreadable_signature_is_accepted(
    tmp_path: Path, clean_imports: None
) -> None:
    path = write(tmp_path / "builtin_job.py", "build = print\n")
    build, _ = load_job(f"{path}:build")
    assert build is print


def test_string_annotations_of_train_config_are_resolved() -> None:
    # Annotations are strings under `from __future__ import annotations`.
    assert isinstance(dataclasses.fields(TrainConfig)[0].type, str)
    assert validate_options({"epochs": 1}, "x") == {"epochs": 1}


def test_path_through_a_file_cannot_be_read(tmp_path: Path) -> None:
    path = write(tmp_path / "plain", "") / "job.toml"
    message = error_of(lambda: load_config_file(path))
    assert f"cannot read config file '{path}': Not a directory" in message


# -- one message, whichever way the value arrives -------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "toml", "flag"),
    [
        ("batch_size", 0, "0", "0"),
        ("precision", "fp8", '"fp8"', "fp8"),
        ("epochs", "ten", '"ten"', "ten"),
    ],
)
def test_same_bad_value_same_message_from_python_file_and_flag(
    tmp_path: Path, name: str, value: object, toml: str, flag: str
) -> None:
    from_python = error_of(lambda: TrainConfig(**{name: value}))  # type: ignore[arg-type]
    path = write(tmp_path / "job.toml", f"{name} = {toml}\n")
    assert error_of(lambda: load_config_file(path)) == f"config file '{path}': {from_python}"
    proc = run_cli("train", "--" + name.replace("_", "-"), flag, "--example", "linear")
    assert proc.returncode == 2
    assert proc.stderr == f"ddpkit: error: {from_python}\n"
