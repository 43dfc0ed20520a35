"""LiveKit Agents speaking a streamed LLM reply through LiveSpeech.

    livespeech serve &                                   # the local server
    pip install -e '.[livekit]'
    python examples/livekit_agent.py reply "Tell me about streaming speech." -o reply.wav
    python examples/livekit_agent.py console             # a voice agent (see below)

`reply`: streams one LLM reply into the plugin's `stream()` and writes the audio to a
WAV file, printing each word's aligned timestamp. The LLM is OpenAI's chat API when
OPENAI_API_KEY is set (OPENAI_MODEL, default gpt-4.1-mini; OPENAI_BASE_URL for any
OpenAI-compatible server); without a key a canned reply stands in for it, streamed as
~4-character tokens at 40 tokens/s. Needs no LiveKit server.

Any other arguments run a LiveKit voice agent (LiveKit's own CLI: `console`, `dev`,
`start`): STT and LLM through LiveKit Inference ("deepgram/nova-3",
"openai/gpt-4.1-mini"), which needs LIVEKIT_URL, LIVEKIT_API_KEY and LIVEKIT_API_SECRET of
a LiveKit Cloud project; the speech is LiveSpeech, its transcript aligned to the audio.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import wave
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

from livespeech.client import livekit_tts
from livespeech.client.client import llm_stream

CANNED_REPLY = (
    "Streaming speech starts before the sentence is finished. Each token from the language "
    "model goes to the server as it arrives, and the audio comes back while the rest is still being written."
)
INSTRUCTIONS = "You are a voice assistant. Answer in plain spoken sentences, no markup."


def make_tts(address: str, voice: str | None = None, sample_rate: int = 24000) -> livekit_tts.TTS:
    return livekit_tts.TTS(address=address, voice_id=voice, sample_rate=sample_rate,
                           token=os.environ.get("LIVESPEECH_TOKEN"))


async def llm_tokens(prompt: str) -> AsyncIterator[str]:
    if not os.environ.get("OPENAI_API_KEY"):
        print("OPENAI_API_KEY is not set: a canned reply stands in for the LLM", file=sys.stderr)
        async for token in llm_stream(CANNED_REPLY, rate=40, seed=0):
            yield token
        return
    from openai import AsyncOpenAI

    llm = AsyncOpenAI(base_url=os.environ.get("OPENAI_BASE_URL"))
    stream = await llm.chat.completions.create(
        model=os.environ.get("OPENAI_MODEL", "gpt-4.1-mini"), stream=True,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": prompt}],
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            yield chunk.choices[0].delta.content


async def reply(args: argparse.Namespace) -> None:
    tts = make_tts(args.address, args.voice, args.sample_rate)
    tts.on("synthesis_summary", lambda s: print(
        f"spoken: {s.audio_s:.2f} s of audio, server TTFA "
        f"{'-' if s.ttfa_s is None else f'{s.ttfa_s * 1000:.0f} ms'}, cancelled={s.cancelled}"))
    with wave.open(args.output, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(args.sample_rate)
        async with tts.stream() as stream:

            async def forward() -> None:
                async for token in llm_tokens(args.prompt):
                    stream.push_text(token)
                stream.end_input()

            forwarding = asyncio.create_task(forward())
            async for ev in stream:
                wav.writeframes(ev.frame.data.tobytes())
                for word in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, []):
                    print(f"{word.start_time:7.2f} s  {word.strip()}")
            await forwarding
    await tts.aclose()
    print(f"wrote {args.output}")


def run_agent() -> None:
    from livekit.agents import Agent, AgentServer, AgentSession, JobContext, cli

    server = AgentServer()

    @server.rtc_session()
    async def entrypoint(ctx: JobContext) -> None:
        session = AgentSession(
            stt="deepgram/nova-3",
            llm="openai/gpt-4.1-mini",
            tts=make_tts(os.environ.get("LIVESPEECH_ADDRESS", "127.0.0.1:50051"), os.environ.get("LIVESPEECH_VOICE")),
            use_tts_aligned_transcript=True,
        )
        await session.start(room=ctx.room, agent=Agent(instructions=INSTRUCTIONS))
        await session.generate_reply(instructions="Greet the user and offer your help.")

    cli.run_app(server)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "reply":
        ap = argparse.ArgumentParser(prog="livekit_agent.py reply")
        ap.add_argument("prompt", nargs="?", default="Explain streaming text-to-speech in two sentences.")
        ap.add_argument("-o", "--output", default="reply.wav")
        ap.add_argument("--address", default=os.environ.get("LIVESPEECH_ADDRESS", "127.0.0.1:50051"))
        ap.add_argument("--voice", default=None, help="a voice id (livespeech voices list)")
        ap.add_argument("--sample-rate", type=int, default=24000)
        asyncio.run(reply(ap.parse_args(sys.argv[2:])))
    else:
        run_agent()
