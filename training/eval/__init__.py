"""Evaluation helpers for `livespeech.training.evaluate`: text normalisation and error rates
(`text`), lazily loaded metric backends (`backends`) and report rendering (`report`)."""
