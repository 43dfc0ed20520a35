"""numba where it loads, and how the CPU's compiled loops are built with it
(models/cpu_sampler.py, models/cpu_attention.py). Where it does not load, each caller's
`applies` says no and torch's ops run instead."""
from __future__ import annotations

import logging

log = logging.getLogger("livespeech.models")

try:
    import numba
except Exception as exc:  # noqa: BLE001 - not installed, or no build for this platform
    numba = None
    log.warning("the CPU's compiled loops (top-k sampling, memory attention) run as torch ops: numba is "
                "unavailable (%s)", exc)


def available() -> bool:
    return numba is not None


def jit(fn, **options):
    """`fn` compiled at its first call, the machine code kept for the next process where
    a cache directory is writable (beside this file, else XDG_CACHE_HOME)."""
    try:
        return numba.njit(nogil=True, cache=True, **options)(fn)
    except RuntimeError:  # nowhere to keep it (a read-only image): compiled at each start, ~1 s
        return numba.njit(nogil=True, **options)(fn)
