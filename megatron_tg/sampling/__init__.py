"""The rollout side: what produces the trainer's judged samples (docs/architecture.md).

``protocols``: the loop's seam to it (``RolloutSource``, ``WeightTarget``); ``rollouts``: the
in-process side (engines, manager, judge: ``RolloutSide``) and judged rollouts -> train
samples; ``hinted``: hinted turns sampled after judging; ``service``: the same side as a
process of its own over HTTP (docs/rollout-service.md).
"""
