#!/usr/bin/env python
"""Export a megatron-core torch_dist Qwen3(-MoE) checkpoint to Hugging Face safetensors.

    python tools/convert_megatron_to_hf.py --megatron-dir CKPT --out-dir HF_OUT
        [--hf-config-dir DIR] [--tp N --ep N --pp N] [--max-shard-size 5GB] [--overwrite]

The logic lives in :mod:`megatron_tg.convert.megatron_to_hf`; the ``__main__`` guard is
required because workers are spawned and re-import this file.
"""

import sys

if __name__ == "__main__":
    # Imported under the guard: spawned helpers (the workers, megatron's checkpoint-writer
    # manager) re-import this file and must not pay for torch + megatron imports twice.
    from megatron_tg.convert.megatron_to_hf import main

    sys.exit(main())
