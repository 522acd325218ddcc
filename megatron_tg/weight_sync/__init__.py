"""Weight sync: the trainer's weights -> every rollout engine (docs/architecture.md).

``sync``: the update itself (HF-name streaming, buckets, the coverage check, the probe,
:func:`~megatron_tg.weight_sync.sync.sync_to_engines`); ``checks``: what the sync and the
engine-loss path both check (``SyncStats``, ``SyncChecks``, the log-prob probe);
``engine_loss``: engines dropped from and re-admitted to the weight-update group;
``colocated``: the phases of a step around training by ``rollout.placement`` (colocated:
release the engines, onload/offload the trainer, weights by ``update_weights_from_tensor``).
"""
