"""``salaquant eval``: a quantized SALA checkpoint against its bf16 source, in one process on the same inputs.

One concept per module:

* ``data``: held-out text (a file, a folder, a dataset or the shipped sample) as one token stream;
* ``perplexity``: perplexity over fixed-length windows of a token stream;
* ``metrics``: perplexity of both models, per-token NLL differences, KL(source || quantized), top-1 agreement;
* ``niah``: synthetic needle-in-a-haystack prompts and exact-match scoring;
* ``generation``: greedy continuations and their checks (collapse, n-gram loops, NaN/Inf, first divergence);
* ``layers``: relative error of each quantized decoder layer (and linear) on the float model's hidden states;
* ``thresholds``: the command-line gates and the exit status they decide;
* ``report``: terminal tables, ``eval.json`` and ``eval.png``;
* ``options``: what to measure (``EvalOptions``) and the length / depth flags; ``inputs``: the checks of the inputs
  before any model is loaded; ``scoring``: NIAH and task results, the spread of repeated runs;
* ``command``: ``run_eval``, the orchestration behind the CLI.
"""

from .command import run_eval
from .options import EvalInputError, EvalOptions
from .thresholds import Thresholds

__all__ = ["EvalInputError", "EvalOptions", "Thresholds", "run_eval"]
