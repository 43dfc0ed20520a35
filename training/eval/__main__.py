"""`python -m livespeech.training.eval`: the evaluation (evaluate.py)."""
import sys

from .evaluate import main

sys.exit(main())
