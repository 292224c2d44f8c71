"""JSON text that every parser reads: Python's json writes NaN and Infinity, which are not JSON (a strict parser,
``jq``, JavaScript, refuses them). A figure that does not exist (a loss never measured, a rate of nothing) is
written as null."""
from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every float that is NaN or infinite, at any depth of dicts, lists and tuples, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs) -> str:
    """``json.dumps`` of ``value`` with non-finite floats as null (and refused, should one slip through)."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
