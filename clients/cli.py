"""`livespeech`: the one command line.

    livespeech serve [--port 50051 --model PATH --device cpu ...]   run the server
    livespeech say "Hello there." -o out.wav [--voice ID] [--llm-rate 40]
    livespeech say "Hello there." -o - | aplay                       the WAV on stdout, the rest on stderr
    livespeech say --llm-rate 40 < file.txt                          simulate an LLM stream
    livespeech voices add ID ref.wav | list | rm ID
    livespeech corpus|train-codec|train|eval|loadtest ...            forwarded to their tools

The server address is `--server` or `LIVESPEECH_SERVER` (default 127.0.0.1:50051). A
secured server: `--tls-ca ca.pem` (env LIVESPEECH_TLS_CA) verifies its certificate,
`--tls-cert/--tls-key` add a client certificate (mutual TLS), and the bearer token comes
from `--token-file` or the env LIVESPEECH_TOKEN (`--token` works too, but a command line
is visible to every local user).
"""
from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
from typing import Optional, Sequence

FORWARDED = {
    "corpus": ("livespeech.training.corpus.cli", "build the training corpus"),
    "train-codec": ("livespeech.training.codec_train", "train the audio codec"),
    "train": ("livespeech.training.train", "train the LiveSpeech model"),
    "eval": ("livespeech.training.eval.evaluate", "evaluate a model"),
    "loadtest": ("livespeech.loadtest.run", "load-test a server"),
}


def _forward(command: str, argv: list[str]) -> int:
    module_name, _ = FORWARDED[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            print(f"livespeech {command}: not available in this installation ({module_name} is missing)", file=sys.stderr)
            return 2
        raise
    main = getattr(module, "main", None)
    if main is None:
        print(f"livespeech {command}: {module_name} has no main()", file=sys.stderr)
        return 2
    rc = main(argv)
    return rc if isinstance(rc, int) else 0


def _server_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server",
        default=os.environ.get("LIVESPEECH_SERVER", "127.0.0.1:50051"),
        help="host:port (env LIVESPEECH_SERVER; default %(default)s)",
    )
    p.add_argument("--tls-ca", default=os.environ.get("LIVESPEECH_TLS_CA"), metavar="PEM",
                   help="connect with TLS, trusting this CA (env LIVESPEECH_TLS_CA)")
    p.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS; with --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", help="client private key (mutual TLS)")
    # default None: the env is read in _client_kw, so the token never shows in --help
    p.add_argument("--token", default=None, help="bearer token (prefer env LIVESPEECH_TOKEN or --token-file)")
    p.add_argument("--token-file", metavar="PATH", help="read the bearer token from this file")


def _client_kw(args: argparse.Namespace) -> dict:
    """The client's security settings from the flags (see the module doc)."""
    from livespeech.client.client import ClientSecurity

    token = args.token or os.environ.get("LIVESPEECH_TOKEN") or None
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    return dict(security=ClientSecurity(
        tls=args.tls, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key, token=token
    ))


def _server_config() -> Optional[type]:
    """`ServerConfig`, or None where the server is not installed (livespeech-client)."""
    try:
        from livespeech.server.config import ServerConfig
    except ModuleNotFoundError as e:
        if e.name not in ("livespeech.server", "livespeech.server.config"):
            raise
        return None
    return ServerConfig


NO_SERVER = "not in this installation (livespeech-client is the client alone; the livespeech distribution serves)"


def _parser() -> argparse.ArgumentParser:
    from livespeech.api.session import SessionConfig

    parser = argparse.ArgumentParser(prog="livespeech", description="LiveSpeech streaming TTS")
    sub = parser.add_subparsers(dest="command", required=True)

    server_config = _server_config()
    if server_config is None:
        sub.add_parser("serve", help=f"run the server: {NO_SERVER}", add_help=False)
    else:
        # no prefix matching (as ServerConfig.from_args): "--auth-tokens X" is no flag of ours
        serve = sub.add_parser("serve", help="run the gRPC server (the embedded default model unless --model-path)",
                               allow_abbrev=False)
        server_config.add_arguments(serve)

    say = sub.add_parser("say", help="synthesize text (stdin when no text) into a WAV")
    say.add_argument("text", nargs="?", help="text to speak; read from stdin when omitted")
    say.add_argument("-o", "--output", default="out.wav",
                     help="WAV file to write; - for standard output, e.g. into a player (default %(default)s)")
    _server_arg(say)
    say.add_argument("--voice", help="voice id (default: the server's default voice)")
    say.add_argument("--enroll", metavar="WAV", help="inline reference speech instead of a voice id")
    say.add_argument("--sample-rate", type=int, default=24000)
    say.add_argument("--encoding", choices=("pcm16", "mulaw"), default="pcm16")
    say.add_argument("--packet-ms", type=int, default=None)
    say.add_argument("--min-packet-ms", type=int, default=None,
                     help="shortest packet but the last (server default 20; = --packet-ms for fixed sizes)")
    say.add_argument("--np", dest="n_past_chunks", type=int, default=None, help="past chunks (-1 unbounded)")
    say.add_argument("--nf", dest="n_future_chunks", type=int, default=None, help="future chunks")
    say.add_argument("--seed", type=int, default=None)
    say.add_argument("--lambda", dest="guidance_lambda", type=float, default=None,
                     help="semantic guidance (server default 1; inf: hard guidance)")
    say.add_argument("--top-k", type=int, default=None, help="top-k of the acoustic codes (server default 20)")
    say.add_argument("--grapheme-top-k", type=int, default=None, help="top-k of the graphemes (server default 3)")
    for name in ("grapheme", "first-codebook", "acoustic"):
        say.add_argument(f"--{name}-temperature", type=float, default=None,
                         help=f"{name.replace('-', ' ')} sampling temperature (server default "
                              f"{getattr(SessionConfig, name.replace('-', '_') + '_temperature'):g}; 0: greedy)"
                         + (" (codebooks 2-8)" if name == "acoustic" else ""))
    say.add_argument("--llm-rate", type=float, default=None, metavar="TOKENS_PER_S",
                     help="send ~4-char pieces at this rate, like an LLM (default: all at once)")
    say.add_argument("--jitter", type=float, default=0.3, help="relative jitter of the LLM pace")
    say.add_argument("--quiet", action="store_true", help="do not print word timestamps")

    voices = sub.add_parser("voices", help="manage registered voices")
    vsub = voices.add_subparsers(dest="voices_command", required=True)
    add = vsub.add_parser("add", help="register a voice from a WAV file")
    add.add_argument("voice_id")
    add.add_argument("wav")
    add.add_argument("--overwrite", action="store_true")
    _server_arg(add)
    ls = vsub.add_parser("list", help="list voices")
    _server_arg(ls)
    rm = vsub.add_parser("rm", help="delete a registered voice")
    rm.add_argument("voice_id")
    _server_arg(rm)

    for name, (module, help_text) in FORWARDED.items():
        sub.add_parser(name, help=f"{help_text} ({module}); arguments are passed on", add_help=False)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from livespeech.server.app import serve
    from livespeech.server.config import ENV_PREFIX, ServerConfig, default_voices_dir
    from livespeech.api.session import ConfigError

    if args.voices_dir is None and ENV_PREFIX + "VOICES_DIR" not in os.environ:
        args.voices_dir = str(default_voices_dir())
    try:
        config = ServerConfig.from_sources(args)
    except ConfigError as e:  # a bad flag or env value: say which, no traceback
        print(f"livespeech serve: {e}", file=sys.stderr)
        return 2
    serve(config)
    return 0


def _say(args: argparse.Namespace) -> int:
    import grpc

    from livespeech.client.client import LiveSpeechClient, SynthesisResult, paced, split_pieces
    from livespeech.api.session import Summary, WordTiming

    to_stdout = args.output == "-"
    # with the WAV on stdout, everything printed goes to stderr so the pipe carries audio only
    info = sys.stderr if to_stdout else sys.stdout
    text = args.text if args.text is not None else sys.stdin.read()
    if not text.strip():
        print("livespeech say: no text", file=sys.stderr)
        return 2
    source = paced(split_pieces(text), args.llm_rate, jitter=args.jitter) if args.llm_rate else text
    kw = dict(
        voice_id=args.voice, sample_rate=args.sample_rate, encoding=args.encoding, packet_ms=args.packet_ms,
        min_packet_ms=args.min_packet_ms, n_past_chunks=args.n_past_chunks, n_future_chunks=args.n_future_chunks, seed=args.seed,
        guidance_lambda=args.guidance_lambda, top_k=args.top_k, grapheme_top_k=args.grapheme_top_k,
        grapheme_temperature=args.grapheme_temperature, first_codebook_temperature=args.first_codebook_temperature,
        acoustic_temperature=args.acoustic_temperature,
    )
    enrollment = None
    if args.enroll:
        from livespeech.api.audio import decode_wav, float_to_pcm16

        x, rate = decode_wav(open(args.enroll, "rb").read())
        enrollment = (float_to_pcm16(x).tobytes(), rate)
    result = SynthesisResult()
    try:
        with LiveSpeechClient(args.server, **_client_kw(args)) as client:
            stream = client.synthesize(source, enrollment=enrollment, **kw)
            for event in stream:
                result.add(event)
                if isinstance(event, WordTiming) and not args.quiet:
                    print(f"  {event.start_s:7.3f} {event.end_s:7.3f}  {event.word}", file=info)
    except grpc.RpcError as e:
        print(f"livespeech say: {e.code().name}: {e.details()}", file=sys.stderr)
        spoken = getattr(e, "summary", None)  # the server's summary before an early ending
        if spoken is not None and spoken.all_words_spoken is False:
            print(f"not spoken: {len(spoken.unspoken_words)} word(s): {' '.join(spoken.unspoken_words)}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # bad settings or an unreadable file, before any call
        print(f"livespeech say: {e}", file=sys.stderr)
        return 2
    if to_stdout:
        wav = io.BytesIO()
        result.write_wav(wav)
        try:
            sys.stdout.buffer.write(wav.getvalue())
            sys.stdout.flush()
        except BrokenPipeError:  # the player quit early; devnull, so the flush at exit does not raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
    else:
        result.write_wav(args.output)
    s: Optional[Summary] = result.summary
    audio_s = len(result.pcm16()) / 2 / result.sample_rate
    where = "standard output" if to_stdout else args.output
    print(f"wrote {where}: {audio_s:.2f} s at {result.sample_rate} Hz, {len(result.packets)} packets", file=info)
    if s is not None:
        def ms(v: Optional[float]) -> str:
            return "-" if v is None else f"{v * 1000:.0f} ms"

        print(f"TTFA {ms(s.ttfa_s)} (lookahead wait {ms(s.lookahead_wait_s)}, compute FPL {ms(s.compute_fpl_s)})",
              file=info)
        if s.all_words_spoken is False:
            print(f"not spoken: {len(s.unspoken_words)} word(s): {' '.join(s.unspoken_words)}", file=info)
    return 0


def _voices(args: argparse.Namespace) -> int:
    import grpc

    from livespeech.client.client import LiveSpeechClient

    try:
        with LiveSpeechClient(args.server, **_client_kw(args)) as client:
            if args.voices_command == "add":
                info = client.register_voice(args.voice_id, path=args.wav, overwrite=args.overwrite)
                print(f"registered {info.voice_id} ({info.reference_s:.1f} s of reference audio)")
            elif args.voices_command == "list":
                for v in client.list_voices():
                    kind = "built-in" if v.builtin else f"{v.reference_s:.1f} s"
                    print(f"{v.voice_id}\t{kind}")
            else:
                client.delete_voice(args.voice_id)
                print(f"deleted {args.voice_id}")
    except grpc.RpcError as e:
        print(f"livespeech voices {args.voices_command}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"livespeech voices {args.voices_command}: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:  # before argparse: their flags are theirs
        return _forward(argv[0], argv[1:])
    if argv and argv[0] == "serve" and _server_config() is None:
        print(f"livespeech serve: {NO_SERVER}", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "say":
        return _say(args)
    return _voices(args)


if __name__ == "__main__":
    sys.exit(main())
