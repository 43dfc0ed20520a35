"""The letter schedule (models/front_end.py): letters laid on frames as the text arrives,
the runner forcing a session's graphemes and holding codebook 1 to its phone's codes,
and a whole session through the engine spoken on the schedule."""
import dataclasses
import math
import threading
import time

import numpy as np
import pytest
import torch

from livespeech.api.session import Finished, SessionConfig
from livespeech.models import graphemes as G
from livespeech.models.front_end import (WINDOW, FrontEnd, LetterDurationModel, LetterPhoneModel, LetterSchedule,
                                         load_front_end)
from livespeech.models.loading import load_bundle
from livespeech.server.engine import Engine, EngineConfig
from livespeech.server.runner import ModelRunner

N_PHONES = 5


def toy_front_end(frames_per_letter: float = 3.0, duration_scale: float = 1.0) -> FrontEnd:
    """Untrained networks, but every letter lasts `frames_per_letter` x `duration_scale`
    and code c names phone c % 5."""
    torch.manual_seed(0)
    durations = LetterDurationModel(2)
    torch.nn.init.zeros_(durations.mlp[-1].weight)
    torch.nn.init.constant_(durations.mlp[-1].bias, math.log(1 + frames_per_letter))
    names = ("_", "espeak:a", "espeak:b", "flite:a", "flite:b")
    return FrontEnd(LetterPhoneModel(N_PHONES, 2), durations, torch.arange(1024) % N_PHONES, names,
                    ("espeak", "flite"), 0.0, duration_scale)


def words_of(schedule: LetterSchedule, text: str) -> None:
    for w in text.split():
        schedule.add_word(G.word_graphemes(w))


def test_letters_wait_for_their_window_then_lay_one_after_another():
    s = LetterSchedule(toy_front_end(), engine=0)
    words_of(s, "hello there")
    letters = G.text_to_ids("hello there")
    s.lay(0, final=False)
    assert s.laid == len(letters) - WINDOW and s.n_frames == 3 * s.laid
    assert s.graphemes == [g for g in letters[:s.laid] for _ in range(3)]
    assert all(0 <= p < N_PHONES for p in s.phones)
    s.lay(40, final=True)  # the speech stepped past the letters laid: the rest start where it is
    assert s.graphemes[3 * (len(letters) - WINDOW):40] == [-1] * (40 - 3 * (len(letters) - WINDOW))
    assert s.graphemes[40:] == [g for g in letters[-WINDOW:] for _ in range(3)]
    assert s.grapheme(s.n_frames) == -1 and s.phone(-1) == -1


def test_the_first_word_can_be_laid_before_the_letters_after_it_arrive():
    s = LetterSchedule(toy_front_end(), engine=0)
    words_of(s, "hi")
    s.lay(0, final=False)
    assert s.laid == 0
    s.lay_first_word(0)
    assert s.laid == 2 and s.graphemes == [g for g in G.text_to_ids("hi") for _ in range(3)]
    words_of(s, "there you")
    s.lay(s.n_frames, final=False)
    assert s.laid == len(G.text_to_ids("hi there you")) - WINDOW
    laid = s.laid
    s.lay_first_word(s.n_frames)  # the first word is laid: later letters wait for their window
    assert s.laid == laid


def test_letters_laid_in_one_call_are_those_laid_word_by_word():
    """The session lays letters once its speech reaches the last one laid, all the text
    so far in one call: the frames and phones are those laid as each word arrived."""
    fe = toy_front_end()
    torch.manual_seed(1)
    torch.nn.init.normal_(fe.durations.mlp[-1].weight, std=0.3)  # durations that vary by context
    text = "the quick brown fox jumps over the lazy dog and then it runs away again"
    by_word, at_once = LetterSchedule(fe, engine=1), LetterSchedule(fe, engine=1)
    for w in text.split():
        by_word.add_word(G.word_graphemes(w))
        by_word.lay(by_word.n_frames, final=False)
    words_of(at_once, text)
    at_once.lay(0, final=False)
    assert len(set(fe.frames_of(at_once.letters, 0, len(at_once.letters), 1, 0.0)[0])) > 1  # not all alike
    assert (at_once.laid, at_once.graphemes, at_once.phones) == (by_word.laid, by_word.graphemes, by_word.phones)
    by_word.lay(by_word.n_frames, final=True)
    at_once.lay(at_once.n_frames, final=True)
    assert (at_once.graphemes, at_once.phones) == (by_word.graphemes, by_word.phones)


def test_every_letter_gets_a_frame_and_the_rounding_carries():
    s = LetterSchedule(toy_front_end(frames_per_letter=0.2), engine=0)
    words_of(s, "abc de")
    s.lay(0, final=True)
    assert s.graphemes == G.text_to_ids("abc de")  # one frame each, none left out
    s = LetterSchedule(toy_front_end(frames_per_letter=2.5), engine=0)
    words_of(s, "abcd")
    s.lay(0, final=True)
    assert s.n_frames == 10
    s = LetterSchedule(toy_front_end(frames_per_letter=2.5, duration_scale=2.0), engine=0)
    words_of(s, "abcd")
    s.lay(0, final=True)
    assert s.n_frames == 20


def test_a_voice_takes_the_engine_its_codes_name():
    fe = toy_front_end()
    assert fe.voice_engine(torch.tensor([3, 4, 8, 9, 1])) == 1  # flite:a, flite:b x2 ... against espeak:a
    assert fe.voice_engine(torch.tensor([1, 2, 6, 3])) == 0


def soft_table() -> torch.Tensor:
    """log p(phone | code): code c sounds phone c % 5 three times in four and c % 5 + 1 once."""
    p = torch.zeros(N_PHONES, 1024)
    c = torch.arange(1024)
    p[c % N_PHONES, c] = 0.75
    p[(c + 1) % N_PHONES, c] = 0.25
    return p.log()


def test_codebook_1s_bias_is_log_p_phone_given_code_or_a_mask_without_it():
    fe = toy_front_end()
    fe.code_phones[fe.code_phones == 4] = -1  # phone 4: no code names it
    hard = fe.first_code_bias()
    assert hard.shape == (N_PHONES, 1024)
    assert (hard[2, 2::N_PHONES] == 0).all() and (hard[2, 3::N_PHONES] == -1e4).all()
    assert (hard[4] == 0).all()  # no code names it: no bias
    fe.phone_given_code = soft_table()
    soft = fe.first_code_bias()
    assert torch.allclose(soft[2, 2], torch.tensor(0.75).log()) and torch.allclose(soft[3, 2], torch.tensor(0.25).log())
    assert soft[4, 2] == -1e4  # log 0, kept finite


def test_a_front_end_round_trips_through_its_file(tmp_path):
    fe = toy_front_end(duration_scale=1.25)
    fe.phone_given_code = soft_table()
    torch.save(fe.to_dict(), tmp_path / "front_end.pt")
    back = load_front_end(tmp_path)
    assert back.phone_names == fe.phone_names and back.engines == fe.engines
    assert (back.pace, back.duration_scale) == (fe.pace, fe.duration_scale)
    assert torch.equal(back.code_phones, fe.code_phones) and torch.equal(back.phone_given_code, fe.phone_given_code)
    ctx = torch.randint(0, 40, (6, 2 * WINDOW + 1))
    eng = torch.zeros(6, dtype=torch.long)
    assert torch.equal(back.phones(ctx, torch.arange(6), eng), fe.phones(ctx, torch.arange(6), eng))
    assert load_front_end(tmp_path / "none") is None


@pytest.fixture(scope="module")
def bundle():
    torch.set_num_threads(1)
    return dataclasses.replace(load_bundle(random_init=True), front_end=toy_front_end())


def test_the_runner_forces_graphemes_and_holds_codebook_1_to_the_phone(bundle):
    runner = ModelRunner(bundle, capacity=2)
    voice = runner.make_voice("v", np.zeros(24000, np.float32), 24000)
    for slot in (0, 1):
        runner.admit(slot, voice, seed=slot)
        runner.add_chunk(slot, bundle.tokenizer.encode_words(["hello"], first_in_text=True), 0, 0)
    from livespeech.models.guidance import GuidanceState

    held, free = [], []
    for t in range(30):
        steps = runner.step([0, 1], [(0, 0), (0, 0)], [GuidanceState(), GuidanceState()], [False, False],
                            forced_graphemes=[G.SPACE, -1], first_code_rows=[2, -1])
        assert steps[0].grapheme == G.SPACE and not steps[0].failed
        if steps[0].frame is not None:
            held.append(steps[0].frame[0])
            free.append(steps[1].frame[0])
    assert len(held) > 10
    assert all(c % N_PHONES == 2 for c in held)
    assert not all(c % N_PHONES == 2 for c in free)  # the row without a phone samples as before


def test_given_how_often_codes_sound_the_phone_codebook_1_draws_among_them(bundle):
    soft = dataclasses.replace(bundle, front_end=toy_front_end())
    soft.front_end.phone_given_code = soft_table()
    runner = ModelRunner(soft, capacity=1)
    runner.admit(0, runner.make_voice("v", np.zeros(24000, np.float32), 24000), seed=0)
    runner.add_chunk(0, soft.tokenizer.encode_words(["hello"], first_in_text=True), 0, 0)
    from livespeech.models.guidance import GuidanceState

    drawn = []
    for t in range(60):
        step = runner.step([0], [(0, 0)], [GuidanceState()], [False], forced_graphemes=[G.SPACE],
                           first_code_rows=[2])[0]
        assert not step.failed
        if step.frame is not None:
            drawn.append(step.frame[0] % N_PHONES)
    # codes sounding phone 2 three times in four (c % 5 == 2) or once in four (c % 5 == 1)
    assert set(drawn) == {1, 2} and drawn.count(2) > drawn.count(1)


def test_a_decoder_with_a_phone_input_reads_the_schedules_phone_each_step(bundle):
    from livespeech.models.guidance import GuidanceState
    from livespeech.models.livespeech import LiveSpeech2

    model = LiveSpeech2(dataclasses.replace(bundle.model.cfg, n_phones=N_PHONES)).eval()
    model.load_state_dict(bundle.model.state_dict(), strict=False)
    with_phones = dataclasses.replace(bundle, model=model)
    runner = ModelRunner(with_phones, capacity=2)
    assert runner.frozen
    read = []
    step = runner.model_step
    runner.model_step = lambda *a, phones=None, **k: read.append(phones.tolist()) or step(*a, phones=phones, **k)
    voice = runner.make_voice("v", np.zeros(24000, np.float32), 24000)
    for slot in (0, 1):
        runner.admit(slot, voice, seed=slot)
        runner.add_chunk(slot, with_phones.tokenizer.encode_words(["hello"], first_in_text=True), 0, 0)
    runner.step([0, 1], [(0, 0)] * 2, [GuidanceState(), GuidanceState()], [False] * 2,
                forced_graphemes=[G.SPACE] * 2, first_code_rows=[3, -1])
    runner.step([0, 1], [(0, 0)] * 2, [GuidanceState(), GuidanceState()], [False] * 2)
    assert read == [[3, -1], [-1, -1]]  # -1: none (the model's own id for it)
    with pytest.raises(ValueError, match="phone input"):
        ModelRunner(with_phones, capacity=1, text_cfg_scale=1.0)


def test_a_session_speaks_on_its_schedule_and_every_word_is_spoken(bundle):
    eng = Engine(bundle, EngineConfig(max_sessions=2, low_water_steps=0))
    eng.start()
    try:
        events = []
        done = threading.Event()

        def sink(ev):
            events.append(ev)
            if isinstance(ev, Finished):
                done.set()

        voice = eng.make_voice("v", np.zeros(24000, np.float32), 24000)
        h = eng.open_session(SessionConfig(seed=3), voice, sink)
        text = "please call me back"
        for w in text.split():
            h.push_text(w + " ")
        h.end_input()
        assert done.wait(60)
        summary = [e for e in events if isinstance(e, Finished)][0].summary
        # an untrained decoder follows the text only because its letters are forced
        assert summary.all_words_spoken and summary.spoken_text == text
        assert summary.frames == 3 * len(G.text_to_ids(text))  # the schedule's frames, then EOS
    finally:
        eng.stop()


def test_the_first_word_is_spoken_without_waiting_for_the_next_and_later_ones_wait(bundle):
    eng = Engine(bundle, EngineConfig(max_sessions=1, low_water_steps=0))
    eng.start()
    try:
        done = threading.Event()
        voice = eng.make_voice("v", np.zeros(24000, np.float32), 24000)
        events = []

        def sink(ev):
            events.append(ev)
            if isinstance(ev, Finished):
                done.set()

        h = eng.open_session(SessionConfig(seed=3, max_buffer_delay_ms=0), voice, sink)
        h.push_text("hello ")
        deadline = time.monotonic() + 60
        while h.step_count < 13 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        # all its letters laid (their windows read the text's end) and spoken, 3 frames
        # each, up to the first frame of the last, where the text is covered: then a wait
        assert h.letters.laid == 5 and h.step_count == 4 * 3 + 1 and not done.is_set()
        h.push_text("there ")
        deadline = time.monotonic() + 60
        while h.step_count < 7 * 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        # its space and first letter laid (the four after them are there), the rest wait
        assert h.letters.laid == 7 and h.step_count == 7 * 3 and not done.is_set()
        h.end_input()
        assert done.wait(60)
        summary = [e for e in events if isinstance(e, Finished)][0].summary
        assert summary.all_words_spoken and summary.frames == 3 * len(G.text_to_ids("hello there"))
    finally:
        eng.stop()


def test_the_letter_schedule_can_be_turned_off(bundle):
    eng = Engine(bundle, EngineConfig(max_sessions=1, low_water_steps=0, letter_schedule=False))
    eng.start()
    try:
        done = threading.Event()
        voice = eng.make_voice("v", np.zeros(24000, np.float32), 24000)
        h = eng.open_session(SessionConfig(seed=3, guidance_lambda=math.inf),
                             voice, lambda ev: done.set() if isinstance(ev, Finished) else None)
        h.push_text("hi there")
        h.end_input()
        assert done.wait(60)
        assert h.letters is None
    finally:
        eng.stop()


def test_a_frames_phone_context_is_its_half_of_the_run_and_the_phone_on_that_side():
    from livespeech.models.front_end import phone_context

    t = [0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert [phone_context(t, f, True) for f in range(9)] == [
        (0, 0, -1), (0, 1, 1), (1, 0, 0), (1, 0, 0), (1, 1, 2), (1, 1, 2), (2, 0, 1), (2, 0, 1), (2, 1, -1)]
    # laid so far: the last run may go on, so past its first half nothing is known yet
    assert phone_context(t, 7, False) == (2, 0, 1) and phone_context(t, 8, False) is None
    assert phone_context([-1, 3, 3, 3], 1, False) == (3, 0, -1) and phone_context([-1, 3], 0, True) is None


def test_a_context_row_is_its_phones_row_refined_and_the_schedule_finds_it():
    fe = toy_front_end()
    fe.phone_given_code = soft_table()
    keys = torch.tensor([[2, 0, 1], [2, 1, 3]])
    fe = FrontEnd.from_dict({**fe.to_dict(), "contexts": {
        "keys": keys, "pairs": torch.tensor([[0, 7], [1, 12]], dtype=torch.int32), "values": torch.tensor([0.5, 2.0])}})
    bias = fe.first_code_bias()
    assert bias.shape == (N_PHONES + 2, 1024)
    refined = bias[N_PHONES:] - bias[2]
    assert refined[0, 7] == 0.5 and refined[1, 12] == 2.0 and refined.count_nonzero() == 2
    assert fe.bias_phones().tolist() == [0, 1, 2, 3, 4, 2, 2]
    phones = [1, 1, 2, 2, 2, 2, 3, 3]
    # (1, 0, -1), (1, 1, 2): no row of their own; (3, 0, 2) neither; the last frame's half is not known yet
    assert [fe.bias_row(phones, f) for f in range(8)] == [1, 1, 5, 5, 6, 6, 3, 3]
    s = LetterSchedule(fe, engine=0)
    s.phones = phones
    assert [s.bias_row(f) for f in (-1, 3, 8)] == [-1, 5, -1]


def test_a_decoder_with_a_phone_input_reads_the_phone_of_a_context_row(bundle):
    from livespeech.models.guidance import GuidanceState
    from livespeech.models.livespeech import LiveSpeech2

    fe = FrontEnd.from_dict({**toy_front_end().to_dict(), "contexts": {
        "keys": torch.tensor([[3, 0, 1]]), "pairs": torch.tensor([[0, 8]], dtype=torch.int32),
        "values": torch.tensor([1.0])}})
    model = LiveSpeech2(dataclasses.replace(bundle.model.cfg, n_phones=N_PHONES)).eval()
    model.load_state_dict(bundle.model.state_dict(), strict=False)
    runner = ModelRunner(dataclasses.replace(bundle, model=model, front_end=fe), capacity=1)
    read = []
    step = runner.model_step
    runner.model_step = lambda *a, phones=None, **k: read.append(phones.tolist()) or step(*a, phones=phones, **k)
    runner.admit(0, runner.make_voice("v", np.zeros(24000, np.float32), 24000), seed=0)
    runner.add_chunk(0, bundle.tokenizer.encode_words(["hello"], first_in_text=True), 0, 0)
    runner.step([0], [(0, 0)], [GuidanceState()], [False], forced_graphemes=[G.SPACE],
                first_code_rows=[N_PHONES])
    assert read == [[3]]
