import sys

from megatron_tg.train.command import main

sys.exit(main())
