"""The demo base model's settings: :class:`BaseModelConfig` and the CI-sized build's overrides.

The build (:mod:`.base_model`), its SFT data (:mod:`.sft_data`) and its evaluation
(:mod:`.base_eval`) read these; a build's cache key hashes them with the sources.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BaseModelConfig:
    seed: int = 0
    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    hint_fraction: float = 0.5
    """Fraction of SFT examples that carry the hint (and use the new format)."""
    context_fraction: float = 0.2
    """Fraction of the other examples whose (untrained) tool call uses the new format."""
    hint_old_fraction: float = 0.15
    """Fraction of the hint examples whose tool call uses the OLD format, with the format's
    branch token (the first token where the two formats differ) masked out of the loss: the
    model never learns to choose the old format under the hint, but learns to continue an
    old-format call it finds in its context coherently. That is what the TG expert is asked to
    do: it scores the student's (old-format) turn token by token. Without these examples the
    expert, teacher-forced past the branch onto a prefix it never saw, predicted junk
    (``</parameter`` after ``</``, a digit instead of ``</tool_call>``) with per-token KL of
    10-13 nats at three positions besides the branch; the KL then taught malformed calls and
    the student stopped searching within 5 RL steps (measured with forward KL). With 0.15:
    off-branch KL mean < 0.001, max 0.04 (seed 0); 0.25 cost task success in one build
    (0.87 without hint, 0.54 with); 0.15, and 0.1 with context_fraction 0.3, kept it at
    0.98-0.99 (seed 0, 256 episodes each)."""
    new_no_hint_fraction: float = 0.0
    """Fraction of the hint-less examples whose tool call uses the new format and is TRAINED
    (kind ``plain_new``): the knob of the phase experiment, which needs base models whose
    no-hint probability of the new format is ~1e-4 or ~1e-2 instead of ~1e-6. 0 (default): no
    such example, the base model of paper §5.1."""
    new_no_hint_branch_weight: float = 1.0
    """Loss weight of the format's branch token in ``plain_new`` examples (the rest of the call
    keeps weight 1, so a model that does branch writes a well-formed new-format call). The
    weighted-CE optimum of the branch probability is about f*w / (f*w + 1 - f) with f =
    ``new_no_hint_fraction``, w this weight: a fraction alone cannot reach 1e-4 with a pool of
    a few thousand examples (it would be under one example)."""
    wrong_answer_fraction: float = 0.0
    """Paper environment only (:mod:`.paper_base`): fraction of the demonstrations whose
    answer states a wrong value (:func:`.paper_env.wrong_value`), so
    the base fails the task on about this fraction of its episodes and GRPO has a task
    gradient from step 1 (issue 38's stability comparison). 0 (default): every demonstration
    answers right, and the random stream that draws the others is unchanged."""
    skip_search_fraction: float = 0.0
    """Paper environment only (:mod:`.paper_base`): fraction of the demonstrations that answer
    at once, without searching (a plan that says so, then "I do not know KEY.": no value), with
    no hint. The base then fails the task by one early decision (search or not) while its copy
    of a searched value stays intact, so GRPO has a task gradient from step 1 (issue 38's
    stability base). Among the hint-less turns whose decision is trained, the share that skip
    is ``f / (f + 0.4 (1 - f))`` at the default hint and context fractions (0.5, 0.2). 0
    (default): every demonstration searches, and the random stream that draws the others is
    unchanged."""
    pool_size: int = 4096
    """Distinct SFT examples, rendered and tokenised once, then sampled with replacement."""
    # model (Qwen3MoeConfig)
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 128
    max_position_embeddings: int = 1024
    # tokenizer
    vocab_size: int = 512
    tokenizer_docs: int = 600
    # evaluation
    eval_episodes: int = 256
    """Sampled episodes per condition (no hint / hint / forced new format without hint)."""
    eval_temperature: float = 1.0
    eval_max_new_tokens: int = 48
    eval_batch_size: int = 128
    max_turns: int = 3
    threads: int = 1
    """torch threads for the build (1 measured fastest on the 2-core CI machines)."""

    def model_config(self, vocab_size: int, eos_id: int, pad_id: int):
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size,
            intermediate_size=2 * self.hidden_size, moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.hidden_size // self.num_heads,
            num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=False,
            eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None,
        )


QUICK = dict(steps=400, eval_episodes=128)
"""Overrides for the CI-sized build (``--quick`` / the tests): the full build's 400 SFT steps,
evaluated on half the episodes. 300 steps (the earlier setting) learned the copy skill on one
machine's kernels and package versions but not on another's; 400 learns it on both (below)."""

QUICK_EXPECTED = {"success_no_hint": 0.8, "success_hint": 0.8, "success_forced_new_no_hint": 0.8}
"""Lower bounds the tests assert for the QUICK build (seed 0), with margins measured on more
than one setting. 128 episodes per rate (success without hint / with hint / after a forced
new-format call without hint), seed 0, ``build_base_model(out, seed=0, **QUICK)``:

* 400 steps, this machine's AVX2 kernels: 0.984 / 0.961 / 0.992;
* 400 steps, ``ATEN_CPU_CAPABILITY=default`` (torch's non-vectorised kernels: other float
  rounding, as on another CPU): 0.961 / 0.914 / 0.875;
* 300 steps (the earlier QUICK), a fresh venv of today's packages: 0.805 / 0.625 / 0.633, and
  0.789 without hint on another machine, where the earlier tree measured 0.938 / 0.922 / 0.961 —
  a build at the edge of learning the skill, which is why QUICK moved to 400 steps.

New format with the hint 0.992 / 1.000, without it 0 / 0 (400 steps). The 0.8 bounds sit
0.075 under the lowest measured rate (sampling noise at 128 episodes: about ±0.03); a build
that misses the copy skill scores far lower (150 steps: 0.19)."""

