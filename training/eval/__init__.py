"""Evaluation of a model folder, in one package.

- `evaluate` (`python -m livespeech.training.eval`): test clips through the streaming
  path the server uses, scored with Whisper (WER/CER), speaker similarity and MOS
- `diagnose` (`python -m livespeech.training.eval.diagnose`): where the decoder fails
  (free-running against oracle graphemes and codebook 1, teacher forcing)
- `reading` (`python -m livespeech.training.eval.reading`): how much a decoder reads its
  text (teacher forcing with its own text against another's; attention on the spoken word)
- `compare` (`python -m livespeech.training.eval.compare A.json B.json`): two runs on the
  same clips, clip by clip, with a paired bootstrap interval
- `text` (normalisation and error rates), `backends` (metric models, loaded lazily),
  `report` (the markdown tables)
"""
