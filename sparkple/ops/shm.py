"""`python3 -m sparkple.ops.shm` as units rendered before the move run it:
sparkple.supervise.shm."""

import sys

from ..supervise.shm import main

if __name__ == "__main__":
    sys.exit(main())
