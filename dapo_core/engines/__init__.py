"""Engines: model/tokenizer loading, rollout backends, the policy trainer, checkpoints and executors.

Import the submodules directly (``dapo_core.engines.trainer``, ``.rollout``, ``.executor``, ...); this package
imports nothing at load time so that light users (the CLI's ``config show``) stay fast.
"""
