import sys

from megatron_tg.train.service.server import main

sys.exit(main())
