"""How often an engine step reads the device back to the host.

    python -m livespeech.loadtest.host_reads --model-path random:tiny --batch 1 32
    python -m livespeech.loadtest.host_reads --model-path random:paper --device cuda --batch 1 256

On a GPU every read (`.item()`, `.tolist()`, `bool(t)`, `nonzero`, ...) waits for the
queued kernels, so the host cannot run ahead of the device; the step should read once,
the new frame's tokens of all sessions, whatever the batch. This runs the real engine
(server/engine.py) on `batch` sessions in-process and counts, per step, the calls that
hand tensor data to Python (`HostReads`, a torch function mode: on the CPU the same calls
are made, so the count holds there too). The codec's packets are counted apart: the server
decodes them on its own thread, off the step's path, and a packet's audio is a read by
nature.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import math
import threading
import traceback
from typing import Any, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

# the tensor methods and functions whose result is data on the host, or whose output
# shape depends on the data (so the host waits for it)
READS = frozenset({"item", "tolist", "numpy", "cpu", "__array__", "__bool__", "__int__", "__float__", "__index__",
                   "nonzero", "masked_select", "unique", "unique_consecutive"})


def _site() -> str:
    """The caller: the innermost frame outside torch and this module."""
    frame = next((f for f in reversed(traceback.extract_stack()[:-2])
                  if "/torch/" not in f.filename and f.filename != __file__), None)
    return f"{'/'.join(frame.filename.split('/')[-2:])}:{frame.lineno}" if frame else "?"


def _is_upload(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call copies host data to a device: a tensor made from Python data with a
    `device`, or a host tensor moved with `.to(device)` / `.cuda()`. On the CPU, where
    every tensor is a host tensor, a `.to(device)` of a tensor already there counts too."""
    if name in ("tensor", "as_tensor"):
        return kwargs.get("device") is not None
    if name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
        targets = (*args[1:], kwargs.get("device"))
        return name == "cuda" or any(isinstance(t, (torch.device, str)) for t in targets)
    return False


class HostReads(TorchFunctionMode):
    """Counts host reads (`total`, `sites`) and copies from the host to the device
    (`uploads`, `upload_sites`) on the thread that enters it: on a GPU, a copy from
    pageable host memory waits for the queued kernels as a read does. `paused` stops
    counting (re-entrant)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.sites: collections.Counter = collections.Counter()  # "file:line name" -> calls
        self.uploads = 0
        self.upload_sites: collections.Counter = collections.Counter()
        self._paused = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = getattr(func, "__name__", "")
        if not self._paused:
            if name in READS:
                self.total += 1
                self.sites[f"{_site()} {name}"] += 1
            elif _is_upload(name, args, kwargs or {}):
                self.uploads += 1
                self.upload_sites[f"{_site()} {name}"] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1


def engine_step_reads(bundle: Any, batch: int, steps: int = 40, warmup: int = 10, guidance_lambda: float = 1.0,
                      text_chars: int = 300, timeout_s: float = 600.0, device_guidance: bool = False,
                      cuda_graphs: bool = False) -> dict:
    """Host reads of `steps` engine steps at the full `batch` (after `warmup` steps): per
    step outside the codec (`step`), and the codec's (`codec`, when a packet was decoded
    on the engine thread), with the sites they come from; and the step's copies from the
    host (`uploads`, outside the codec too)."""
    from livespeech.api.session import SessionConfig
    from livespeech.loadtest.profile_step import TEXT, noise_reference
    from livespeech.server.engine import Engine, EngineConfig

    engine = Engine(bundle, EngineConfig(max_sessions=batch, max_lead_s=1e6, max_session_s=3600.0,
                                         device_guidance=device_guidance, cuda_graphs=cuda_graphs))
    voice = engine.make_voice("reads", noise_reference(), 24000)
    text = (TEXT * (text_chars // len(TEXT) + 1))[:text_chars]
    text = text[: text.rfind(" ")] + "."
    step_reads: list[int] = []
    step_uploads: list[int] = []
    codec_reads: list[int] = []
    sites: collections.Counter = collections.Counter()
    upload_sites: collections.Counter = collections.Counter()
    done = threading.Event()
    inner_step, inner_decode = engine._step, engine.runner.decode
    counting: dict[int, HostReads] = {}  # the engine thread's, while it steps

    def decode(*args: Any, **kw: Any) -> Any:
        step = counting.get(threading.get_ident())
        if step is None:  # on the codec thread, or between counted steps
            return inner_decode(*args, **kw)
        with step.paused(), HostReads() as codec:
            out = inner_decode(*args, **kw)
        codec_reads[-1] += codec.total
        return out

    def counted_step(sessions: list) -> None:
        if len(sessions) < batch or done.is_set():
            return inner_step(sessions)
        with HostReads() as reads:
            counting[threading.get_ident()] = reads
            step_reads.append(0)
            codec_reads.append(0)
            try:
                inner_step(sessions)
            finally:
                counting.clear()
        step_reads[-1] = reads.total
        step_uploads.append(reads.uploads)
        if len(step_reads) > warmup:
            sites.update(reads.sites)
            upload_sites.update(reads.upload_sites)
        if len(step_reads) >= warmup + steps:
            done.set()

    engine._step = counted_step
    engine.runner.decode = decode
    for i in range(batch):
        session = engine.open_session(SessionConfig(guidance_lambda=guidance_lambda, seed=i), voice, lambda ev: None)
        session.push_text(text)
        session.end_input()
    engine.start()
    try:
        if not done.wait(timeout_s):
            raise TimeoutError(f"batch {batch}: {len(step_reads)} full steps in {timeout_s:.0f} s")
    finally:
        engine.stop()
    n = len(step_reads) - warmup
    return {"batch": batch, "steps": n, "step": step_reads[warmup:], "codec": codec_reads[warmup:],
            "sites_per_step": {k: v / n for k, v in sites.most_common()}, "uploads": step_uploads[warmup:],
            "upload_sites_per_step": {k: v / n for k, v in upload_sites.most_common()}}


def main(argv: Optional[list] = None) -> int:
    import torch

    from livespeech.models.loading import load_bundle

    ap = argparse.ArgumentParser(prog="python -m livespeech.loadtest.host_reads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="random:tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lambda", dest="guidance_lambda", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device-guidance", action="store_true", help="every slot's guidance as tensors on the device")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="the step recorded with its sampling and commit, one graph a batch-size bucket")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    bundle = load_bundle(a.model_path, device=a.device)
    for b in a.batch:
        r = engine_step_reads(bundle, b, steps=a.steps, guidance_lambda=a.guidance_lambda,
                              device_guidance=a.device_guidance, cuda_graphs=a.cuda_graphs)
        dist = sorted(collections.Counter(r["step"]).items())
        lam = "inf" if math.isinf(a.guidance_lambda) else a.guidance_lambda
        print(f"batch {b} (lambda {lam}): {r['steps']} steps; host reads per step: "
              + ", ".join(f"{k} on {v}" for k, v in dist)
              + f"; codec on the engine thread: {sum(r['codec'])} reads in {sum(1 for c in r['codec'] if c)} steps")
        for site, per in r["sites_per_step"].items():
            print(f"  {per:6.2f} a step  {site}")
        ups = sorted(collections.Counter(r["uploads"]).items())
        print("  copies from the host per step: " + ", ".join(f"{k} on {v}" for k, v in ups))
        for site, per in r["upload_sites_per_step"].items():
            print(f"  {per:6.2f} a step  {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
