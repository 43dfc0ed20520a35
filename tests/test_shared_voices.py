"""Voices shared through one directory (a ReadWriteMany volume in Kubernetes): two
`VoiceStore`s on the same directory stand for two replicas. What one registers,
overwrites or deletes, the other sees on its next call; "already exists", the voice
limits and the tenant namespaces hold across them. The same through real replicas behind
nginx: tests/test_multi_replica.py, `test_voices_are_shared_behind_nginx`."""
from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_engine import FakeEngine  # noqa: E402
from livespeech.server.voices import VoiceStore, VoiceStoreError  # noqa: E402

SECOND = np.full(24_000, 0.1, np.float32)


def replicas(directory: Path, n: int = 2, **kw) -> list[VoiceStore]:
    async def make() -> list[VoiceStore]:
        stores = [VoiceStore(directory, FakeEngine(builtin=()), **kw) for _ in range(n)]
        for s in stores:
            await s.load()
        return stores

    return asyncio.run(make())


async def code_of(coro) -> str:
    with pytest.raises(VoiceStoreError) as e:
        await coro
    return e.value.code


def test_what_one_replica_registers_another_finds_lists_and_deletes(tmp_path: Path) -> None:
    a, b = replicas(tmp_path)

    async def go() -> None:
        await a.register("alice", SECOND)
        assert (await b.get("alice")).voice_id == "alice"
        assert [v.voice_id for v in await b.list()] == ["alice"]
        assert await b.default() == ("alice", await b.get("alice"))
        await b.delete("alice")
        assert await code_of(a.get("alice")) == "NOT_FOUND"
        assert await a.list() == []
        assert await code_of(a.delete("alice")) == "NOT_FOUND"

    asyncio.run(go())


def test_an_overwrite_on_one_replica_is_what_the_other_uses(tmp_path: Path) -> None:
    a, b = replicas(tmp_path)

    async def go() -> None:
        await a.register("alice", SECOND)
        assert (await b.get("alice")).n_samples == 24_000
        await b.register("alice", SECOND[:12_000], overwrite=True)
        assert (await a.get("alice")).n_samples == 12_000
        assert [v.reference_s for v in await a.list()] == [0.5]

    asyncio.run(go())


def test_an_unchanged_voice_is_not_enrolled_again(tmp_path: Path) -> None:
    a, b = replicas(tmp_path)

    async def go() -> None:
        await a.register("alice", SECOND)
        for _ in range(3):
            await b.get("alice")
            await b.list()
        assert b.engine.made_voices == ["alice"]

    asyncio.run(go())


def test_already_exists_and_limits_hold_across_replicas(tmp_path: Path) -> None:
    a, b = replicas(tmp_path, max_voices=3, max_voices_per_tenant=1)

    async def go() -> None:
        await a.register("alice", SECOND, tenant="acme")
        assert await code_of(b.register("alice", SECOND, tenant="acme")) == "ALREADY_EXISTS"
        assert await code_of(b.register("bob", SECOND, tenant="acme")) == "RESOURCE_EXHAUSTED"
        await b.register("alice", SECOND, tenant="globex")
        await a.register("carol", SECOND, tenant="initech")
        assert await code_of(b.register("dave", SECOND, tenant="umbrella")) == "RESOURCE_EXHAUSTED"  # max_voices

    asyncio.run(go())


def test_simultaneous_registrations_of_one_id_make_one_voice(tmp_path: Path) -> None:
    stores = replicas(tmp_path, n=4)

    async def go() -> None:
        results = await asyncio.gather(
            *(s.register("alice", SECOND[: 6_000 * (i + 1)]) for i, s in enumerate(stores)), return_exceptions=True
        )
        ok = [r for r in results if not isinstance(r, Exception)]
        assert len(ok) == 1 and all(isinstance(r, VoiceStoreError) and r.code == "ALREADY_EXISTS" for r in results if r not in ok)
        # every replica uses the one that was written
        assert {(await s.get("alice")).n_samples for s in stores} == {round(ok[0].reference_s * 24_000)}

    asyncio.run(go())


def test_tenants_stay_apart_across_replicas(tmp_path: Path) -> None:
    a, b = replicas(tmp_path)

    async def go() -> None:
        await a.register("alice", SECOND, tenant="acme")
        assert await code_of(b.get("alice", tenant="globex")) == "NOT_FOUND"
        assert await code_of(b.get("alice")) == "NOT_FOUND"  # the anonymous tenant is another one
        assert await b.list(tenant="globex") == []
        assert await code_of(b.delete("alice", tenant="globex")) == "NOT_FOUND"
        await b.register("alice", SECOND[:12_000], tenant="globex")
        assert (await a.get("alice", tenant="acme")).n_samples == 24_000
        assert (await a.get("alice", tenant="globex")).n_samples == 12_000
        assert (tmp_path / "acme" / "alice.json").is_file() and (tmp_path / "globex" / "alice.json").is_file()

    asyncio.run(go())


def test_rescan_enrolls_new_voices_and_drops_deleted_ones(tmp_path: Path) -> None:
    a, b = replicas(tmp_path)

    async def go() -> None:
        await a.register("alice", SECOND, tenant="acme")
        await b.rescan()
        assert b.engine.made_voices == ["alice"]  # before any session asked for it
        await a.delete("alice", tenant="acme")
        await b.rescan()
        assert ("acme", "alice") not in b._voices

    asyncio.run(go())


def test_the_periodic_rescan_runs(tmp_path: Path) -> None:
    async def go() -> None:
        a = VoiceStore(tmp_path, FakeEngine(builtin=()))
        b = VoiceStore(tmp_path, FakeEngine(builtin=()), rescan_s=0.05)
        await a.load()
        await b.load()
        try:
            await a.register("alice", SECOND)
            for _ in range(200):
                if b.engine.made_voices:
                    break
                await asyncio.sleep(0.05)
            assert b.engine.made_voices == ["alice"]
        finally:
            await b.close()
        assert b._rescanner is None

    asyncio.run(go())


def test_incomplete_and_broken_files_are_not_voices(tmp_path: Path, caplog) -> None:
    (a,) = replicas(tmp_path, n=1)

    async def go() -> None:
        await a.register("good", SECOND)
        (tmp_path / "half.wav").write_bytes((tmp_path / "good.wav").read_bytes())  # a write in progress: no JSON yet
        (tmp_path / ".late.json.x1y2").write_text("{}")  # another replica's temporary file
        (tmp_path / "broken.json").write_text("{not json")
        with caplog.at_level(logging.ERROR, logger="livespeech.server.voices"):
            for _ in range(3):
                assert [v.voice_id for v in await a.list()] == ["good"]
                assert await code_of(a.get("broken")) == "NOT_FOUND"
        assert sum("broken" in r.getMessage() for r in caplog.records) == 1  # once, not per lookup
        # a repaired file is picked up
        (tmp_path / "broken.json").write_text('{"voice_id": "broken"}')
        (tmp_path / "broken.wav").write_bytes((tmp_path / "good.wav").read_bytes())
        assert (await a.get("broken")).voice_id == "broken"

    asyncio.run(go())
