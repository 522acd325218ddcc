"""The didactic TG reproduction (paper §5.1) on CPU: a key-lookup task through ``search``
whose new ``lines=`` argument the base model never uses without feedback.

* :mod:`megatron_tg.demo.task` — tasks, tool, verifier / rubric, multi-turn episode driver;
* :mod:`megatron_tg.demo.base_model` — the SFT'd tiny Qwen3-MoE base model (cached build);
* :mod:`megatron_tg.demo.agent` — the rollout function the rollout manager runs;
* :mod:`megatron_tg.demo.rl` — one RL run through the real TG loop;
* :mod:`megatron_tg.demo.report` — summaries, tables, plot;
* ``python -m megatron_tg.demo`` — the main job (:mod:`megatron_tg.demo.command`).
"""
