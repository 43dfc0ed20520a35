"""LiveSpeech clients: `clients.client` (library) and `clients.cli` (the `livespeech` command).

`from clients import LiveSpeechClient` works; the import is lazy so that the CLI's
forwarding subcommands do not load gRPC.
"""
from typing import Any

__all__ = ["AsyncLiveSpeechClient", "LiveSpeechClient", "TextPiece", "llm_stream", "split_pieces"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(name)
