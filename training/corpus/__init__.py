"""Offline training corpus for LiveSpeech 2 (see docs/corpus.md)."""
