"""The API the server and the client share (`livespeech.api`), torch-free.

- `livespeech/v1/livespeech.proto`: the gRPC service and its messages
- `protocol`: the generated message module (`pb`), the method table and the mappings
  between proto messages and the session types
- `session`: the session types (`SessionConfig`, the events, `Summary`) and the engine's
  interface to the service
- `audio`: PCM16, G.711 mu-law and WAV conversions
- `cache`: the user's cache directory (what is made once and kept between runs)
"""
