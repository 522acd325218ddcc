#!/usr/bin/env python
"""Vet a rubric's feedback strings before training (paper §4): for each criterion with a
feedback string, sample agent rollouts with the feedback inserted before the turn(s) the
criterion scopes and without it, judge both, and keep the string only if it raises the
criterion's pass rate (CI above 0) without lowering the primary reward by more than a threshold.

    python tools/vet_feedback.py --model HF_DIR --rubric recipes/rubrics/tool_format.yaml \\
        --tasks builtin --samples 16 [--temperature 1.0] --out vet_report.json
    python tools/vet_feedback.py --server http://host:30000 --tokenizer HF_DIR ...

The procedure, the statistics and the flags are documented in
:mod:`megatron_tg.judge.command` (``--help`` lists the flags).
"""

import sys

if __name__ == "__main__":
    from megatron_tg.judge.command import main

    sys.exit(main())
