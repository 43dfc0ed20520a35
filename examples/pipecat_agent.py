"""A pipecat pipeline speaking a streamed LLM reply through LiveSpeech.

    livespeech serve &                                   # the local server
    pip install -e '.[pipecat]'
    python examples/pipecat_agent.py "Tell me about streaming speech." -o reply.wav

The pipeline is [LLM, LiveSpeechTTSService, a sink that writes the audio to a WAV file
and prints each word at its timestamp]. The LLM is OpenAI's chat API when
OPENAI_API_KEY is set (OPENAI_MODEL picks the model, default gpt-4.1-mini; OPENAI_BASE_URL
any OpenAI-compatible server); without a key a canned reply stands in for it, streamed as
~4-character tokens at 40 tokens/s. In a voice agent, put the service between the LLM and
the transport's output, as any pipecat TTS.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import wave
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from pipecat.frames.frames import (
    EndFrame,
    Frame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from livespeech.client.client import llm_stream
from livespeech.client.pipecat_tts import LiveSpeechTTSService

CANNED_REPLY = (
    "Streaming speech starts before the sentence is finished. Each token from the language "
    "model goes to the server as it arrives, and the audio comes back while the rest is still being written."
)


class CannedLLM(FrameProcessor):
    """Stands in for an LLM without an API key: answers a context with a fixed reply, token by token."""

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if not isinstance(frame, LLMContextFrame):
            await self.push_frame(frame, direction)
            return
        await self.push_frame(LLMFullResponseStartFrame())
        async for token in llm_stream(CANNED_REPLY, rate=40, seed=0):
            await self.push_frame(LLMTextFrame(token))
        await self.push_frame(LLMFullResponseEndFrame())


class WavSink(FrameProcessor):
    """Writes the reply's audio to a WAV file and prints its words at their timestamps."""

    def __init__(self, path: str, sample_rate: int) -> None:
        super().__init__()
        self.done = asyncio.Event()
        self._wav = wave.open(path, "wb")
        self._wav.setnchannels(1)
        self._wav.setsampwidth(2)
        self._wav.setframerate(sample_rate)
        self._first_pts: int | None = None

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self._wav.writeframes(frame.audio)
        elif isinstance(frame, TTSTextFrame) and frame.pts is not None:
            self._first_pts = frame.pts if self._first_pts is None else self._first_pts
            print(f"{(frame.pts - self._first_pts) / 1e9:7.2f} s  {frame.text}")
        elif isinstance(frame, LLMFullResponseEndFrame):
            self._wav.close()
            self.done.set()
        await self.push_frame(frame, direction)


def make_llm() -> FrameProcessor:
    if not os.environ.get("OPENAI_API_KEY"):
        print("OPENAI_API_KEY is not set: a canned reply stands in for the LLM", file=sys.stderr)
        return CannedLLM()
    from pipecat.services.openai.llm import OpenAILLMService

    return OpenAILLMService(
        api_key=os.environ["OPENAI_API_KEY"],
        base_url=os.environ.get("OPENAI_BASE_URL"),
        settings=OpenAILLMService.Settings(model=os.environ.get("OPENAI_MODEL", "gpt-4.1-mini")),
    )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", nargs="?", default="Explain streaming text-to-speech in two sentences.")
    ap.add_argument("-o", "--output", default="reply.wav")
    ap.add_argument("--address", default=os.environ.get("LIVESPEECH_ADDRESS", "127.0.0.1:50051"))
    ap.add_argument("--voice", default=None, help="a voice id (livespeech voices list)")
    ap.add_argument("--sample-rate", type=int, default=24000)
    args = ap.parse_args()

    tts = LiveSpeechTTSService(address=args.address, voice_id=args.voice, token=os.environ.get("LIVESPEECH_TOKEN"))

    @tts.event_handler("on_synthesis_summary")
    async def on_summary(service, context_id, summary):
        ttfa = f"{summary.ttfa_s * 1000:.0f} ms" if summary.ttfa_s is not None else "-"
        print(f"spoken: {summary.audio_s:.2f} s of audio, server TTFA {ttfa}, cancelled={summary.cancelled}")

    sink = WavSink(args.output, args.sample_rate)
    worker = PipelineWorker(
        Pipeline([make_llm(), tts, sink]),
        params=PipelineParams(audio_out_sample_rate=args.sample_rate),
        cancel_on_idle_timeout=False,
        enable_rtvi=False,
    )
    context = LLMContext(messages=[
        {"role": "system", "content": "You are a voice assistant. Answer in plain spoken sentences, no markup."},
        {"role": "user", "content": args.prompt},
    ])

    @worker.event_handler("on_pipeline_started")
    async def on_started(worker, frame):
        await worker.queue_frame(LLMContextFrame(context))

    async def end_after_reply() -> None:
        await sink.done.wait()
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=True)
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), end_after_reply())
    print(f"wrote {args.output}")


if __name__ == "__main__":
    asyncio.run(main())
