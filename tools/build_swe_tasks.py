"""Build SWE-style task instances from a real Python package and its own test suite.

    python tools/build_swe_tasks.py --sdist toolz==1.0.0 \
        --sha256 2c86e3d9a04798ac556793bced838816296a2f085017664e4995cb40a1047a02 \
        --repo pytoolz/toolz --package toolz --tests toolz/tests \
        --repos-root data/repos --out data/swe_tasks.jsonl --max-instances 40

See :mod:`megatron_tg.agent.swe.build` for what it does.
"""

import sys

from megatron_tg.agent.swe.build import main

if __name__ == "__main__":
    sys.exit(main())
