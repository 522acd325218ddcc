#!/usr/bin/env python
"""Draw the curves of one or more runs side by side into a PNG (see megatron_tg.train.plot)."""

import sys

from megatron_tg.train.plot import main

if __name__ == "__main__":
    sys.exit(main())
