"""``python -m conduit.bench.peers``: same as ``conduit bench peers``."""

import sys

from conduit.bench.peers.harness import main

sys.exit(main())
