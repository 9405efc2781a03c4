"""The warm start of the tiny CPU model (the ``base_model`` stage) and the supervised controls RL is compared with.

- ``dapo_core.warmstart.demos``: the problems it trains and is evaluated on (held-out and probe sets, the seeded
  stream of demonstrations and their habits: shortcuts, run-ons, checks);
- ``dapo_core.warmstart.sft``: the SFT warm start itself (``run_warm_start``) and its held-out evaluation;
- ``dapo_core.warmstart.control``: the controls, which continue the warm start's stream (``continue_warm_start``).

It sits above ``dapo_core.data`` (the synthetic task) and ``dapo_core.engines`` (model, trainer, rollout), and its
settings come from the config's ``base_model:`` section.
"""
