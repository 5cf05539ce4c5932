"""Ollama's `keep_alive`: how long a model stays loaded after its last request."""

from __future__ import annotations

import math
import re

from ..errors import BadRequestError

DEFAULT_KEEP_ALIVE = 300.0
MAX_KEEP_ALIVE_CHARS = 64  # "1h30m" is 5; a duration string has no reason to be long
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value) -> float | None:
    """Seconds to stay loaded after the last request; None = forever. Accepts what
    Ollama does: a number of seconds, or a Go duration such as "5m", "1h30m", "-1"."""
    if value is None:
        return DEFAULT_KEEP_ALIVE
    if isinstance(value, bool):
        raise BadRequestError(f"'keep_alive' must be a duration such as \"5m\" or a number of seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        if len(value) > MAX_KEEP_ALIVE_CHARS:
            raise BadRequestError(
                f"'keep_alive' must be a duration such as \"5m\" (at most {MAX_KEEP_ALIVE_CHARS} characters)"
            )
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = re.findall(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise BadRequestError(
                    f"'keep_alive' must be a duration such as \"5m\" or a number of seconds, got {value!r}"
                ) from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise BadRequestError(f"'keep_alive' must be a duration such as \"5m\" or a number of seconds, got {value!r}")
    if math.isnan(seconds):
        raise BadRequestError(f"'keep_alive' must be a duration such as \"5m\" or a number of seconds, got {value!r}")
    return None if seconds < 0 or math.isinf(seconds) else seconds  # "inf" keeps it, as -1 does
