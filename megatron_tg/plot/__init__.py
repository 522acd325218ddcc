"""``megatron-tg plot`` (``command``): runs' curves side by side from their ``metrics.jsonl``."""
