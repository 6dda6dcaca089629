"""The oldest torch that ddpkit supports is said in several places: the package's own
requirement (pyproject.toml), the comments of the pin files that CI installs from, the
oldest pin itself and `ddpkit info`'s tested range. They must name the same release."""

from __future__ import annotations

import re
import sys

from ddpkit.cli.info import TORCH_TESTED
from tests.conftest import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]


def _floor() -> str:
    """The release in pyproject.toml's `torch>=X` requirement."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [m[1] for d in project["dependencies"] if (m := re.fullmatch(r"torch>=([\d.]+)", d))]
    assert len(found) == 1, project["dependencies"]
    return found[0]


def _said_floors(name: str) -> list[str]:
    """Every `torch>=X` that the comments of pin file `name` mention."""
    comments = [line for line in (ROOT / name).read_text().splitlines() if line.startswith("#")]
    return re.findall(r"torch>=([\d.]+)", "\n".join(comments))


def test_the_pin_files_comments_name_pyprojects_torch_requirement() -> None:
    floor = _floor()
    for name in ("constraints.txt", "constraints-oldest.txt"):
        said = _said_floors(name)
        assert said, f"{name} no longer says which torch the package asks for"
        assert set(said) == {floor}, f"{name} says torch>={said}, pyproject.toml torch>={floor}"


def test_the_oldest_pin_and_the_tested_range_start_at_the_requirement() -> None:
    floor = _floor()
    pins = re.findall(r"^torch==([\d.]+)$", (ROOT / "constraints-oldest.txt").read_text(), re.M)
    assert pins == [f"{floor}.0" if floor.count(".") == 1 else floor]
    assert ".".join(map(str, TORCH_TESTED[0])) == floor
