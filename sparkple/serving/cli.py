"""`sparkple serving-plan` and `sparkple launch-gate`: the recipe and the budget as the role
runs them, the recipe given as JSON of the role's variables (`variables()` names them)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import EXIT_CHECK_FAILED, EXIT_OK
from ..meminfo import read_meminfo
from .budget import BudgetKnobs, compute_budget, launch_gate, snapshot_sizes
from .multinode import HEAD, TP_SIZE, node_args
from .recipe import Recipe, ServingError

# The truth values Ansible's `bool` filter takes (a variable set with -e arrives as a string).
TRUE_WORDS = ("1", "true", "yes", "on", "y", "t")
FALSE_WORDS = ("0", "false", "no", "off", "n", "f", "")


def variables() -> dict[str, str]:
    """--recipe's keys -> the role variable each one is read from (the recipe's, then the
    budget's): what vllm_service passes, through its lookup plugin."""
    return {f.name: f.metadata["var"] for cls in (Recipe, BudgetKnobs) for f in fields(cls)}


def _coerce(key: str, value: Any, kind: str) -> Any:
    """One value of --recipe as its field's type; a string from the inventory is taken as
    Ansible's int, float and bool filters take it."""
    where = f"{variables()[key]} ({key}) is {value!r}"
    if kind == "bool":
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
        raise ServingError(f"{where}: use true or false")
    if kind in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ServingError(f"{where}: use a number")
        try:
            number = float(value)
        except ValueError:
            raise ServingError(f"{where}: use a number") from None
        if kind == "int":
            if number != int(number):
                raise ServingError(f"{where}: use a whole number")
            return int(number)
        return number
    if kind.startswith("tuple"):
        if not isinstance(value, list | tuple):
            raise ServingError(f"{where}: use a list of strings")
        return tuple(value)
    return value


def from_spec(spec: dict[str, Any]) -> tuple[Recipe, BudgetKnobs]:
    """The recipe and the budget knobs from --recipe (refused: unknown keys, wrong types)."""
    unknown = sorted(set(spec) - set(variables()))
    if unknown:
        raise ServingError(f"--recipe has unknown keys {unknown}")

    def given(cls: type) -> dict[str, Any]:
        return {
            f.name: _coerce(f.name, spec[f.name], str(f.type))
            for f in fields(cls)
            if f.name in spec
        }

    try:
        recipe, knobs = Recipe(**given(Recipe)), BudgetKnobs(**given(BudgetKnobs))
    except TypeError as exc:
        raise ServingError(f"--recipe: {exc}") from None
    return recipe, knobs


@dataclass(frozen=True)
class PairRank:
    """This Spark's side of a pair, as serving-plan takes it (--pair-rank, --master-addr,
    --master-port; the role passes sparkple_pair_info's)."""

    rank: int
    master_addr: str
    master_port: int

    def args(self) -> list[str]:
        return node_args(self.rank, self.master_addr, self.master_port)

    def describe(self) -> dict[str, Any]:
        role = "head" if self.rank == HEAD else "worker"
        return {**asdict(self), "role": role, "tp_size": TP_SIZE, "vllm_args": self.args()}


def plan(
    snapshot: Path,
    recipe: Recipe,
    knobs: BudgetKnobs,
    mem_total_bytes: int,
    pair: PairRank | None = None,
    patch_profile: str = "",
) -> dict[str, Any]:
    """The recipe and knobs as typed, the sizes, the budget, its summary, vLLM's argv (with
    a pair: this rank's, and a `pair` entry) and the PLE backend the unit serves (`ple_backend`:
    whether the packed table is mounted and named by SPARKPLE_PLE_TABLE_DIR); ServingError when
    it cannot work. patch_profile: the vLLM patch profile (its vLLM bounds the backends)."""
    recipe.check_backend(patch_profile)
    sizes = snapshot_sizes(snapshot)
    recipe.check(sizes.mtp_layers)
    pair_args = pair.args() if pair else []
    budget = compute_budget(sizes, recipe, mem_total_bytes, knobs, TP_SIZE if pair else 1)
    summary = budget.summary()
    if pair:
        summary = (
            f"Per rank (rank {pair.rank} of {TP_SIZE}, the pair's {pair.describe()['role']}; "
            f"half the weights on each Spark): {summary}"
        )
    result = {
        "recipe": {**asdict(recipe), **asdict(knobs)},
        "sizes": asdict(sizes),
        "budget": asdict(budget),
        "summary": summary,
        "argv": recipe.argv(budget.gpu_memory_utilization, sizes.rope_parameters, pair_args),
        "ple_backend": {
            "name": recipe.ple_backend,
            "packed_table": recipe.packed_table,
            "patch_profile": patch_profile,
        },
    }
    return {**result, "pair": pair.describe()} if pair else result


def _plan_cmd(args: argparse.Namespace) -> int:
    try:
        spec = json.loads(args.recipe)
    except json.JSONDecodeError as exc:
        raise ServingError(f"--recipe is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ServingError("--recipe must be a JSON object")
    recipe, knobs = from_spec(spec)
    total = args.mem_total_bytes or read_meminfo().get("MemTotal", 0)
    pair = None
    given = [args.pair_rank is not None, bool(args.master_addr), args.master_port is not None]
    if any(given) and not all(given):
        raise ServingError(
            "a pair's node needs all of --pair-rank, --master-addr and --master-port "
            "(a single Spark: none of them)"
        )
    if all(given):
        pair = PairRank(args.pair_rank, args.master_addr, args.master_port)
    result = plan(Path(args.snapshot), recipe, knobs, total, pair, args.patch_profile)
    print(json.dumps(result, indent=None if args.json else 2))
    return EXIT_OK


def _gate_cmd(args: argparse.Namespace) -> int:
    ok, message = launch_gate(args.need_mib, Path(args.meminfo))
    print(f"sparkple launch-gate: {message}", file=sys.stdout if ok else sys.stderr)
    return EXIT_OK if ok else EXIT_CHECK_FAILED


def add_parser(sub: Any, name: str) -> None:
    if name == "serving-plan":
        p = sub.add_parser(name, help="vLLM's arguments and the memory budget for a snapshot")
        p.add_argument("snapshot", help="the snapshot directory (HF cache layout is fine)")
        p.add_argument("--recipe", required=True, help="the recipe and budget knobs as JSON")
        p.add_argument(
            "--mem-total-bytes", type=int, default=0, help="MemTotal (default: /proc/meminfo)"
        )
        p.add_argument("--json", action="store_true", help="one line of JSON")
        p.add_argument(
            "--pair-rank", type=int, help="a pair's node: 0 the head, 1 the worker (--headless)"
        )
        p.add_argument("--master-addr", default="", help="a pair's head link address")
        p.add_argument("--master-port", type=int, help="a pair's rendezvous port on the head")
        p.add_argument(
            "--patch-profile",
            default="",
            help="the vLLM patch profile (vllm-0.34; its vLLM bounds the PLE backends)",
        )
        p.set_defaults(func=_plan_cmd)
    else:
        p = sub.add_parser(name, help="refuse a launch when MemAvailable is too low")
        p.add_argument("--need-mib", type=int, required=True, help="MemAvailable needed")
        p.add_argument("--meminfo", default="/proc/meminfo", help=argparse.SUPPRESS)
        p.set_defaults(func=_gate_cmd)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - through sparkple.cli
    from ..cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
