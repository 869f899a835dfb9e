"""The package as a release made before the host programs moved runs with (sparkple/ops/ as one
room): what sparkple_package copied at the last commit before the move, the package and the
patch templates,
  git archive --format=tar e89b361 sparkple templates | gzip -9n
It goes with the old module paths (sparkple/ops/), in the release after next."""

from __future__ import annotations

import subprocess
from pathlib import Path

BEFORE_THE_MOVE = "e89b361463ec672c9426813bd2702cf5e30bafa7"
ARCHIVE = Path(__file__).parent / "ops" / "data" / "package-before-the-move.tar.gz"


def unpack(dest: Path) -> Path:
    """The archive unpacked into `dest` (as sparkple_package unpacks a version), which is
    returned; its layout checked to be the old one."""
    subprocess.run(["tar", "-xzf", ARCHIVE, "-C", dest], check=True, timeout=60)
    # the host programs in one room, none of the new ones
    assert (dest / "sparkple" / "ops" / "supervision.py").is_file()
    assert not (dest / "sparkple" / "supervise").exists()
    return dest
