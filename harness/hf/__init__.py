"""The Hugging Face Trainer integration, one concern per module.

- ``attach``: :func:`~harness.hf.attach.attach`, the entry point;
- ``bridge``: the :class:`~harness.hf.bridge.Bridge` that wires the parts (and
  says why the Trainer's methods are wrapped at all);
- ``tap``: the micro-batch tap (``training_step``, ``compute_loss``, grad norm,
  batch sampling);
- ``step_record``: all state of the step in flight, replaced every step;
- ``guard``: the step guard (one device read, ``on_before_optimizer_step``,
  the cross-rank agreement);
- ``actions``: agreed actions on ``TrainerControl``, rollback by an injected handler;
- ``checkpoint_state``: plugin state beside checkpoints, resume dispatch;
- ``lifecycle``: one ``train()`` call (lock, run.json, markers, run end, report);
- ``isolation``: findings for failing or stopping plugins;
- ``callback``: the one ``TrainerCallback``;
- ``optimizers``: the optimizer guards per engine (accelerate, DeepSpeed).
"""
