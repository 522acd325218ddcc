"""``python -m megatron_tg.demo``: the main job on CPU (:mod:`megatron_tg.demo.command`)."""

import sys

from megatron_tg.demo.command import main

if __name__ == "__main__":
    sys.exit(main())
