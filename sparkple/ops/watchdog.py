"""`python3 -m sparkple.ops.watchdog` as units rendered before the move run it:
sparkple.supervise.watchdog."""

import sys

from ..supervise.watchdog import main

if __name__ == "__main__":
    sys.exit(main())
