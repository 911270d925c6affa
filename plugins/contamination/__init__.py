"""contamination: watches every training micro-batch for the eval sets' n-grams, off the critical path.

At run start the eval sets named in config (and, by default, the Trainer's
own ``eval_dataset``) are tokenised with the run's tokenizer and indexed
(``harness.lib.ngrams``: the same index ``harness scan`` uses, token front end,
each example also as it tokenises after a space mid-document). Each checked
micro-batch's token ids are copied to the host and handed to a background
thread (:mod:`.checker`), which looks every window of every row up in the
index. An eval example is judged like ``harness scan`` judges it
(``harness.lib.overlap.judge``): on the fraction of its n-grams matched over
the whole run, every micro-batch, step and rank together
(``harness.lib.overlap_ledger``: matched windows ride the step exchange's one
all-gather), so template text shared by train and eval (a few n-grams of an
example) stays ``partial`` (summary and report only) and a leaked example cut
across two training blocks is still dirty. A dirty example is a
``CONTAMINATION`` finding once per run: one rank reports it, and examples an
earlier attempt in the same run directory reported are not reported again. At
run end every eval set gets a summary and lists of clean, partial and dirty
ids in ``<output_dir>/harness/contamination/`` (uploaded by the ``mlflow``
plugin). ``EVAL_SPLIT_OVERLAP`` compares the Trainer's train and eval datasets
row by row before training.
"""
from __future__ import annotations

from .checker import PUT_POLL_S, QUEUE_SIZE
from .options import CONTAMINATION, CONTAMINATION_SUMMARY, CONTAMINATION_UNCHECKED, EVAL_SPLIT_OVERLAP, ContaminationOptions, EvalSet
from .plugin import EXCHANGE_INTS, LAST_STEP_WAIT_S, RUN_END_WAIT_S, Contamination
from .sources import trainer_eval_examples as _trainer_eval_examples

__all__ = [
    "CONTAMINATION", "CONTAMINATION_UNCHECKED", "EVAL_SPLIT_OVERLAP", "EXCHANGE_INTS", "LAST_STEP_WAIT_S", "PUT_POLL_S",
    "QUEUE_SIZE", "RUN_END_WAIT_S", "Contamination", "ContaminationOptions", "EvalSet", "_trainer_eval_examples",
]
