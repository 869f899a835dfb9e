"""recipe_variables: the keys of `sparkple serving-plan --recipe` and the variable each is read
from, as the serving recipe declares them (sparkple.serving.cli.variables), so that a flag added
to the recipe needs no line in this role's vars.

The package is this checkout's, the one sparkple_package installs on the hosts.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ansible.plugins.lookup import LookupBase

CHECKOUT = Path(__file__).resolve().parents[3]


def recipe_variables() -> dict[str, str]:
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    from sparkple.serving.cli import variables

    return variables()


class LookupModule(LookupBase):
    def run(
        self, terms: list[object], variables: dict[str, object] | None = None, **kwargs: object
    ) -> list[dict[str, str]]:
        return [recipe_variables()]
