"""vLLM patch profiles: render a profile against original vLLM sources, check a deployed result.

A profile is a directory `templates/vllm/<name>/` holding `profile.yml` and Jinja templates
(`sparkple.patch.profile` reads and validates it). `render` refuses to write anything unless
every original matches its pinned sha256, every edit's anchor occurs exactly once, no file
already carries the patch marker, and every result parses as Python. The output appears in OUT
only when all of that succeeded (written to a temporary sibling directory and renamed into
place), together with `manifest.json`, which `check` later compares a deployed directory
against.

`port` checks a profile's pins and anchors against another vLLM release, and `write_draft`
drafts the profile for it (`sparkple patch port`).
"""

from .check import check
from .port import EditReport, OriginalReport, PortInputError, PortReport, port, write_draft
from .profile import DEFAULT_PROFILE, PATCH_MARKER, Profile, load_profile, sha256_file
from .render import MANIFEST_NAME, render

__all__ = [
    "DEFAULT_PROFILE",
    "EditReport",
    "MANIFEST_NAME",
    "OriginalReport",
    "PATCH_MARKER",
    "PortInputError",
    "PortReport",
    "Profile",
    "check",
    "load_profile",
    "port",
    "render",
    "sha256_file",
    "write_draft",
]
