"""What loss an untrained model scores on this trainer's task: the absolute anchor of every loss check.

A model that knows nothing predicts a uniform distribution over its
outputs, so its cross-entropy is the log of how many outputs there are:
ln(vocab size) for a token loss (causal LM, masked LM, seq2seq), ln(number
of labels) for single-label classification (ln 3 = 1.10 for three classes,
not ln(vocab)). Other losses have no such level: regression (MSE), multi-label
classification (a sum of binary cross-entropies), contrastive and other
custom losses, and the preference or policy losses of TRL's trainers. The
level is read from the model's head and config, and, where transformers
itself decides the problem type from the labels (``problem_type`` unset),
from the first batch's labels as it does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from harness.lib.trainer_kind import token_loss

CLASSIFICATION_HEADS = ("ForSequenceClassification", "ForTokenClassification")
UNJUDGED_HEADS = ("ForQuestionAnswering", "ForMultipleChoice", "ForPreTraining", "ForNextSentencePrediction")


@dataclass(frozen=True)
class UntrainedLoss:
    """The untrained level of a run's loss, or why there is none.

    ``kind``: ``token``, ``classification``, ``pending`` (a classifier whose
    problem type the first labels decide) or ``none``. ``level``: the loss of
    a uniform prediction (None when there is none). ``basis``: how the level
    was found, for messages (``ln(vocab=512)``), or why there is none.
    """

    kind: str
    level: float | None
    basis: str
    outputs: int | None = None  # vocabulary size or number of labels

    @property
    def known(self) -> bool:
        return self.level is not None


def _unwrapped(model: Any) -> Any:
    """The model under PEFT, DDP, DeepSpeed or torch.compile wrappers."""
    for _ in range(6):
        inner = None
        if callable(getattr(model, "get_base_model", None)):
            try:
                inner = model.get_base_model()
            except Exception:  # noqa: BLE001 - an adapter model half set up: judge what is there
                inner = None
        inner = inner if inner is not None and inner is not model else getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None or inner is model:
            return model
        model = inner
    return model


def _vocab_size(model: Any) -> int | None:
    """Rows of the output embedding (what the logits span), else the config's vocab_size."""
    try:
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    except Exception:  # noqa: BLE001 - an exotic head: fall back to the config
        head = None
    weight = getattr(head, "weight", None)
    shape = getattr(weight, "shape", None)
    if shape is not None and len(shape) == 2 and int(shape[0]) > 1:
        return int(shape[0])
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
    return int(vocab) if vocab else None


def none(why: str) -> UntrainedLoss:
    return UntrainedLoss("none", None, why)


def of_token_loss(vocab: int) -> UntrainedLoss:
    return UntrainedLoss("token", math.log(vocab), f"ln(vocab={vocab})", vocab)


def of_labels(num_labels: int) -> UntrainedLoss:
    return UntrainedLoss("classification", math.log(num_labels), f"ln(num_labels={num_labels})", num_labels)


def untrained_loss(trainer: Any) -> UntrainedLoss:
    """The untrained level of ``trainer``'s loss from its class, its model's head and config (see the module)."""
    if not token_loss(trainer):
        return none(f"{type(trainer).__name__} optimises a preference, reward or policy loss, which has no untrained level")
    if getattr(trainer, "compute_loss_func", None) is not None:
        return none("the Trainer was given its own compute_loss_func, a loss whose untrained level is not known")
    model = _unwrapped(getattr(trainer, "model", None))
    if model is None:
        return none("the trainer has no model")
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "get_output_embeddings", None)):
        return none(f"{name} is not a transformers model with a known head: its loss (contrastive, custom ...) has no untrained level")
    if any(name.endswith(head) for head in UNJUDGED_HEADS):
        return none(f"{name}'s loss is not a cross-entropy over a fixed set of outputs")
    if any(name.endswith(head) for head in CLASSIFICATION_HEADS):
        labels = int(getattr(config, "num_labels", 0) or 0)
        problem = getattr(config, "problem_type", None)
        if problem == "regression" or labels == 1:
            return none(f"{name} is a regression head (num_labels={labels}): its mean squared error has no untrained level")
        if problem == "multi_label_classification":
            return none(f"{name} is a multi-label head: its loss, a sum of binary cross-entropies, is not judged against ln(labels)")
        if labels < 2:
            return none(f"{name} has num_labels={labels}")
        level = of_labels(labels)
        return level if problem == "single_label_classification" else replace(level, kind="pending")
    vocab = _vocab_size(model)
    if not vocab or vocab < 2:
        return none(f"{name} has no vocabulary size to judge its token loss against")
    return of_token_loss(vocab)


def settled_by_labels(level: UntrainedLoss, labels: Any) -> UntrainedLoss:
    """A ``pending`` classifier's level once its labels are seen, as transformers decides: integer labels are single-label
    classification (the level stays), floating-point ones multi-label (no level). Other kinds are returned as they are."""
    if level.kind != "pending":
        return level
    dtype = getattr(labels, "dtype", None)
    if dtype is None:
        return level
    if getattr(dtype, "is_floating_point", False):
        return none(f"float labels on a {level.outputs}-label head: multi-label classification, a sum of binary cross-entropies, "
                    "not judged against ln(labels)")
    return replace(level, kind="classification")
