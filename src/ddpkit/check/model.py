"""The checker's own code: a file it could not read or parse."""

from __future__ import annotations

# The code of a file that could not be read or parsed; it is never filtered out,
# because a file that was not checked must not look clean.
UNREADABLE = "DDP000"
