"""Rollouts: the token-exact data model (``megatron_tg.rollout.types``) and engine clients."""
