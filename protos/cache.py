"""The user's cache: what livespeech makes once and keeps between runs (the wire protocol's
generated modules, the native CPU code's build, Whisper's joined weights), under
$XDG_CACHE_HOME/livespeech, else ~/.cache/livespeech."""
from __future__ import annotations

import os
from pathlib import Path


def user_cache(*parts: str) -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root, "livespeech", *parts)
