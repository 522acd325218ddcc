"""The didactic TG reproduction (paper §5.1) on CPU: a key-lookup task through ``search``
whose new ``lines=`` argument the base model never uses without feedback.

* :mod:`megatron_tg.demo.task` — tasks, tool, verifier / rubric, multi-turn episode driver;
* :mod:`megatron_tg.demo.base_model` — the SFT'd tiny Qwen3-MoE base model (cached build).
"""
