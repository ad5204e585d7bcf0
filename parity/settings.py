"""The field helper every package's config sections are written with. Each section lives next
to the code that owns it (rollout/config.py, trainer/config.py, rl/config.py); rl/config.py
combines them and enforces what the metadata says (bounds, path-ness) when it loads a file."""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any


def setting(default: Any = MISSING, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, path: bool = False) -> Any:
    """A dataclass field whose bounds (checked on each element of a tuple) and path-ness the
    config loader enforces; without `default` the key is required."""
    return field(default=default, metadata=dict(ge=ge, gt=gt, le=le, lt=lt, path=path))
