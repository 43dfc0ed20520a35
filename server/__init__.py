"""The LiveSpeech streaming TTS server (installed as `livespeech.server`).

gRPC layer: `service` (servicer), `web` (WebSocket and HTTP), `app` (process), `config`,
`voices`, `metrics`, `auth`. Decode engine: `engine`, `scheduler`, `chunker`, `runner`,
`audio`. The boundary between the two is the session API, `livespeech.api.session`
(protos/session.py), with the wire protocol beside it. Importing this package loads nothing.
"""
