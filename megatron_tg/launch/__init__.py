"""Launching a run on a cluster: the planner behind ``slurm/*.sh``.

:mod:`megatron_tg.launch.plan` resolves a recipe and a node list into roles (trainer,
rollout engines, router, judge), GPUs and ports; :mod:`megatron_tg.launch.render` prints
that plan as text, JSON or bash; :mod:`megatron_tg.launch.health` probes the servers'
``/health`` for the batch script. None of them imports torch, so the batch script's
bookkeeping costs about a second.
"""
