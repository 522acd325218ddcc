"""The rollout side as a service off the trainer (docs/rollout-service.md).

``server``: the service process (``python -m megatron_tg.sampling.service``) around a rollout
side; ``client``: the trainer's :class:`~megatron_tg.sampling.protocols.RolloutSource` that calls
it, and the placement choice (``rollout.service``); ``wire``: the JSON messages between them.
"""
