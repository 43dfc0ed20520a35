"""The LiveSpeech streaming TTS server.

gRPC layer: `protocol` (wire format), `service` (servicer), `app` (process), `config`,
`voices`, `metrics`, `audio`. Decode engine: `engine`, `scheduler`, `chunker`, `runner`.
The boundary between the two is `session_api`. Importing this package loads nothing.
"""
