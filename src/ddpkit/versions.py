"""Release numbers of torch, for the workarounds that only some releases need.

It imports nothing: the command line reads it before torch is imported."""

from __future__ import annotations


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.6.0+cu124" -> (2, 6)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)
