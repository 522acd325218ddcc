#!/usr/bin/env python
"""Draw the curves of one or more runs side by side into a PNG (see megatron_tg.plot.command)."""

import sys

from megatron_tg.plot.command import main

if __name__ == "__main__":
    sys.exit(main())
