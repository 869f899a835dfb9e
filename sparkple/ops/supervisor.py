"""`python3 -m sparkple.ops.supervisor`, as units rendered before the move run it: a pair node's
command line (it has --pair-rank) runs sparkple.pair.supervisor_cli, any other
sparkple.supervise.supervisor_cli."""

from __future__ import annotations

import sys

from ..pair import supervisor_cli as pair_supervisor_cli
from ..supervise import supervisor_cli


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    on_pair = any(w == "--pair-rank" or w.startswith("--pair-rank=") for w in words)
    if on_pair:
        return pair_supervisor_cli.main(words)
    return supervisor_cli.main(words)


if __name__ == "__main__":
    sys.exit(main())
