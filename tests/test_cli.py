"""The `livespeech` CLI, the client helpers and ServerConfig."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import types
import wave
from pathlib import Path

import numpy as np
import pytest

from livespeech.client.cli import main
from livespeech.client.client import LiveSpeechClient, TextPiece, chunk_text, split_pieces
from livespeech.api.audio import encode_wav
from livespeech.server.config import ServerConfig
from livespeech.api.session import AudioPacket, ConfigError, Encoding, Summary, WordTiming

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(fake=True)


def test_split_pieces_like_llm_tokens() -> None:
    assert split_pieces("Hello world") == ["Hell", "o", " wor", "ld"]
    for text in ("", "  lead and trail  ", "a, b. c!\nnew line", "supercalifragilistic expialidocious"):
        pieces = split_pieces(text)
        assert "".join(pieces) == text
        assert all(len(p.strip()) <= 4 for p in pieces if not p.isspace())
    long = "word " * 500 + "x" * 2500
    chunks = chunk_text(long, limit=1000)
    assert "".join(chunks) == long and all(len(c) <= 1000 for c in chunks)


def test_server_config_flags_env_defaults() -> None:
    env = {"LIVESPEECH_PORT": "6000", "LIVESPEECH_MAX_SESSIONS": "3", "LIVESPEECH_IDLE_TIMEOUT_S": "2.5"}
    cfg = ServerConfig.from_args(["--port", "7000", "--model", "/m", "--voices-dir", "/v"], env=env)
    assert cfg.port == 7000 and cfg.max_sessions == 3 and cfg.idle_timeout_s == 2.5
    assert cfg.model_path == Path("/m") and cfg.voices_dir == Path("/v")
    assert ServerConfig.from_args([], env={}) == ServerConfig()
    # not Prometheus's own 9090: a server and a Prometheus on one host must not collide
    assert ServerConfig().metrics_port == 9464 != 9090
    assert ServerConfig.from_args(["--model-path", "random:tiny", "--voices-dir", ""], env={}).voices_dir is None
    for argv, needle in ((["--port", "70000"], "port"), (["--device", "tpu"], "device"), (["--max-sessions", "0"], "max_sessions")):
        with pytest.raises(ConfigError, match=needle):
            ServerConfig.from_args(argv, env={})
    with pytest.raises(ConfigError, match="max_sessions"):
        ServerConfig.from_args([], env={"LIVESPEECH_MAX_SESSIONS": "many"})
    with pytest.raises(Exception):
        ServerConfig().port = 1  # frozen
    # a switch: flag or env, words or digits; only with a CUDA device
    assert ServerConfig.from_args(["--device", "cuda", "--cuda-graphs", "true"], env={}).cuda_graphs
    assert not ServerConfig.from_args(["--cuda-graphs", "off"], env={}).cuda_graphs
    assert ServerConfig.from_args([], env={"LIVESPEECH_DEVICE": "cuda:1", "LIVESPEECH_CUDA_GRAPHS": "1"}).cuda_graphs
    with pytest.raises(ConfigError, match="true/false"):
        ServerConfig.from_args(["--device", "cuda", "--cuda-graphs", "maybe"], env={})
    with pytest.raises(ConfigError, match="cuda_graphs needs a cuda device"):
        ServerConfig.from_args(["--cuda-graphs", "yes"], env={})
    # torch.compile's step: off by default, only for the CUDA graphs, and reaches the engine
    from livespeech.server.app import engine_config
    assert not ServerConfig().compile_step
    compiled = ServerConfig.from_args(["--device", "cuda", "--cuda-graphs", "1", "--compile-step", "1"], env={})
    assert engine_config(compiled).compile_step
    with pytest.raises(ConfigError, match="compile_step needs cuda_graphs"):
        ServerConfig.from_args(["--device", "cuda", "--compile-step", "1"], env={})
    # the frozen CPU step is on unless switched off, and reaches the engine's settings
    assert ServerConfig().frozen_step and engine_config(ServerConfig()).frozen_step
    off = ServerConfig.from_args(["--frozen-step", "false"], env={})
    assert not off.frozen_step and not engine_config(off).frozen_step
    assert not ServerConfig.from_args([], env={"LIVESPEECH_FROZEN_STEP": "0"}).frozen_step


def test_torch_threads_auto_splits_the_cpus_beside_the_codec_thread(tmp_path) -> None:
    from livespeech.server.app import available_cpus, torch_threads
    auto = ServerConfig()
    assert auto.torch_threads == 0 and auto.codec_thread
    assert [torch_threads(auto, n) for n in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 8]
    no_codec_thread = ServerConfig.from_args(["--codec-thread", "false"], env={})
    assert [torch_threads(no_codec_thread, n) for n in (1, 2, 4)] == [1, 2, 4]
    assert torch_threads(ServerConfig.from_args(["--device", "cuda"], env={}), 4) == 4
    assert torch_threads(ServerConfig.from_args(["--torch-threads", "3"], env={}), 16) == 3  # set: as set

    # the CPUs: affinity, capped by a container's cgroup quota (v2, then v1); none: affinity
    own = len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path / "none") == own
    v2 = tmp_path / "v2"
    v2.mkdir()
    for text, want in (("150000 100000", min(own, 2)), ("max 100000", own), ("50000 100000", 1), ("junk", own)):
        (v2 / "cpu.max").write_text(text + "\n")
        assert available_cpus(v2) == want, text
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    for quota, want in (("100000", 1), ("-1", own)):
        (v1 / "cpu.cfs_quota_us").write_text(quota + "\n")
        assert available_cpus(v1.parent) == want, quota


def test_serve_refuses_a_bad_config_in_one_line(capsys, monkeypatch) -> None:
    monkeypatch.delenv("LIVESPEECH_DEVICE", raising=False)
    assert main(["serve", "--port", "70000"]) == 2
    assert main(["serve", "--cuda-graphs", "on"]) == 2
    err = capsys.readouterr().err
    assert "port must be in [0, 65535]" in err and "cuda_graphs needs a cuda device" in err
    assert "Traceback" not in err


def test_forwarding_subcommands(monkeypatch, capsys) -> None:
    seen = []
    fake = types.ModuleType("livespeech.training.eval.evaluate")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "livespeech.training.eval.evaluate", fake)
    assert main(["eval", "--model", "x", "-h"]) == 0
    assert seen == [["--model", "x", "-h"]]
    monkeypatch.setitem(sys.modules, "livespeech.training.codec_train", None)  # import fails: missing
    assert main(["train-codec"]) == 2
    assert "not available" in capsys.readouterr().err


def test_say_from_stdin_at_llm_rate(srv, tmp_path) -> None:
    out = tmp_path / "out.wav"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "livespeech.client.cli", "say", "--server", srv.address, "--llm-rate", "300",
         "--sample-rate", "16000", "--encoding", "mulaw", "-o", str(out)],
        input="Hello there, streaming world.\n", capture_output=True, text=True, env=env, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "TTFA" in proc.stdout and "streaming" in proc.stdout
    with wave.open(str(out)) as w:
        assert w.getframerate() == 16000 and w.getsampwidth() == 2 and w.getnframes() > 0


def test_say_to_stdout_writes_only_the_wav(srv) -> None:
    """`-o -`: the WAV alone on stdout (it pipes into a player), word timings and TTFA on stderr."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "livespeech.client.cli", "say", "Hello there, streaming world.", "--server", srv.address,
         "--sample-rate", "16000", "-o", "-"],
        capture_output=True, env=env, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout
    assert out[:4] == b"RIFF" and out[8:12] == b"WAVE"
    assert int.from_bytes(out[4:8], "little") + 8 == len(out)  # the RIFF size covers all of stdout: nothing else
    with wave.open(io.BytesIO(out)) as w:
        assert w.getframerate() == 16000 and w.getsampwidth() == 2 and w.getnchannels() == 1
        assert w.getnframes() > 0 and 44 + w.getnframes() * 2 == len(out)
    err = proc.stderr.decode()
    assert "TTFA" in err and "streaming" in err and "wrote standard output" in err
    assert not (Path(ROOT) / "-").exists()


def test_voices_commands_and_say_errors(srv, tmp_path, capsys) -> None:
    ref = tmp_path / "ref.wav"
    ref.write_bytes(encode_wav(np.random.default_rng(0).standard_normal(8000).astype(np.float32) * 0.1, 16000))
    assert main(["voices", "add", "carol", str(ref), "--server", srv.address]) == 0
    assert main(["voices", "list", "--server", srv.address]) == 0
    listed = capsys.readouterr().out
    assert "carol" in listed and "default\tbuilt-in" in listed
    assert main(["voices", "rm", "carol", "--server", srv.address]) == 0
    assert main(["voices", "rm", "carol", "--server", srv.address]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main(["say", "hi", "--voice", "nobody", "--server", srv.address, "-o", str(tmp_path / "x.wav")]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_sync_client_with_a_blocking_text_source(srv) -> None:
    def slow_llm():
        for word in ["Sync ", "clients ", "work ", "too."]:
            time.sleep(0.01)
            yield word
        yield TextPiece("", flush=True)

    with LiveSpeechClient(srv.address) as client:
        events = list(client.synthesize(slow_llm(), sample_rate=8000, encoding=Encoding.MULAW, packet_ms=20))
        assert isinstance(events[-1], Summary) and events[-1].spoken_text == "Sync clients work too."
        packets = [e for e in events if isinstance(e, AudioPacket)]
        assert all(len(p.data) == 160 for p in packets[:-1])
        assert [e.word for e in events if isinstance(e, WordTiming)] == ["Sync", "clients", "work", "too."]
        result = client.synthesize_to_result("Second call.")
        assert result.summary is not None and len(result.pcm16()) == 2 * round(result.summary.audio_s * 24000)


def test_matmul_weights_auto_follows_the_cpus_features_and_reaches_the_engine(monkeypatch) -> None:
    """auto: int8 on a CPU where fbgemm runs (x86 with AVX2), else bfloat16 where the CPU
    has bf16 dot products (AVX512-BF16 or AMX), else float32; on a GPU bfloat16 where it
    has bfloat16, else float32; a value set is taken as set; int8 on a GPU and anything
    else refused at the edge."""
    import torch

    from livespeech.server.app import engine_config
    cuda = ["--device", "cuda"]
    for avx2, avx512_bf16, amx, want in ((True, True, False, "int8"), (False, True, False, "bfloat16"),
                                        (False, False, True, "bfloat16"), (False, False, False, "float32")):
        monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda v=avx2: v)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert engine_config(ServerConfig()).matmul_weights == want
        assert engine_config(ServerConfig.from_args(["--matmul-weights", "bfloat16"], env={})).matmul_weights == "bfloat16"
        env = {"LIVESPEECH_MATMUL_WEIGHTS": "float32"}
        assert engine_config(ServerConfig.from_args([], env=env)).matmul_weights == "float32"
    for available, bf16, want in ((True, True, "bfloat16"), (True, False, "float32"), (False, True, "float32")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda v=available: v)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, v=bf16: v)
        assert engine_config(ServerConfig.from_args(cuda, env={})).matmul_weights == want
        assert engine_config(ServerConfig.from_args(cuda + ["--matmul-weights", "float32"], env={})).matmul_weights \
            == "float32"
    with pytest.raises(ConfigError, match="matmul_weights int8 applies to the cpu device"):
        ServerConfig.from_args(cuda + ["--matmul-weights", "int8"], env={})
    with pytest.raises(ConfigError, match="matmul_weights must be one of auto, int8, bfloat16, float32"):
        ServerConfig.from_args(["--matmul-weights", "on"], env={})


def test_codec_runtime_reaches_the_engine_and_auto_is_native_on_the_cpu() -> None:
    """auto: the native codec step on the CPU, torch on a GPU; native / onnx / torch as
    set on the CPU; the CPU's runtimes refused on a GPU, anything else refused at the
    edge."""
    from livespeech.server.app import engine_config

    assert engine_config(ServerConfig()).codec_runtime == "native"
    assert engine_config(ServerConfig.from_args(["--codec-runtime", "onnx"], env={})).codec_runtime == "onnx"
    assert engine_config(ServerConfig.from_args([], env={"LIVESPEECH_CODEC_RUNTIME": "torch"})).codec_runtime == "torch"
    assert engine_config(ServerConfig.from_args(["--device", "cuda"], env={})).codec_runtime == "torch"
    with pytest.raises(ConfigError, match="codec_runtime must be one of auto, native, onnx, torch"):
        ServerConfig.from_args(["--codec-runtime", "tensorrt"], env={})
    for runtime in ("native", "onnx"):
        with pytest.raises(ConfigError, match=f"codec_runtime {runtime} applies to the cpu"):
            ServerConfig.from_args(["--codec-runtime", runtime, "--device", "cuda"], env={})


def test_the_server_starts_with_a_warm_text_cache() -> None:
    """The server's engine projects the text cache's capacity of lowest token ids at
    start-up; an engine made without saying so starts cold."""
    from livespeech.models.inference import TEXT_KV_CAPACITY
    from livespeech.models.loading import load_bundle
    from livespeech.server.app import engine_config
    from livespeech.server.runner import ModelRunner

    warm = engine_config(ServerConfig()).warm_text_tokens
    assert warm == TEXT_KV_CAPACITY
    bundle = load_bundle(random_init=True)
    assert len(ModelRunner(bundle, 1, warm_text_tokens=warm).state.text_kv) == TEXT_KV_CAPACITY
    assert len(ModelRunner(bundle, 1).state.text_kv) == 0


def test_device_guidance_reaches_the_engine() -> None:
    from livespeech.server.app import engine_config
    assert not engine_config(ServerConfig.from_args(["--device", "cuda"], env={})).device_guidance
    assert engine_config(ServerConfig.from_args(["--device-guidance", "true"], env={})).device_guidance
    assert engine_config(ServerConfig.from_args([], env={"LIVESPEECH_DEVICE_GUIDANCE": "true"})).device_guidance


def test_the_letter_schedule_is_on_by_default_and_can_be_turned_off() -> None:
    from livespeech.server.app import engine_config
    assert engine_config(ServerConfig.from_args([], env={})).letter_schedule
    assert not engine_config(ServerConfig.from_args(["--letter-schedule", "false"], env={})).letter_schedule
    assert not engine_config(ServerConfig.from_args([], env={"LIVESPEECH_LETTER_SCHEDULE": "false"})).letter_schedule


def test_text_cfg_scale_reaches_the_engine_and_is_bounded() -> None:
    from livespeech.server.app import engine_config
    assert engine_config(ServerConfig.from_args([], env={})).text_cfg_scale == 0.0
    assert engine_config(ServerConfig.from_args(["--text-cfg-scale", "1.5"], env={})).text_cfg_scale == 1.5
    assert engine_config(ServerConfig.from_args([], env={"LIVESPEECH_TEXT_CFG_SCALE": "2"})).text_cfg_scale == 2.0
    for bad in ("-1", "11", "nan"):
        with pytest.raises(ConfigError, match="text_cfg_scale must be in"):
            ServerConfig.from_args(["--text-cfg-scale", bad], env={})
