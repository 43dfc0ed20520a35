"""Whisper BPE built offline, the end-of-stream token, and the speech encoder's fixed
output size for any enrollment length."""
import torch

from livespeech.models.config import TEXT_EOS, WHISPER_VOCAB, ModelConfig
from livespeech.models.speech_encoder import SpeechEncoder
from livespeech.models.tokenizer import get_tokenizer


def test_whisper_vocabulary_and_eos():
    tok = get_tokenizer()
    assert tok._enc.n_vocab == WHISPER_VOCAB == 51_866
    assert tok.eos_id == TEXT_EOS == 51_866 and tok.vocab_size == 51_867
    # Whisper's special tokens keep their ids
    assert tok._enc.encode("<|endoftext|>", allowed_special="all") == [50257]
    assert tok._enc.encode("<|notimestamps|>", allowed_special="all") == [50364]


def test_words_encode_the_same_in_any_chunking():
    tok = get_tokenizer()
    words = "Hello world, this is streaming text.".split()
    whole = tok.encode_words(words, first_in_text=True)
    pieces = tok.encode_words(words[:2], True) + tok.encode_words(words[2:4], False) + tok.encode_words(words[4:], False)
    assert pieces == whole
    assert tok.decode(whole) == "Hello world, this is streaming text."
    assert tok.decode(whole + [tok.eos_id]) == "Hello world, this is streaming text."


def test_speech_encoder_gives_n_vectors_for_any_length():
    cfg = ModelConfig(n_enroll=6, enc_d_model=32, enc_heads=2, enc_layers=1, d_model=64, n_heads=4)
    enc = SpeechEncoder(cfg).eval()
    for t in (1, 37, 400):
        out = enc(torch.randint(0, cfg.codebook_size, (2, cfg.n_acoustic_codebooks, t)))
        assert out.shape == (2, 6, 64)
    # padding frames beyond `lengths` do not change the result
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.n_acoustic_codebooks, 50))
    a = enc(codes[:, :, :30])
    b = enc(codes, lengths=torch.tensor([30]))
    assert torch.allclose(a, b, atol=1e-5)
    # fewer codebooks than the model has are accepted (e.g. a lower-bitrate reference)
    assert enc(codes[:, :4]).shape == (1, 6, 64)
