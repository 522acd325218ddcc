"""Vocab-parallel loss ops: never gather the vocabulary, chunk over tokens.

Public API::

    vocab_parallel_logprob(logits, target_ids, group=None, *, vocab_size=None, chunk_size=1024)
    vocab_parallel_entropy(logits, group=None, *, vocab_size=None, chunk_size=1024)
    vocab_parallel_kl(student_logits, expert_logits, group=None, *, vocab_size=None,
                      direction="reverse", beta=0.5, chunk_size=1024)
    fused_vocab_parallel_logprob(hidden, weight_shard, target_ids, group=None, ...)
    fused_vocab_parallel_entropy(hidden, weight_shard, group=None, ...)
    fused_vocab_parallel_kl(student_hidden, expert_hidden, weight_shard, group=None, ...)
    fused_vocab_parallel_kl_loss(student_hidden, expert_hidden, weight_shard, token_weights,
                                 group=None, ...)  -> (Σ w·KL, KL per token): no recompute

See :mod:`megatron_tg.ops.vocab_parallel` for the layout, the collectives and the memory
contract, and :mod:`megatron_tg.ops._kernels` for the formulas and gradients.
"""

from megatron_tg.ops.vocab_parallel import (
    DEFAULT_CHUNK_SIZE,
    KL_DIRECTIONS,
    fused_vocab_parallel_entropy,
    fused_vocab_parallel_kl,
    fused_vocab_parallel_kl_loss,
    fused_vocab_parallel_logprob,
    vocab_parallel_entropy,
    vocab_parallel_kl,
    vocab_parallel_logprob,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "KL_DIRECTIONS",
    "fused_vocab_parallel_entropy",
    "fused_vocab_parallel_kl",
    "fused_vocab_parallel_kl_loss",
    "fused_vocab_parallel_logprob",
    "vocab_parallel_entropy",
    "vocab_parallel_kl",
    "vocab_parallel_logprob",
]
