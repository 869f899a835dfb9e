"""`python3 -m sparkple.ops.metrics` as units rendered before the move run it:
sparkple.metrics.collect."""

import sys

from ..metrics.collect import main

if __name__ == "__main__":
    sys.exit(main())
