"""The load-test tooling (loadtest/): playback accounting, sweep selection, workload,
Prometheus parsing, loopback refusal, and one tiny end-to-end run over real gRPC.

No timing is asserted as a threshold: the machine may be shared.
"""
from __future__ import annotations

import json
import math
import random
import time

import pytest
import torch

from livespeech.loadtest.playback import Packet, concat_timelines, describe, percentile, simulate_playback
from livespeech.loadtest.sweep import compare_modes, level_verdict, select_rated, should_stop
from livespeech.loadtest.workload import BUILTIN_SENTENCES, Pacing, load_sentences, make_turn, schedule, split_pieces


def steady(n: int, dur: float = 0.08, t0: float = 100.0, lead: float = 0.0) -> list[Packet]:
    """n packets of `dur` s, each arriving `lead` s before it plays (first at t0)."""
    return [Packet(t0 + max(0.0, i * dur - lead) if i else t0, i * dur, dur) for i in range(n)]


# ------------------------------------------------------------------ playback


def test_on_time_packets_have_no_underrun():
    pb = simulate_playback(steady(10))
    assert pb.packets == 10 and pb.underruns == 0 and pb.starved_s == 0.0 and pb.late_fixed_clock == 0
    assert pb.audio_s == pytest.approx(0.8)
    # a burst (all at once) is fine too
    burst = [Packet(5.0, i * 0.08, 0.08) for i in range(10)]
    assert simulate_playback(burst).underruns == 0


def test_one_late_packet_is_one_stall_and_the_player_resumes():
    pk = steady(6)
    # packet 3 plays at t0 + 0.24; it arrives 50 ms late, and the ones after it keep the same lateness
    pk = pk[:3] + [Packet(p.arrival_s + 0.05, p.start_s, p.duration_s) for p in pk[3:]]
    pb = simulate_playback(pk)
    assert pb.underruns == 1
    assert pb.starved_s == pytest.approx(0.05)
    assert pb.max_stall_s == pytest.approx(0.05)
    assert pb.stalls[0][0] == pytest.approx(0.24)
    # the server's clock never re-bases: it counts every later packet as late
    assert pb.late_fixed_clock == 3


def test_two_stalls_accumulate():
    pk = [Packet(0.0, 0.0, 0.1), Packet(0.2, 0.1, 0.1), Packet(0.5, 0.2, 0.1), Packet(0.55, 0.3, 0.1)]
    pb = simulate_playback(pk)
    # packet 1 due at 0.1 (arrives 0.2: +0.1); player re-based, packet 2 due 0.3 (arrives 0.5: +0.2);
    # packet 3 due 0.6, arrives 0.55: on time
    assert pb.underruns == 2
    assert pb.starved_s == pytest.approx(0.3)
    assert pb.late_fixed_clock == 3


def test_min_slack_is_the_least_audio_in_hand_as_a_packet_arrived():
    # packets 2 and 3 arrive 30 and 70 ms before they play, packet 1 only 10 ms
    pk = [Packet(0.0, 0.0, 0.1), Packet(0.09, 0.1, 0.1), Packet(0.17, 0.2, 0.1), Packet(0.23, 0.3, 0.1)]
    pb = simulate_playback(pk)
    assert pb.underruns == 0
    assert pb.min_slack_s == pytest.approx(0.01) and pb.min_slack_at_s == pytest.approx(0.1)
    # a stall is a negative slack
    late = simulate_playback(pk[:2] + [Packet(0.25, 0.2, 0.1)])
    assert late.underruns == 1 and late.min_slack_s == pytest.approx(-0.05) and late.min_slack_at_s == pytest.approx(0.2)
    assert simulate_playback(pk[:1]).min_slack_s is None  # nothing arrived after playback began


def test_prebuffer_absorbs_jitter():
    pk = steady(6)
    pk[4] = Packet(pk[4].arrival_s + 0.03, pk[4].start_s, pk[4].duration_s)
    assert simulate_playback(pk).underruns == 1
    assert simulate_playback(pk, prebuffer_s=0.05).underruns == 0


def test_gaps_and_overlaps():
    pb = simulate_playback([Packet(0.0, 0.0, 0.1), Packet(0.0, 0.15, 0.1)])
    assert pb.gaps_s == pytest.approx(0.05) and pb.audio_s == pytest.approx(0.25)
    with pytest.raises(ValueError):
        simulate_playback([Packet(0.0, 0.0, 0.1), Packet(0.0, 0.05, 0.1)])
    assert simulate_playback([]).packets == 0 and simulate_playback([]).first_arrival_s is None


def test_sentence_calls_play_back_to_back():
    a = [Packet(1.0, 0.0, 0.5), Packet(1.1, 0.5, 0.5)]  # 1 s of audio from t=1.0
    b = [Packet(2.3, 0.0, 0.5)]  # next sentence arrives 0.3 s after a finished playing
    tl = concat_timelines([a, b])
    assert [p.start_s for p in tl] == pytest.approx([0.0, 0.5, 1.0])
    pb = simulate_playback(tl)
    assert pb.underruns == 1 and pb.starved_s == pytest.approx(0.3) and pb.audio_s == pytest.approx(1.5)
    assert simulate_playback(concat_timelines([a, [Packet(1.9, 0.0, 0.5)]])).underruns == 0


def test_percentiles():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    d = describe([1.0, None, float("nan"), 3.0])
    assert d["n"] == 2 and d["mean"] == 2.0 and d["max"] == 3.0


# ------------------------------------------------------------------ sweep selection


def client_summary(**kw):
    base = {"completed": 5, "errors": 0, "underruns": 0, "sessions_with_underruns": 0, "starved_s": 0.0,
            "ttfa_user_s": {"p95": 0.3}}
    base.update(kw)
    return base


def test_level_verdict():
    assert level_verdict(client_summary(), 0.5) == (True, [])
    ok, why = level_verdict(client_summary(ttfa_user_s={"p95": 0.6}), 0.5)
    assert not ok and "TTFA p95" in why[0]
    ok, why = level_verdict(client_summary(underruns=3, sessions_with_underruns=1, starved_s=0.2), 0.5)
    assert not ok and "underrun" in why[0]
    ok, why = level_verdict(client_summary(errors=1, error_codes={"RESOURCE_EXHAUSTED": 1}), 0.5)
    assert not ok and "RESOURCE_EXHAUSTED" in why[0]
    assert not level_verdict(client_summary(completed=0, ttfa_user_s={"p95": None}), 0.5)[0]
    # exactly at the bound passes
    assert level_verdict(client_summary(ttfa_user_s={"p95": 0.5}), 0.5)[0]


def test_select_rated():
    lv = lambda n, ok: {"n": n, "passed": ok}  # noqa: E731
    r = select_rated([lv(8, True), lv(1, True), lv(4, True), lv(16, False), lv(2, True)])
    assert r["rated_n"] == 8 and r["largest_passing_n"] == 8 and r["first_failing_n"] == 16 and r["monotone"]
    assert r["tested_n"] == [1, 2, 4, 8, 16]
    # a pass above a failure is reported but not trusted
    r = select_rated([lv(1, True), lv(2, True), lv(4, False), lv(8, True)])
    assert r["rated_n"] == 2 and r["largest_passing_n"] == 8 and not r["monotone"]
    r = select_rated([lv(1, False), lv(2, True)])
    assert r["rated_n"] is None and r["first_failing_n"] == 1
    r = select_rated([lv(1, True), lv(2, True)])
    assert r["rated_n"] == 2 and r["first_failing_n"] is None and r["monotone"]
    assert select_rated([])["rated_n"] is None


def test_should_stop_and_compare():
    lvs = [{"n": 1, "passed": True}, {"n": 2, "passed": False}]
    assert should_stop(lvs, 1) and not should_stop(lvs, 2) and not should_stop(lvs, 0)
    c = compare_modes({"ttfa_user_s": {"p50": 0.2, "p95": 0.4}, "underruns": 0, "starved_s": 0.0},
                      {"ttfa_user_s": {"p50": 0.6, "p95": 1.0}, "underruns": 4, "starved_s": 1.5})
    assert c["ttfa_p50_ratio"] == pytest.approx(3.0) and c["ttfa_p95_ratio"] == pytest.approx(2.5)
    assert c["underruns_sentence"] == 4 and c["underruns_ratio"] is None  # no ratio against zero


# ------------------------------------------------------------------ workload


def test_pieces_rebuild_the_text():
    text = "Hello world, this is   an extraordinarily long sentence."
    pieces = split_pieces(text, 4)
    assert "".join(pieces) == text
    assert pieces[:4] == ["Hell", "o", " worl", "d,"]
    assert all(len(p.strip()) <= 4 for p in pieces)


@pytest.mark.parametrize("mode", ["llm", "paced"])
def test_schedule(mode):
    sentences = BUILTIN_SENTENCES[:3]
    pacing = Pacing(mode=mode, llm_rate=40, words_per_s=2.5, jitter=0.3)
    pieces = schedule(sentences, pacing, random.Random(1))
    assert pieces[0].t_s == 0.0
    assert all(b.t_s > a.t_s for a, b in zip(pieces, pieces[1:]))
    assert "".join(p.text for p in pieces) == " ".join(sentences)
    assert [p.sentence for p in pieces] == sorted(p.sentence for p in pieces)
    n = len(pieces)
    rate = 40 if mode == "llm" else 2.5
    assert pieces[-1].t_s == pytest.approx((n - 1) / rate, rel=0.3)


def test_turns_are_seeded_and_pauses_add_time():
    p = Pacing()
    a, b = make_turn(BUILTIN_SENTENCES, 2, p, seed=7), make_turn(BUILTIN_SENTENCES, 2, p, seed=7)
    assert a == b and len(a.sentences) == 2
    done = a.sentence_complete_s()
    assert done[0] < done[1] == a.pieces[-1].t_s
    slow = make_turn(BUILTIN_SENTENCES, 2, Pacing(pause_prob=1.0, pause_ms=100), seed=7)
    assert slow.pieces[-1].t_s > a.pieces[-1].t_s + 0.1 * (len(a.pieces) - 2)
    with pytest.raises(ValueError):
        Pacing(mode="fast").validate()


def _level_with_turns_of(turn_s: float, n: int, duration_s: float, max_sessions: int, monkeypatch) -> list[dict]:
    """`run_level` with every turn taking `turn_s` (no server): its records."""
    import asyncio

    from livespeech.loadtest import driver

    async def turn(client, t, cfg, rec, prebuffer_s):
        rec.t_start = time.monotonic()
        await asyncio.sleep(turn_s)
        rec.completed = True
        rec.t_end = time.monotonic()

    monkeypatch.setattr(driver, "run_streaming_turn", turn)
    spec = driver.LevelSpec(n=n, mode=driver.STREAMING, duration_s=duration_s, max_sessions=max_sessions,
                            corpus=BUILTIN_SENTENCES, sentences_per_turn=1, pacing=Pacing(), config={},
                            baseline_config={}, ramp_s=0.0)
    return asyncio.run(driver.run_level(None, spec))["records"]


def test_a_level_keeps_all_its_sessions_to_its_end_by_default_and_a_runaway_stops(monkeypatch):
    from livespeech.loadtest.run import build_parser, turn_cap

    n, duration = 256, 2.0
    cap = turn_cap(build_parser().parse_args(["--spawn"]).max_sessions, n, duration)
    # turns of 0.5 s: every worker starts turns until the window closes, four each (the
    # fixed cap of 500 turns stopped all 256 workers before their third)
    records = _level_with_turns_of(0.5, n, duration, cap, monkeypatch)
    last = {}
    for r in records:
        last[r["worker"]] = max(last.get(r["worker"], 0), r["turn"])
    assert len(last) == n and min(last.values()) >= 2 and len(records) < cap
    # a cap of two turns a worker stops the level at it (a window of four turns' time, so
    # that a loaded machine starting a second turn late cannot end it first)
    assert len(_level_with_turns_of(0.5, n, duration, 2 * n, monkeypatch)) == 2 * n
    # turns that end at once (a server failing every call) stop at the cap
    runaway = turn_cap(0, 4, duration)
    assert len(_level_with_turns_of(0.0, 4, duration, runaway, monkeypatch)) == runaway
    assert turn_cap(7, n, duration) == 7


def test_text_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("One two. Three four!\n\nFive six?\n")
    assert load_sentences(str(f)) == ("One two.", "Three four!", "Five six?")
    assert load_sentences(None) == BUILTIN_SENTENCES


# ------------------------------------------------------------------ Prometheus


def test_prometheus_delta_and_quantile():
    from livespeech.loadtest import prom
    from livespeech.server.metrics import Metrics

    m = Metrics()
    m.step_seconds.observe(0.004)
    before = prom.parse(m.render().decode())
    for v in (0.004, 0.004, 0.012, 0.025):
        m.step_seconds.observe(v)
    for b in (2, 2, 4, 4):
        m.batch_size.observe(b)
    m.underruns_total.inc(3)
    m.audio_seconds_total.inc(2.0)
    after = prom.parse(m.render().decode())
    d = prom.delta(before, after)
    h = d.histograms["livespeech_step_seconds"]
    assert h.count == 4 and h.sum == pytest.approx(0.045)
    assert 0.003 <= h.quantile(0.5) <= 0.005
    assert 0.02 <= h.quantile(0.95) <= 0.03
    s = prom.engine_summary(d, wall_s=1.0)
    assert s["underruns_total"] == 3 and s["batch_size"]["mean"] == 3.0
    assert s["engine_busy_fraction"] == pytest.approx(0.045)
    assert s["machine_rtf"] == pytest.approx(0.045 / 2.0)
    assert prom.hist_quantile(0.5, []) is None
    assert prom.hist_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None


# ------------------------------------------------------------------ loopback only


@pytest.mark.parametrize("target", ["10.0.0.1:50051", "8.8.8.8:443", "example.com:50051", "0.0.0.0:50051"])
def test_refuses_non_loopback(target, capsys):
    from livespeech.loadtest.run import main

    assert main(["--target", target, "--duration", "1"]) == 2
    assert "loopback" in capsys.readouterr().err


def test_loopback_hosts():
    from livespeech.loadtest.server_proc import check_loopback, is_loopback_host

    assert check_loopback("127.0.0.1:1") == ("127.0.0.1", 1)
    assert check_loopback("[::1]:50051") == ("::1", 50051)
    assert is_loopback_host("127.3.2.1") and is_loopback_host("localhost")
    with pytest.raises(ValueError):
        check_loopback("127.0.0.1")


# ------------------------------------------------------------------ report


def test_report_renders_a_synthetic_result(tmp_path):
    from livespeech.loadtest.report import make_plots, render_markdown

    rec = {"ttfa_user_s": 0.3, "lookahead_wait_s": 0.1, "compute_fpl_s": 0.2}
    client = {"sessions": 2, "completed": 2, "errors": 0, "underruns": 0, "sessions_with_underruns": 0,
              "starved_s": 0.0, "ttfa_user_s": {"p50": 0.3, "p95": 0.3}, "lookahead_wait_s": {"p50": 0.1},
              "compute_fpl_s": {"p50": 0.2, "p95": 0.2}}
    server = {"step_seconds": {"mean": 0.01, "p95": 0.02}, "batch_size": {"mean": 1.5},
              "codec_decode_seconds": {"mean": 0.005}, "engine_busy_fraction": 0.3, "machine_rtf": 0.2,
              "rtf_per_session": {"mean": 0.3}}
    levels = [{"n": n, "mode": m, "records": [rec, rec], "client": client, "server": server, "passed": True,
               "fail_reasons": [], "loadavg": {"start": [0.1, 0.1, 0.1]}, "wall_s": 3.0}
              for n in (1, 2) for m in ("streaming", "sentence")]
    result = {"levels": levels, "criteria": {"ttfa_bound_s": 1.0}, "host": {"loadavg_start": [0.1] * 3},
              "sweep": {"rated_n": 2, "comparison": [{"n": 1, "ttfa_p50_ratio": 2.0}]}}
    md = render_markdown(result, [])
    assert "Rated N = 2" in md and "| 2 | yes |" in md and "Sentence-level baseline" in md
    pytest.importorskip("matplotlib")
    files = make_plots(result, tmp_path)
    assert files and all((tmp_path / f).stat().st_size > 0 for f in files)


def _sweep_result(rated, starved_by_n, steal_s=0.5, commit="abc1234", dirty=False):
    """A result.json as loadtest.run writes it, reduced to what the paired compare reads."""
    levels = [{"n": n, "mode": "streaming", "client": {"starved_s": starved}, "host_steal": {"steal_s": steal_s}}
              for n, starved in starved_by_n.items()]
    return {"git": {"commit": commit, "dirty": dirty}, "sweep": {"rated_n": rated}, "levels": levels}


def test_paired_compare_lists_each_pairs_rated_n_and_starved_audio_with_the_hosts_steal():
    from livespeech.loadtest.compare import render_pairs

    a = [_sweep_result(4, {4: 0.0, 6: 0.2, 8: 1.5}), _sweep_result(6, {4: 0.0, 6: 0.0, 8: 0.3})]
    b = [_sweep_result(6, {4: 0.0, 6: 0.0, 8: 0.05}, steal_s=2.0),
         _sweep_result(6, {4: 0.0, 6: 0.01, 8: 0.4}, dirty=True)]
    md = render_pairs(a, b, "bf16 / int8")
    assert "| 1 | abc1234, 4 | abc1234, 6 | 1.50 |" in md and "| 2 | abc1234, 6 | abc1234 (dirty), 6 | 1.00 |" in md
    assert "A 10, B 12 (1.20x)" in md
    # N=8: B starved less in pair 1 (1,500 -> 50 ms), more in pair 2 (300 -> 400 ms)
    assert "| 8 | 1,500 / 50; 300 / 400 | 0.5 / 2.0; 0.5 / 0.5 | 1 / 1 / 0 |" in md
    assert "| 4 | 0 / 0; 0 / 0 | 0.5 / 2.0; 0.5 / 0.5 | 0 / 0 / 2 |" in md and "| 6 | 200 / 0; 0 / 10 |" in md
    # a run that rated none of its levels leaves the sum undefined rather than wrong
    assert "not defined" in render_pairs([_sweep_result(None, {4: 0.1})], [_sweep_result(4, {4: 0.0})])


def test_compare_takes_as_many_runs_on_each_side(tmp_path, capsys):
    from livespeech.loadtest.compare import main

    paths = []
    for i, rated in enumerate((4, 6, 4)):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(_sweep_result(rated, {4: 0.0, 6: 0.1 * i})))
        paths.append(str(p))
    assert main([f"{paths[0]},{paths[2]}", f"{paths[1]},{paths[1]}"]) == 0
    assert "A 8, B 12 (1.50x)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([f"{paths[0]},{paths[1]}", paths[2]])
    assert exc.value.code == 2 and "pairs need as many on each side" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.json"), paths[0]])


def test_host_steal_is_summed_with_its_worst_second_and_the_intervals_that_had_any():
    from livespeech.loadtest.run import StealSampler, steal_summary

    # cumulative steal readings every 0.25 s: 0.1 s stolen in each of three intervals
    # ending at 1.0-1.5 s, and 0.05 s at 3.0 s
    readings = [(0.25 * i, 0.0) for i in range(4)] + [(1.0, 0.1), (1.25, 0.2), (1.5, 0.3)]
    readings += [(0.25 * i, 0.3) for i in range(7, 12)] + [(3.0, 0.35)]
    r = steal_summary(readings)
    assert math.isclose(r["steal_s"], 0.35) and math.isclose(r["worst_second_s"], 0.3)
    assert [t for t, _ in r["intervals"]] == [1.0, 1.25, 1.5, 3.0]
    assert steal_summary([(0.0, 1.0)]) is None
    # the sampler reads at its start, on its thread, and at its stop; no reading: None
    counter = iter(range(1000))
    sampler = StealSampler(period_s=0.01, read=lambda: float(next(counter))).start()
    time.sleep(0.05)
    r = sampler.stop()
    assert r["steal_s"] >= 2 and r["worst_second_s"] == r["steal_s"]
    assert StealSampler(read=lambda: None).start().stop() is None


def test_the_engines_steps_where_stalls_began_against_the_levels():
    from livespeech.loadtest.report import _stall_steps_text
    from livespeech.loadtest.sweep import steps_where_stalls_began

    # half-second intervals ending at 10.5 .. 12.0: 60 steps at batch 4, one thin one
    timeline = [[10.5, 60, 0.4, 4.0, 0.1], [11.0, 60, 0.4, 4.0, 0.1], [11.5, 40, 0.45, 8.0, 0.1],
                [12.0, 60, 0.4, 4.0, 0.1]]
    # first packet at 10.1 s; a stall at audio 0.9 s after a 0.3 s one at 0.2 s: it
    # begins at 10.1 + 0.9 + 0.3 = 11.3 s (the third interval), the first at 10.3 s
    records = [{"t_start": 10.0, "ttfa_user_s": 0.1, "stalls": [[0.2, 0.3], [0.9, 0.05]]},
               {"t_start": 10.0, "ttfa_user_s": 0.1, "stalls": []}]
    r = steps_where_stalls_began(records, timeline)
    assert r["intervals"] == 4 and r["with_stalls"] == 2
    assert math.isclose(r["level"]["steps_per_s"], 220 / 2.0)
    assert math.isclose(r["where_stalls_began"]["steps_per_s"], 100 / 1.0)
    assert math.isclose(r["where_stalls_began"]["batch"], (60 * 4 + 40 * 8) / 100)
    assert "stalls began in 2 of 4 intervals" in _stall_steps_text(r) and "at 100 steps/s, batch 5.6" in _stall_steps_text(r)
    assert steps_where_stalls_began(records, None) is None
    assert steps_where_stalls_began([], timeline)["where_stalls_began"] is None and _stall_steps_text(None) == ""


def test_stalls_are_counted_by_their_position_in_a_sessions_audio():
    from livespeech.loadtest.report import _stall_positions_text
    from livespeech.loadtest.sweep import stall_positions

    records = [{"stalls": [[0.027, 0.002], [0.36, 0.03], [1.4, 0.02]]}, {"stalls": [[0.32, 0.01], [7.0, 0.1]]},
               {"stalls": []}, {}]
    bins = stall_positions(records)
    assert [(round(lo, 1), round(hi, 1), n) for lo, hi, n in bins] == [(0.0, 0.1, 1), (0.3, 0.4, 2), (1.0, math.inf, 2)]
    assert (_stall_positions_text(bins)
            == "; stalls by position in a session's audio: 0.0-0.1 s 1, 0.3-0.4 s 2, from 1.0 s 2")
    assert stall_positions([{"stalls": []}]) == [] and _stall_positions_text([]) == ""


# ------------------------------------------------------------------ end to end


def test_tiny_end_to_end_run(tmp_path):
    """N=2 over real gRPC against a server the tool spawns on 127.0.0.1 (random:tiny)."""
    pytest.importorskip("torch")
    from livespeech.loadtest.run import main

    text = tmp_path / "short.txt"
    text.write_text("Hello there. Good morning.\n")
    out = tmp_path / "out"
    rc = main(["--spawn", "--model-path", "random:tiny", "--server-threads", "1", "--sessions", "2",
               "--duration", "1", "--max-sessions", "2", "--sentences-per-turn", "2", "--text-file", str(text),
               "--session-timeout", "60", "--ramp", "0.2", "--no-plots", "--quiet", "--out", str(out)])
    assert rc == 0, (out / "server.log").read_text() if (out / "server.log").exists() else ""
    result = json.loads((out / "result.json").read_text())
    assert result["schema"] == "livespeech-loadtest/1"
    assert len(result["host"]["loadavg_start"]) == 3 and len(result["host"]["loadavg_end"]) == 3
    assert result["workload"]["guidance_lambda"] == "inf"  # untrained model: hard guidance
    assert result["server"]["mode"] == "spawn" and result["server"]["target"].startswith("127.0.0.1:")
    modes = {(lv["mode"], lv["n"]) for lv in result["levels"]}
    assert modes == {("streaming", 2), ("sentence", 2)}
    for lv in result["levels"]:
        c = lv["client"]
        assert c["sessions"] == 2 and c["errors"] == 0, c["error_codes"]
        for key in ("ttfa_user_s", "ttfa_server_s", "lookahead_wait_s", "compute_fpl_s", "starved_s_per_session",
                    "spoken_fraction"):
            assert key in c
        assert c["ttfa_user_s"]["n"] == 2
        assert len(lv["loadavg"]["start"]) == 3
        steal = lv["host_steal"]  # Linux counts it: where /proc/stat is, it is read
        assert steal is None or steal["steal_s"] >= 0 <= steal["worst_second_s"] <= steal["steal_s"]
        # the engine's steps through the level, from its metrics every 0.5 s
        rows = lv["engine_timeline"]
        assert rows and all(len(r) == 5 for r in rows)
        assert 0 < sum(r[1] for r in rows) <= lv["server"]["step_seconds"]["count"]
        assert lv["server"]["step_seconds"]["count"] > 0 and lv["server"]["batch_size"]["count"] > 0
        for r in lv["records"]:
            assert r["completed"] and r["packets"] > 0 and r["audio_s"] > 0
            assert r["calls"] == (1 if lv["mode"] == "streaming" else 2)
            for key in ("ttfa_user_s", "ttfa_server_s", "compute_fpl_s", "underruns", "starved_s", "late_fixed_clock"):
                assert key in r
        if lv["mode"] == "streaming":
            assert isinstance(lv["passed"], bool)
            stepped = sum(r[1] > 0 for r in rows)  # two intervals with steps at least, or None
            assert (lv["stall_steps"] or {}).get("intervals") == (stepped if stepped >= 2 else None)
    sw = result["sweep"]
    assert sw["tested_n"] == [2] and "rated_n" in sw
    assert sw["comparison"][0]["n"] == 2 and "ttfa_p95_ratio" in sw["comparison"][0]
    assert (out / "report.md").exists()


def test_step_profile_runs_and_attributes_the_step(tmp_path):
    """The step profiler (livespeech.loadtest.profile_step) on a tiny random model: every scope it
    reports lies inside the engine step, and the model and sampling scopes are there; the
    eager step's layers are scopes of their own, the frozen graph (the default) is one; it
    runs the server's torch threads unless told otherwise; with --device-guidance the
    guidance runs as the batch's tensors, not as each session's Python; its uninstrumented
    run gives the engine's own work, the step less the runner's step and the codec's calls."""
    from livespeech.loadtest import profile_step
    from livespeech.server.app import available_cpus, torch_threads
    from livespeech.server.config import ServerConfig

    threads = torch_threads(ServerConfig(), available_cpus())
    for eager, weights, on_device in ((False, "bfloat16", False), (False, "int8", True), (True, "float32", False)):
        out = tmp_path / f"p{eager}{weights}.json"
        plain = weights == "int8"  # one uninstrumented run is enough
        assert profile_step.main(["--batch", "2", "--steps", "3", "--warmup", "2", "--matmul-weights", weights,
                                  "--json", str(out)] + ["--no-plain"] * (not plain) + ["--eager-step"] * eager
                                 + ["--device-guidance"] * on_device) == 0
        res = json.loads(out.read_text())
        row = res["batches"][0]
        if plain:
            assert 0 < row["engine_own_ms_plain"] < row["step_ms_plain"]
            assert 0 < row["engine_own_ms_median"] < row["step_ms_plain"]
        else:
            assert row["engine_own_ms_plain"] is row["engine_own_ms_median"] is None
        scopes = {r["name"]: r for r in row["scopes"]}
        assert {"engine.step", "runner.step", "model.step", "sampling"} <= set(scopes)
        assert 0 < scopes["model.step"]["incl_ms_per_step"] <= scopes["runner.step"]["incl_ms_per_step"]
        assert scopes["runner.step"]["incl_ms_per_step"] <= scopes["engine.step"]["incl_ms_per_step"]
        assert ("mamba" in scopes) is eager and res["frozen_step"] is not eager
        assert res["matmul_weights"] == weights
        assert res["cuda_graphs"] is False
        assert res["device_guidance"] is on_device and ("guidance.observe" in scopes) is not on_device
        assert res["threads"] == threads  # the server's choice on this machine
        # the roofline: a bf16 (int8) step's heads and Mamba projections at the bf16 gemm's
        # (the int8 linear's) rate and 2 (1) bytes a weight; everything at sgemm's rate and
        # 4 bytes in float32
        c, a, m = row["cost"], res["analytic"], res["machine"]
        fp32_mb = (a["weight_bytes"] + res["codec"]["weight_bytes"] / res["packet_frames"]) / 1e6
        rate = {"float32": None, "bfloat16": m["bf16_gemm_gflops"], "int8": m["int8_gemm_gops"]}[weights]
        assert (m["bf16_gemm_gflops"] is None) is (weights != "bfloat16")
        assert (m["int8_gemm_gops"] is None) is (weights != "int8")
        if weights == "float32":
            assert c["low_gflop"] == 0 and c["weight_mbytes"] == pytest.approx(fp32_mb)
        else:
            assert 0 < c["low_gflop"] < c["gflop"] and rate > 0
            saved = a["low_precision_weight_bytes_fp32"] * (1 - profile_step.WEIGHT_BYTES[weights] / 4)
            assert c["weight_mbytes"] == pytest.approx(fp32_mb - saved / 1e6)
            t_f = (c["gflop"] - c["low_gflop"]) / m["sgemm_gflops"] + c["low_gflop"] / rate
            assert c["t_flops_ms"] == pytest.approx(1e3 * t_f)
    with pytest.raises(SystemExit):
        profile_step.main(["--cuda-graphs", "--device", "cpu"])


def test_the_codec_lstms_flops_are_counted_as_its_written_out_loop_counts_them():
    """FlopCounterMode counts `aten.lstm` (the torch codec's LSTM for packets of over four
    frames) as nothing; `profile_step.lstm_flops` counts it as the same recurrence written
    out as matmuls (`SLSTM._cell_loop`, what short packets and the native codec run)."""
    from torch.utils.flop_counter import FlopCounterMode

    from livespeech.loadtest.profile_step import LSTM_FLOPS
    from livespeech.models.codec.modules import SLSTM

    lstm = SLSTM(24, 2)
    seq = torch.randn(5, 3, 24)
    state = torch.zeros(3, 2, 24)
    counted = {}
    for name, mapping, run in (("op", {}, lambda: lstm.lstm(seq)),
                               ("op+formula", LSTM_FLOPS, lambda: lstm.lstm(seq)),
                               ("loop", {}, lambda: lstm._cell_loop(seq, state, state))):
        fc = FlopCounterMode(display=False, custom_mapping=mapping)
        with torch.inference_mode(), fc:  # as profile_step counts
            run()
        counted[name] = fc.get_total_flops()
    assert counted["op"] == 0
    assert counted["op+formula"] == counted["loop"] == 2 * 5 * 3 * 2 * (24 * 96 + 24 * 96)


def test_codec_bench_times_torchs_step_and_the_native_one(capsys):
    """`bench_codec` prints one line a case, for torch's decode step and, with --native,
    the server's native codec step."""
    from livespeech.loadtest import bench_codec
    from livespeech.models.native_step import native_module

    for native in ([], ["--native"]) if native_module() is not None else ([],):
        bench_codec.main(["--presets", "small", "--repeats", "1", *native])
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == len(bench_codec.CASES) and all("real time per core" in line for line in lines)


def test_step_profile_traces_the_ops_by_input_shape(tmp_path):
    """`--trace-shapes` adds the trace's op table grouped by input shapes (the batch of two
    in its rows); it needs `--trace`."""
    from livespeech.loadtest import profile_step

    trace = tmp_path / "trace"
    assert profile_step.main(["--batch", "2", "--steps", "2", "--warmup", "2", "--no-plain", "--trace", str(trace),
                              "--trace-shapes"]) == 0
    table = (trace / "ops_b2_shapes.txt").read_text()
    assert "Input Shapes" in table and "[2, " in table
    assert (trace / "ops_b2.txt").exists() and (trace / "trace_b2.json").exists()
    with pytest.raises(SystemExit):
        profile_step.main(["--trace-shapes"])


@pytest.mark.parametrize("arm", ["bfloat16", "int8", "gpu", "decoder"])
def test_precision_compares_the_lower_precision_step_with_float32_along_a_decode(arm):
    """livespeech.loadtest.precision on a tiny random model: every session finishes, every step
    the arm runs in a lower precision is compared (the CPU's bf16 matmul weights from two
    sessions, its int8 ones, a GPU's bf16 path and the bf16 decoder at every step), and the
    comparison sees the small but real difference (total variation above 0, most argmaxes
    the same); the temperature references grow with the temperature."""
    from livespeech.loadtest.precision import measure
    from livespeech.models.loading import load_bundle

    torch.set_num_threads(1)
    res = measure(load_bundle("random:tiny"), sessions=2, turns=1, draws=4, arm=arm)
    assert res["outcomes"] == {"Finished": 2} and res["steps_compared"] > 0 and res["arm"] == arm
    assert res["mean_batch"] == 2 if arm == "bfloat16" else 1 <= res["mean_batch"] <= 2
    for kind in ("graphemes", "acoustic"):
        stats = res[kind]
        assert stats["rows"] > 0
        assert 0 < stats["tv"]["mean"] < 0.5 and 0.5 < stats["agree"]["mean"] <= 1
        temps = [stats[f"tv_temperature_{t}"]["mean"] for t in (1.01, 1.02, 1.05)]
        assert 0 < temps[0] < temps[1] < temps[2]


def test_replay_plays_each_turn_and_restores_the_engine(tmp_path):
    """livespeech.loadtest.replay on a tiny random model: every turn finishes, its stalls are the
    simulated listener's underruns, packets are reported, and the text-wait probe it
    installs on the engine is removed afterwards."""
    from livespeech.loadtest import replay
    from livespeech.server.engine import Engine

    text = tmp_path / "t.txt"
    text.write_text("Hello there.\n")
    before = Engine._wait_for_text
    out = tmp_path / "r.json"
    assert replay.main(["--model-path", "random:tiny", "--sessions", "2", "--turns", "1", "--stagger-s", "0.1",
                        "--llm-rate", "200", "--sentences-per-turn", "1", "--text-file", str(text),
                        "--json", str(out)]) == 0
    assert Engine._wait_for_text is before
    res = json.loads(out.read_text())
    assert [(r["worker"], r["turn"]) for r in res["turn_results"]] == [(0, 0), (1, 0)]
    for r in res["turn_results"]:
        assert r["finished"] and r["first_packets"] and r["underruns"] == len(r["stalls"])
        assert r["ttfa_ms"] >= r["compute_fpl_ms"] > 0 and r["lookahead_wait_ms"] >= 0
    assert res["underruns"] == sum(r["underruns"] for r in res["turn_results"])
    # the slowest engine steps (ms, batch, 0, s) and codec calls (ms, batch, frames, s), slowest first
    for kind in ("slowest_steps", "slowest_codec_calls"):
        assert 0 < len(res[kind]) <= 5 and [c[0] for c in res[kind]] == sorted((c[0] for c in res[kind]), reverse=True)
        assert all(ms > 0 and 1 <= batch <= 2 for ms, batch, _, _ in res[kind])
    assert all(frames >= 1 for _, _, frames, _ in res["slowest_codec_calls"])


def test_replay_max_delay_caps_the_decoders_codebook_delays(tmp_path):
    """The latency what-if: the tiny model's delays 0..8 capped at 2, and a turn still
    runs to its end under them."""
    from livespeech.loadtest import replay

    text = tmp_path / "t.txt"
    text.write_text("Hello there.\n")
    out = tmp_path / "r.json"
    assert replay.main(["--model-path", "random:tiny", "--sessions", "1", "--turns", "1", "--llm-rate", "200",
                        "--sentences-per-turn", "1", "--text-file", str(text), "--max-delay", "2",
                        "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["delays"] == [0, 1, 2, 2, 2, 2, 2, 2, 2]
    assert [r["finished"] for r in res["turn_results"]] == [True] and res["turn_results"][0]["first_packets"]
    with pytest.raises(SystemExit):
        replay.main(["--model-path", "random:tiny", "--max-delay", "-1"])


def test_replay_chunking_options_reach_the_sessions(tmp_path, monkeypatch):
    from livespeech.loadtest import replay
    from livespeech.server.engine import Engine

    opened = []
    real_open = Engine.open_session

    def recording_open(self, cfg, *a, **kw):
        opened.append(cfg.chunking)
        return real_open(self, cfg, *a, **kw)

    monkeypatch.setattr(Engine, "open_session", recording_open)
    text = tmp_path / "t.txt"
    text.write_text("Hello there, this is a test.\n")
    assert replay.main(["--model-path", "random:tiny", "--sessions", "1", "--turns", "1", "--llm-rate", "200",
                        "--sentences-per-turn", "1", "--text-file", str(text), "--chunk-words", "2,4",
                        "--first-chunk-words", "1", "--release-when-waiting", "off"]) == 0
    assert [(c.min_words, c.max_words, c.first_max_words, c.release_when_waiting) for c in opened] == [
        (2, 4, 1, False)]


def test_bench_step_times_each_batch_sizes_first_step(tmp_path):
    from livespeech.loadtest import bench_step

    out = tmp_path / "first.json"
    assert bench_step.main(["--first-calls", "--batch", "1", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["first_step_ms"] > 0 and r["next_steps_ms"] > 0 for r in rows)


def test_bench_step_times_batches_with_gaps_stepped_as_a_run_and_gathered(tmp_path):
    from livespeech.loadtest import bench_step
    from livespeech.server import runner as runner_module

    out = tmp_path / "gaps.json"
    assert bench_step.main(["--gaps", "3/4", "2/4", "--steps", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["slots"], r["runner_chooses"]) for r in rows] == [([0, 2, 3], "run"), ([0, 3], "gathered")]
    assert all(r["run_ms"] > 0 and r["gathered_ms"] > 0 for r in rows)
    assert runner_module.SPAN_MAX_ROWS_PER_SESSION == 1.5  # the runners' default, which "runner_chooses" reads


def test_bench_step_gives_each_batch_the_model_steps_bound_from_rates_measured_in_the_same_run(tmp_path):
    from livespeech.loadtest import bench_step, profile_step

    out = tmp_path / "bound.json"
    assert bench_step.main(["--roofline", "--batch", "1", "4", "--steps", "3", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["machine"]["memcpy_gbs"] > 0 and res["machine"]["sgemm_gflops"] > 0
    for row in res["rows"]:
        # the bound is the cost model's: max(FLOPs / gemm rate, bytes / memcpy rate)
        low = row["batch"] >= 2 or res["matmul_weights"] == "int8"  # bfloat16 from two sessions, int8 from one
        m = profile_step.model_step_cost(res["analytic"], row["batch"], res["matmul_weights"] if low else "float32")
        bytes_ms = 1e3 * m["bytes"] / (res["machine"]["memcpy_gbs"] * 1e9)
        assert row["step_bound_ms"] >= bytes_ms * (1 - 1e-9) and row["step_bytes_mb"] == pytest.approx(m["bytes"] / 1e6)
        assert row["model_step_over_bound"] == pytest.approx(row["model_step_ms"] / row["step_bound_ms"])


def test_the_profile_after_a_sweep_steps_as_the_spawned_server_did(tmp_path, monkeypatch):
    """`--server-cuda-graphs`, `--server-eager-step`, `--server-frozen-step` and
    `--server-device-guidance` reach the spawned server as flags its configuration reads,
    and the step profile after the sweep as profile_step's."""
    import subprocess

    from livespeech.loadtest import run
    from livespeech.server.config import ServerConfig

    args = run.build_parser().parse_args(["--spawn", "--server-eager-step", "--server-device-guidance",
                                          "--server-cuda-graphs", "--device", "cuda"])
    server, profile = run.step_paths(args)
    config = ServerConfig.from_args(server + ["--device", "cuda"])
    assert config.cuda_graphs and not config.frozen_step and config.device_guidance
    seen = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: seen.append(cmd) or subprocess.CompletedProcess(cmd, 1))
    assert run.run_profile(args, tmp_path, [1, 16]) is None  # the stub wrote no profile
    assert profile == ["--cuda-graphs", "--eager-step", "--device-guidance"] and set(profile) <= set(seen[0])
    assert run.step_paths(run.build_parser().parse_args(["--spawn"])) == ([], [])
    server, profile = run.step_paths(run.build_parser().parse_args(["--spawn", "--server-frozen-step"]))
    assert not ServerConfig.from_args(server).native_step and ServerConfig().native_step
    assert profile == ["--no-native-step"]


def test_replay_keeps_the_guidance_on_the_device_when_asked(tmp_path, monkeypatch):
    """`--device-guidance` (what a GPU's 256 sessions run) reaches the engine, whose runner
    then keeps every session's guidance as tensors, and its turns still finish."""
    from livespeech.loadtest import replay
    from livespeech.server.engine import Engine

    runners = []
    real_init = Engine.__init__

    def recording_init(self, *a, **kw):
        real_init(self, *a, **kw)
        runners.append(self.runner)

    monkeypatch.setattr(Engine, "__init__", recording_init)
    text = tmp_path / "t.txt"
    text.write_text("Hello there.\n")
    out = tmp_path / "r.json"
    assert replay.main(["--model-path", "random:tiny", "--sessions", "2", "--turns", "1", "--llm-rate", "200",
                        "--sentences-per-turn", "1", "--text-file", str(text), "--device-guidance",
                        "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device_guidance"] and [r["finished"] for r in res["turn_results"]] == [True, True]
    assert len(runners) == 1 and runners[0].guidance is not None
