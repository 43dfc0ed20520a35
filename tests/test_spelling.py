"""Text-token embeddings computed from spellings (models/spelling.py)."""
import torch

from livespeech.models.config import TEXT_EOS, preset
from livespeech.models.livespeech import LiveSpeech2
from livespeech.models.loading import load_decoder, save_decoder
from livespeech.models.spelling import EOS_CHAR, PAD, spelling_table
from livespeech.models.tokenizer import get_tokenizer

CFG = preset("tiny", text_embedding="spelling", d_model=64, n_heads=2, n_shared_layers=1, n_group_layers=1,
             enc_d_model=64, enc_heads=2, enc_layers=1, n_enroll=8)


def test_spelling_table_holds_each_tokens_bytes():
    tok = get_tokenizer()
    table = spelling_table(CFG.text_vocab_size, CFG.spelling_max_len)
    for word, first in (("hello", True), ("world", False), ("Zyzzyva", False)):
        for i in tok.encode_words([word], first):
            b = tok._enc.decode_single_token_bytes(i)[: CFG.spelling_max_len]
            row = table[i].tolist()
            assert row[: len(b)] == [x + 1 for x in b] and all(x == PAD for x in row[len(b):])
    assert table[TEXT_EOS].tolist() == [EOS_CHAR] + [PAD] * (CFG.spelling_max_len - 1)


def test_tokens_with_the_same_spelling_embed_alike_and_every_token_is_read():
    torch.manual_seed(0)
    model = LiveSpeech2(CFG).eval()
    emb = model.text_emb
    # give two ids the same spelling: same vector; a rare token differs from a common one
    emb.spellings[7] = emb.spellings[1000]
    ids = torch.tensor([[7, 1000, 40000, TEXT_EOS]])
    out = emb(ids)
    assert out.shape == (1, 4, CFG.d_model)
    assert torch.allclose(out[0, 0], out[0, 1])
    assert not torch.allclose(out[0, 1], out[0, 2])
    assert model.project_text(ids)[0][0].shape[2] == 4  # the decoder's text path takes it


def test_a_saved_spelling_decoder_loads_back_with_its_table(tmp_path):
    torch.manual_seed(0)
    model = LiveSpeech2(CFG).eval()
    path = tmp_path / "decoder.pt"
    save_decoder(model, path, half=True)
    loaded = load_decoder(path)
    assert torch.equal(loaded.text_emb.spellings, model.text_emb.spellings)
    ids = torch.tensor([[3, 500, TEXT_EOS]])
    assert torch.allclose(loaded.text_emb(ids), model.text_emb(ids), atol=5e-2)
