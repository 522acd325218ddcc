import sys

from megatron_tg.sampling.service.server import main

sys.exit(main())
