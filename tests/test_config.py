"""TrainConfig and its one check per field, from Python and from command-line text."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from ddpkit.cli.flags import add_config_flags
from ddpkit.errors import ConfigError
from ddpkit.training.config import TrainConfig, parse_option


def test_defaults_are_valid_and_an_int_for_a_float_becomes_a_float() -> None:
    assert TrainConfig().precision == "32"
    config = TrainConfig(clip_grad_norm=2)
    assert config.clip_grad_norm == 2.0 and type(config.clip_grad_norm) is float


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_size": 0}, "batch_size must be >= 1 (got 0): pass --batch-size 32"),
        ({"save_every": -1}, "save_every must be >= 0 (got -1): pass --save-every 1"),
        (
            {"precision": "fp8"},
            "precision must be one of 32, bf16, fp16 (got 'fp8'): pass --precision bf16",
        ),
        (
            {"scheduler_interval": "batch"},
            "scheduler_interval must be one of epoch, step (got 'batch'): "
            "pass --scheduler-interval step",
        ),
        (
            {"batch_size": "2"},
            "batch_size must be an integer (got '2', a str): pass --batch-size 32",
        ),
        (
            {"batch_size": True},
            "batch_size must be an integer (got True, a bool): pass --batch-size 32",
        ),
        (
            {"clip_grad_norm": 0},
            "clip_grad_norm must be > 0 (got 0): pass --clip-grad-norm 1.0, or leave it out",
        ),
        (
            {"drop_last": 1},
            "drop_last must be a boolean (got 1, an int): pass --drop-last or --no-drop-last",
        ),
        ({"resume": True}, "resume must be used with a checkpoint folder (got True)"),
    ],
)
def test_bad_values_name_the_field_the_rule_and_the_flag(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**options)  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


def test_flag_text_is_converted_then_checked_the_same_way() -> None:
    assert parse_option("epochs", "3") == 3
    assert parse_option("clip_grad_norm", "0.5") == 0.5
    assert parse_option("precision", "bf16") == "bf16"
    assert parse_option("checkpoint_dir", "ck") == "ck"
    for name, text in (("epochs", "ten"), ("batch_size", "0"), ("precision", "fp8")):
        with pytest.raises(ConfigError) as from_flag:
            parse_option(name, text)
        value: object = int(text) if text.isdigit() else text
        with pytest.raises(ConfigError) as from_python:
            TrainConfig(**{name: value})  # type: ignore[arg-type]
        assert str(from_flag.value) == str(from_python.value)


def test_every_field_is_a_flag_and_bools_have_a_no_form() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    help_text = parser.format_help()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in help_text
        if f.type in ("bool", "bool | None"):
            assert f"--no-{flag[2:]}" in help_text
    assert "--precision {32,bf16,fp16}" in help_text
    assert vars(parser.parse_args([])) == {f.name: None for f in dataclasses.fields(TrainConfig)}


def test_every_field_is_documented() -> None:
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata["help"], f.name


def test_config_does_not_import_torch() -> None:
    code = "import sys, ddpkit.training.config, ddpkit.cli.flags; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
