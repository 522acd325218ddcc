#!/usr/bin/env python
"""Convert a Hugging Face Qwen3(-MoE) checkpoint to a megatron-core torch_dist checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir HF_DIR --out-dir OUT [--tp N --ep N --pp N]
        [--overwrite] [--dry-run]

The logic lives in :mod:`megatron_tg.convert.hf_to_megatron`. The ``__main__`` guard is
required: workers are spawned (they re-import this file) and torch_dist saves start a
multiprocessing manager.
"""

import sys

if __name__ == "__main__":
    # Imported under the guard: spawned helpers (the workers, megatron's checkpoint-writer
    # manager) re-import this file and must not pay for torch + megatron imports twice.
    from megatron_tg.convert.hf_to_megatron import main

    sys.exit(main())
