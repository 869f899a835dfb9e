"""`python3 -m sparkple.ops.probe` as units rendered before the move run it:
sparkple.supervise.probe."""

import sys

from ..supervise.probe import main

if __name__ == "__main__":
    sys.exit(main())
