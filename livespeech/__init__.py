"""livespeech: a low-latency streaming text-to-speech server (LiveSpeech 2) and its client.

One import name for the whole project. The repository keeps its top-level folders; the
links in this folder give them their installed names:

- `livespeech.api` (protos/): the wire protocol, the session types and the audio formats
  that server and client share
- `livespeech.client` (clients/): the Python client and the `livespeech` command
- `livespeech.server` (server/): the gRPC/WebSocket server and the decode engine
- `livespeech.models` (models/): the model, the codec and the embedded default weights
- `livespeech.training` (training/), `livespeech.loadtest` (loadtest/)

`livespeech.api` and `livespeech.client` install on their own, without torch
(`pip install ./clients`, the livespeech-client distribution).
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("livespeech")
except PackageNotFoundError:  # a checkout run without installing, or the client alone
    __version__ = "0.1.0"
