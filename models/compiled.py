"""Plain loops over numpy arrays, compiled by numba where it imports.

A loop over a batch's rows in Python costs microseconds a row; compiled, it costs
nanoseconds and one call (the speech timelines, server/timeline.py; the decode state's
text index, models/inference.py). Where numba is missing, the same function runs as Python: slower,
the same results. The search they share over sorted rows (`first_at_least`) is here too.
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

log = logging.getLogger("livespeech.models")

try:
    import numba
except Exception as exc:  # noqa: BLE001 - not installed, or no build for this platform
    numba = None
    log.warning("compiled loops run as Python: numba is unavailable (%s)", exc)

F = TypeVar("F", bound=Callable)


def compiled(fn: F, **options) -> F:
    """`fn` compiled at its first call (numba's `njit`, without the GIL), the machine code
    kept for the next process where a cache directory is writable (beside the module, else
    XDG_CACHE_HOME); `fn` itself without numba."""
    if numba is None:
        return fn
    try:
        return numba.njit(nogil=True, cache=True, **options)(fn)
    except RuntimeError:  # nowhere to keep it (a read-only image): compiled at each start, ~1 s
        return numba.njit(nogil=True, **options)(fn)


def _first_at_least(values, n, x):
    """The first i < n with values[i] >= x (n if none), values[:n] non-decreasing."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


# inlined into its callers' machine code, which numba's cache keeps keyed by their own
# files: a change here needs those caches (__pycache__/*.nbi, *.nbc) cleared
first_at_least = compiled(_first_at_least, inline="always")
