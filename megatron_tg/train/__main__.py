import sys

from megatron_tg.train.cli import main

sys.exit(main())
