"""LiveSpeech's own EnCodec runtime (the `encodec` package is unmaintained and needs
torchaudio): checkpoint-compatible with the official 24 kHz model, with an exact,
batchable streaming decoder and training-loss hooks.

    model = CodecModel.from_checkpoint("encodec_24khz-d7cc33bc.th", config="encodec_24khz")
    codes = model.encode(wav)                  # [B, 1, T] -> [B, n_q, ceil(T / 320)]
    wav = model.decode(codes)                  # [B, K, F] -> [B, 1, F * 320]
    state = model.streaming_state(batch)       # one row per session
    pcm = model.decode_step(codes_packet, state)   # [B, K, F] -> [B, 1, F * 320], exact

Sample accounting of the streaming decoder: every packet of F frames yields exactly
F * hop_length (320) samples at once (no lookahead, no final flush); the samples of
frame f are final when it is decoded, and the concatenated packets equal `decode` of
the whole stream. With reflect padding (the official model)
a session's first packet must carry >= `model.min_first_frames` (7) frames; with
constant padding (`small`) any packet size works from the start. Sessions join and
leave between steps with `StreamState.cat` / `select` / `update`.
"""
from .config import PRESETS, CodecConfig, preset
from .losses import CodecLossConfig
from .model import CodecModel, StreamState

__all__ = ["PRESETS", "CodecConfig", "CodecLossConfig", "CodecModel", "StreamState", "preset"]
