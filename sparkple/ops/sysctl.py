"""`python3 -m sparkple.ops.sysctl` as units rendered before the move run it:
sparkple.provision.sysctl."""

import sys

from ..provision.sysctl import main

if __name__ == "__main__":
    sys.exit(main())
