"""Voices: built-in ones from the model bundle (read-only) and registered ones.

A registered voice is stored as `<voices_dir>/<voice_id>.wav` (the reference speech,
24 kHz mono PCM16) plus `<voice_id>.json` (metadata), both written atomically; the JSON
is written last and removed first, so it marks a complete voice. `voices_dir=None` keeps
voices in memory.

The directory is the truth and memory a cache of enrolled voices (`engine.make_voice`,
in an executor), so replicas that share the directory (a ReadWriteMany volume) share
their voices: a lookup re-opens its voice's JSON and re-reads the voice if the file
changed, appeared or went; ListVoices and a default lookup re-scan the tenant's
directory; `rescan()` (at startup, and every `rescan_s`) the whole directory. A voice
registered or deleted on one replica is therefore seen by the next call on any other.
Writers (register, delete) hold the directory's lock (`_directory_lock`), so "already
exists" and the voice limits hold across replicas. Voices survive restarts and model
upgrades: a stored voice is re-enrolled with the model that reads it.

Tenants (server/auth.py): each tenant has its own namespace of registered voices,
stored under `<voices_dir>/<tenant>/`; the anonymous tenant "" (authentication off)
uses `<voices_dir>/` itself. A tenant sees the built-in voices and its own, never
another tenant's (an unknown and a foreign voice are both NOT_FOUND). Every path is
built from ids that match `VOICE_ID_RE` in full (no separators, dots, NUL or non-ASCII
lookalikes) and is checked to lie in its tenant's directory before anything is written.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows: writers are then excluded within one process only
    fcntl = None  # type: ignore[assignment]

import numpy as np

from livespeech.api.audio import decode_wav, encode_wav
from livespeech.api.session import ConfigError, EngineAPI, Voice, VoiceInfo
from livespeech.models.resample import resample

from .audio import MODEL_SAMPLE_RATE

log = logging.getLogger(__name__)

# matched with fullmatch: `$` would also accept a trailing newline ("a\n" -> a file
# name with a newline in it)
VOICE_ID_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MIN_REFERENCE_S = 0.1
REFERENCE_RATES = (8_000, 192_000)  # accepted input sample-rate range
DEFAULT_VOICE_ID = "default"

# a stored voice's identity: its JSON's inode, mtime and size (a rewrite is a new inode)
Stamp = tuple[int, int, int]
_PROCESS_LOCK = threading.Lock()


def _stamp(st: os.stat_result) -> Stamp:
    return st.st_ino, st.st_mtime_ns, st.st_size


class VoiceStoreError(Exception):
    """A voice operation failed; `code` is the grpc.StatusCode name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_voice_id(voice_id: str) -> str:
    if not isinstance(voice_id, str) or not VOICE_ID_RE.fullmatch(voice_id):
        shown = repr(voice_id)
        shown = shown if len(shown) <= 80 else shown[:80] + "..."  # the error echoes a bounded part
        raise ConfigError(f"voice_id must match ^{VOICE_ID_RE.pattern}$, got {shown}")
    return voice_id


def prepare_reference(samples: np.ndarray, sample_rate: int, max_seconds: float, field: str) -> np.ndarray:
    """Validate reference speech and bring it to the model rate (float32 mono, 24 kHz)."""
    lo, hi = REFERENCE_RATES
    if not lo <= sample_rate <= hi:
        raise ConfigError(f"{field}.sample_rate must be in [{lo}, {hi}], got {sample_rate}")
    seconds = len(samples) / sample_rate
    if seconds < MIN_REFERENCE_S:
        raise ConfigError(f"{field}: reference audio is {seconds:.3f} s, need >= {MIN_REFERENCE_S} s")
    if seconds > max_seconds:
        raise ConfigError(f"{field}: reference audio is {seconds:.1f} s, longer than the limit of {max_seconds:g} s")
    x = np.asarray(samples, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        raise ConfigError(f"{field}: reference audio has non-finite samples")
    return resample(x, sample_rate, MODEL_SAMPLE_RATE)


def decode_reference(
    *, pcm16_le: Optional[bytes] = None, sample_rate: int = 0, wav: Optional[bytes] = None, max_seconds: float, field: str
) -> np.ndarray:
    """PCM16 bytes + rate, or WAV bytes -> validated 24 kHz float32."""
    from livespeech.api.audio import pcm16_to_float

    if wav is not None:
        # cheap size check before decoding: 48 kHz, 32-bit, stereo is an upper bound
        if len(wav) > max_seconds * 192_000 * 8 + 4096:
            raise ConfigError(f"{field}: WAV file too large for the limit of {max_seconds:g} s")
        try:
            x, rate = decode_wav(wav)
        except ValueError as e:
            raise ConfigError(f"{field}: {e}") from None
        return prepare_reference(x, rate, max_seconds, field)
    data = pcm16_le or b""
    if len(data) % 2:
        raise ConfigError(f"{field}.pcm16_le has an odd number of bytes")
    if sample_rate and len(data) / 2 / sample_rate > max_seconds:  # before converting
        raise ConfigError(
            f"{field}: reference audio is {len(data) / 2 / sample_rate:.1f} s, longer than the limit of {max_seconds:g} s"
        )
    return prepare_reference(pcm16_to_float(data), sample_rate, max_seconds, field)


def builtin_reference_audio(engine: EngineAPI) -> Mapping[str, np.ndarray]:
    """Built-in voices of the model bundle: voice_id -> 24 kHz reference audio.

    The model directory's `voices/*.wav`, via `EngineAPI.builtin_voices`."""
    return engine.builtin_voices or {}


class VoiceStore:
    def __init__(
        self,
        directory: Optional[Path],
        engine: EngineAPI,
        *,
        max_voices: int = 1000,
        max_voices_per_tenant: Optional[int] = None,
        rescan_s: float = 0.0,
    ) -> None:
        self.dir = Path(directory) if directory is not None else None
        self.engine = engine
        self.max_voices = max_voices
        self.max_voices_per_tenant = max_voices if max_voices_per_tenant is None else max_voices_per_tenant
        self.rescan_s = rescan_s  # > 0: `rescan()` every this many seconds (started by `load`)
        self._builtin: dict[str, Voice] = {}
        self._voices: dict[tuple[str, str], tuple[Voice, VoiceInfo]] = {}  # (tenant, voice_id)
        # the JSON file each cached voice was read from (also for a file that failed to
        # load: it is not read again until it changes)
        self._stamps: dict[tuple[str, str], Stamp] = {}
        self._reading: dict[tuple[str, str], asyncio.Future] = {}  # one read per voice at a time
        self._lock = asyncio.Lock()
        self._rescanner: Optional[asyncio.Task] = None

    # ---------------------------------------------------------------- startup

    async def load(self) -> None:
        """Built-in voices from the engine, then every stored voice (re-enrolled)."""
        loop = asyncio.get_running_loop()
        for voice_id, audio in builtin_reference_audio(self.engine).items():
            self._builtin[voice_id] = await loop.run_in_executor(
                None, self.engine.make_voice, voice_id, audio, MODEL_SAMPLE_RATE
            )
        if self.dir is None:
            return
        await asyncio.to_thread(self.dir.mkdir, parents=True, exist_ok=True)
        await self.rescan()
        log.info("voices: %d built-in, %d registered", len(self._builtin), len(self._voices))
        if self.rescan_s > 0:
            self._rescanner = asyncio.ensure_future(self._rescan_every(self.rescan_s))

    async def close(self) -> None:
        if self._rescanner is not None:
            self._rescanner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._rescanner
            self._rescanner = None

    async def _rescan_every(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.rescan()
            except Exception as e:  # e.g. the volume briefly unavailable: the next pass retries
                log.warning("voices: rescan of %s failed: %s", self.dir, e)

    async def rescan(self, tenant: Optional[str] = None) -> None:
        """Bring the cache in line with the directory (one tenant's voices, or all): voices
        written since are enrolled, changed ones re-enrolled, removed ones dropped."""
        if self.dir is None:
            return
        tenants = [tenant] if tenant is not None else await asyncio.to_thread(self._tenants)
        for t in tenants:
            on_disk = await asyncio.to_thread(self._scan, t)
            for key in [k for k in self._stamps if k[0] == t and k[1] not in on_disk]:
                self._forget(key)
            for voice_id, stamp in sorted(on_disk.items()):
                if self._stamps.get((t, voice_id)) != stamp:
                    await self._refresh((t, voice_id))

    # ---------------------------------------------------------------- lookups

    async def get(self, voice_id: str, tenant: str = "") -> Voice:
        if voice_id in self._builtin:
            return self._builtin[voice_id]
        key = (tenant, voice_id)
        if self.dir is not None:
            await self._refresh(key)
        if key in self._voices:
            return self._voices[key][0]
        raise VoiceStoreError("NOT_FOUND", f"voice_id {voice_id!r} not found")

    def _registered(self, tenant: str) -> dict[str, tuple[Voice, VoiceInfo]]:
        return {v: entry for (t, v), entry in self._voices.items() if t == tenant}

    async def default(self, tenant: str = "") -> tuple[str, Voice]:
        """The voice for a config that names none: built-in 'default', else the first
        built-in, else the tenant's first registered voice."""
        if not self._builtin:
            await self.rescan(tenant)
        for table in (self._builtin, {k: v for k, (v, _) in self._registered(tenant).items()}):
            if DEFAULT_VOICE_ID in table:
                return DEFAULT_VOICE_ID, table[DEFAULT_VOICE_ID]
            if table:
                voice_id = sorted(table)[0]
                return voice_id, table[voice_id]
        raise VoiceStoreError("FAILED_PRECONDITION", "no default voice: set voice_id or enrollment")

    async def list(self, tenant: str = "") -> list[VoiceInfo]:
        await self.rescan(tenant)
        out = [VoiceInfo(v, True) for v in sorted(self._builtin)]
        return out + [info for _, (_, info) in sorted(self._registered(tenant).items())]

    # ---------------------------------------------------------------- changes

    async def register(
        self, voice_id: str, reference_24k: np.ndarray, *, overwrite: bool = False, tenant: str = ""
    ) -> VoiceInfo:
        """`reference_24k`: validated float32 mono at 24 kHz (see `decode_reference`)."""
        check_voice_id(voice_id)
        key = (tenant, voice_id)
        async with self._lock:
            if voice_id in self._builtin:
                raise VoiceStoreError("FAILED_PRECONDITION", f"voice {voice_id!r} is built in and read-only")
            if self.dir is None:
                self._admit(voice_id, tenant, overwrite, key in self._voices, len(self._registered(tenant)), len(self._voices))
            loop = asyncio.get_running_loop()
            voice = await loop.run_in_executor(
                None, self.engine.make_voice, voice_id, reference_24k, MODEL_SAMPLE_RATE
            )
            info = VoiceInfo(voice_id, False, len(reference_24k) / MODEL_SAMPLE_RATE, int(time.time() * 1000))
            if self.dir is not None:
                # the directory is the truth other replicas share: its checks and the write
                # happen under its lock
                self._stamps[key] = await asyncio.to_thread(self._store, tenant, info, reference_24k, overwrite)
            self._voices[key] = (voice, info)
            return info

    async def delete(self, voice_id: str, tenant: str = "") -> None:
        check_voice_id(voice_id)
        key = (tenant, voice_id)
        async with self._lock:
            if voice_id in self._builtin:
                raise VoiceStoreError("FAILED_PRECONDITION", f"voice {voice_id!r} is built in and read-only")
            if self.dir is not None:
                try:
                    await asyncio.to_thread(self._remove, tenant, voice_id)
                except VoiceStoreError:
                    self._forget(key)  # cached here, deleted by another replica
                    raise
            elif key not in self._voices:
                raise VoiceStoreError("NOT_FOUND", f"voice_id {voice_id!r} not found")
            self._forget(key)

    def _admit(self, voice_id: str, tenant: str, overwrite: bool, exists: bool, tenant_count: int, total: int) -> None:
        if exists and not overwrite:
            raise VoiceStoreError("ALREADY_EXISTS", f"voice {voice_id!r} already exists (set overwrite)")
        if not exists:
            # the anonymous tenant (no authentication) is the whole server: max_voices
            if tenant and tenant_count >= self.max_voices_per_tenant:
                raise VoiceStoreError("RESOURCE_EXHAUSTED", f"voice limit per tenant reached ({self.max_voices_per_tenant})")
            if total >= self.max_voices:
                raise VoiceStoreError("RESOURCE_EXHAUSTED", f"voice limit reached ({self.max_voices})")

    def _forget(self, key: tuple[str, str]) -> None:
        self._voices.pop(key, None)
        self._stamps.pop(key, None)

    # ---------------------------------------------------------------- the directory

    async def _refresh(self, key: tuple[str, str]) -> None:
        """Re-read one voice if its file changed (or appeared, or went) since it was cached."""
        reading = self._reading.get(key)
        if reading is None:
            reading = self._reading[key] = asyncio.ensure_future(self._reread(key))
            reading.add_done_callback(lambda _: self._reading.pop(key, None))
        await asyncio.shield(reading)

    async def _reread(self, key: tuple[str, str]) -> None:
        tenant, voice_id = key
        stamp: Optional[Stamp] = None
        try:
            found = await asyncio.to_thread(self._read, tenant, voice_id, self._stamps.get(key))
            if found is None:
                self._forget(key)
                return
            stamp, loaded = found
            if loaded is None:  # unchanged
                return
            if isinstance(loaded, Exception):
                raise loaded
            samples, rate, info = loaded
            voice = await asyncio.get_running_loop().run_in_executor(None, self.engine.make_voice, voice_id, samples, rate)
        except Exception as e:  # one bad file must not fail the others (nor keep a server down)
            log.error("skipping stored voice %s of tenant %r: %s", voice_id, tenant, e)
            self._forget(key)
            if stamp is not None:
                self._stamps[key] = stamp  # not read again until the file changes
            return
        self._voices[key] = (voice, info)
        self._stamps[key] = stamp

    def _read(self, tenant: str, voice_id: str, known: Optional[Stamp]) -> Optional[tuple[Stamp, Any]]:
        """None: no such voice; (stamp, None): unchanged since `known`; (stamp, error): a
        file that does not load; else (stamp, (samples, rate, info))."""
        try:
            # opened, not stat()ed: NFS revalidates a file's attributes on open
            # (close-to-open consistency), a bare stat may answer from its cache
            with open(self._path(tenant, voice_id, ".json"), "rb") as f:
                stamp = _stamp(os.fstat(f.fileno()))
                if stamp == known:
                    return stamp, None
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            meta = json.loads(raw)
            if check_voice_id(meta["voice_id"]) != voice_id:
                raise ValueError("file name does not match voice_id")
            samples, rate = decode_wav(self._path(tenant, voice_id, ".wav").read_bytes())
            info = VoiceInfo(voice_id, False, float(meta.get("reference_s", 0.0)), int(meta.get("created_unix_ms", 0)))
        except FileNotFoundError:
            return None  # deleted between the two reads
        except Exception as e:
            return stamp, e
        return stamp, (samples, rate, info)

    def _tenants(self) -> list[str]:
        assert self.dir is not None
        return [""] + sorted(p.name for p in self.dir.iterdir() if p.is_dir() and VOICE_ID_RE.fullmatch(p.name))

    def _scan(self, tenant: str) -> dict[str, Stamp]:
        """voice_id -> stamp of every complete voice (its JSON) in the tenant's directory."""
        out: dict[str, Stamp] = {}
        try:
            entries = os.scandir(self._tenant_dir(tenant))
        except FileNotFoundError:
            return out
        with entries:
            for e in entries:
                voice_id = e.name[:-5]
                if e.name.endswith(".json") and VOICE_ID_RE.fullmatch(voice_id):
                    with contextlib.suppress(FileNotFoundError):
                        out[voice_id] = _stamp(e.stat())
        return out

    @contextlib.contextmanager
    def _directory_lock(self) -> Iterator[None]:
        """Writers of the directory, in this process and in every replica, one at a time:
        the checks before a write (exists, limits) see every earlier write. An fcntl lock
        on `.lock` (NFSv4, CephFS, EFS and Azure Files NFS hold it across clients); the
        process lock, because fcntl locks do not exclude threads of one process."""
        assert self.dir is not None
        with _PROCESS_LOCK:
            fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if fcntl is not None:
                    fcntl.lockf(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the fcntl lock

    def _store(self, tenant: str, info: VoiceInfo, reference_24k: np.ndarray, overwrite: bool) -> Stamp:
        with self._directory_lock():
            json_path = self._path(tenant, info.voice_id, ".json")
            total = sum(len(self._scan(t)) for t in self._tenants())
            self._admit(info.voice_id, tenant, overwrite, json_path.exists(), len(self._scan(tenant)), total)
            self._write(tenant, info, reference_24k)
            return _stamp(json_path.stat())

    def _remove(self, tenant: str, voice_id: str) -> None:
        with self._directory_lock():
            json_path = self._path(tenant, voice_id, ".json")
            if not json_path.exists():
                raise VoiceStoreError("NOT_FOUND", f"voice_id {voice_id!r} not found")
            for suffix in (".json", ".wav"):  # JSON first: it marks a complete voice
                self._path(tenant, voice_id, suffix).unlink(missing_ok=True)

    def _tenant_dir(self, tenant: str) -> Path:
        assert self.dir is not None
        if tenant and not VOICE_ID_RE.fullmatch(tenant):  # auth.TENANT_RE is this alphabet; never from a client
            raise ValueError(f"bad tenant name {tenant!r}")
        return self.dir / tenant if tenant else self.dir

    def _path(self, tenant: str, voice_id: str, suffix: str) -> Path:
        """The file of a voice, checked to lie directly in its tenant's directory."""
        check_voice_id(voice_id)
        folder = self._tenant_dir(tenant)
        path = folder / f"{voice_id}{suffix}"
        # defence in depth: the id check above already rules out separators and dots
        if path.resolve().parent != folder.resolve():
            raise ValueError(f"voice path escapes {folder}")
        return path

    def _write(self, tenant: str, info: VoiceInfo, reference_24k: np.ndarray) -> None:
        self._tenant_dir(tenant).mkdir(parents=True, exist_ok=True)
        meta = dict(asdict(info), sample_rate=MODEL_SAMPLE_RATE)
        del meta["builtin"]
        _atomic_write(self._path(tenant, info.voice_id, ".wav"), encode_wav(reference_24k, MODEL_SAMPLE_RATE))
        _atomic_write(self._path(tenant, info.voice_id, ".json"), json.dumps(meta, indent=1).encode())


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

