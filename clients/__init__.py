"""The LiveSpeech client (`livespeech.client`): `client` (the library) and `cli` (the
`livespeech` command); the pipecat and LiveKit adapters beside them.

`from livespeech.client import LiveSpeechClient, SynthesisSession, Started, AudioPacket, ...` works
(the client classes and the event types); the import is lazy so that the CLI's forwarding
subcommands do not load gRPC.
"""
from typing import Any

__all__ = [
    "AsyncLiveSpeechClient", "LiveSpeechClient", "SynthesisSession", "SyncSynthesisSession", "SynthesisStream",
    "SynthesisResult", "RetryPolicy", "NO_RETRY", "Refusal", "TextPiece", "VoiceInfo", "llm_stream", "split_pieces",
    # events
    "Event", "Started", "AudioPacket", "WordTiming", "Summary",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(name)
