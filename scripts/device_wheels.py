"""Which wheels a GPU machine without network needs beside its own torch, Lightning, rich, typer
and pyyaml, derived from the installed packages' metadata rather than kept by hand (a list by
hand left out typeshed_client, and LightningCLI failed on the GPU: ../shared/gpu-runs/
2026-11-28-h200/gpu_tests.log).

    python scripts/device_wheels.py --pins [--python 3.12]   name==version, one a line
    python scripts/device_wheels.py --check                  import what benchmarks/gpu.sh runs
    python scripts/device_wheels.py --as-device [--leave-out NAME]
        --check in a child that sees only the machine's packages and the pinned ones (the
        others' modules and metadata hidden): a wheel missing from the list fails here

What the GPU parts need: autoshard with its ``lightning``, ``hf``, ``float8`` and ``peft`` extras
(LightningCLI's ``jsonargparse[signatures]``, accelerate and the Hugging Face Trainer for the
handover test, torchao for float8, peft for estimate_accuracy's LoRA points), each with every
requirement it has, at the versions installed here (what CI tests), less what the machine has
already: the five packages above and everything they require.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import subprocess
import sys
from collections.abc import Iterable

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What the lent GPU machine's python3 has (its image; /work/.library/device/KINDS.md).
ON_THE_MACHINE = ("torch", "lightning", "rich", "typer", "pyyaml")
EXTRAS = ("lightning", "hf", "float8", "peft")


def environment(python: str) -> dict[str, str]:
    """Marker values of the GPU machine: Linux x86-64, CPython ``python`` (e.g. 3.12)."""
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0",
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
               implementation_name="cpython")  # fmt: skip
    return env


def closure(
    roots: Iterable[str], python: str, stop: Iterable[str] = ()
) -> dict[str, metadata.Distribution]:
    """Every installed distribution ``roots`` need (``name`` or ``name[extra,...]``), they
    included, by canonical name; the requirements of those in ``stop`` are not followed. A
    requirement that applies there but is not installed here cannot be pinned: an error that
    names it."""
    env = environment(python)
    stopped = {canonicalize_name(n) for n in stop}
    found: dict[str, metadata.Distribution] = {}
    walked: set[tuple[str, str]] = set()
    todo = [Requirement(root) for root in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        for extra in ("", *sorted(req.extras)):
            if (name, extra) in walked:
                continue
            walked.add((name, extra))
            try:
                dist = found.get(name) or metadata.distribution(name)
            except metadata.PackageNotFoundError:
                raise SystemExit(f"device_wheels: {req} is needed but not installed here") from None
            found[name] = dist
            for line in () if name in stopped else dist.requires or ():
                sub = Requirement(line)
                # an extra's requirements only for that extra ("extra" is "" for the base)
                if sub.marker is None or sub.marker.evaluate({**env, "extra": extra}):
                    todo.append(sub)
    return found


def pins(python: str = "3.12") -> list[str]:
    """``name==version`` of each distribution the GPU parts need and the machine lacks. The
    machine's packages are taken with what they need there, at their own versions, which may
    need less than theirs here (its typer 0.27 does without pydantic, this typer 0.29 not):
    their requirements are not followed, and torch's are the machine's."""
    needed = closure([f"autoshard[{','.join(EXTRAS)}]"], python, stop=ON_THE_MACHINE)
    there = closure(["torch"], python) | {canonicalize_name(n): None for n in ON_THE_MACHINE}
    keep = sorted(set(needed) - set(there) - {"autoshard"})
    return [f"{needed[n].metadata['Name']}=={needed[n].version}" for n in keep]


def machine_closure(python: str = "3.12") -> set[str]:
    """What --as-device leaves visible besides the pins: the machine's packages and what they
    require, as installed here (their versions there may need less; the pins do not rely on
    it: they follow none of these packages' requirements)."""
    return set(closure([*ON_THE_MACHINE, "torch"], python))


def _lightning_cli() -> None:
    from lightning.pytorch import cli

    if not cli._JSONARGPARSE_SIGNATURES_AVAILABLE:
        raise ImportError(str(cli._JSONARGPARSE_SIGNATURES_AVAILABLE))
    import docstring_parser  # noqa: F401  jsonargparse's signatures read docstrings
    import typeshed_client  # noqa: F401  ...and type stubs


def _optuna_storage() -> None:
    import optuna

    optuna.storages.RDBStorage("sqlite:///:memory:")  # SQLAlchemy and alembic


# What benchmarks/gpu.sh's parts import, each a line of --check's answer.
NEEDS = {
    "autoshard": lambda: __import__("autoshard.cli"),
    "optuna with its SQL storage": _optuna_storage,
    "LightningCLI (jsonargparse[signatures])": _lightning_cli,
    "accelerate": lambda: __import__("accelerate"),
    "the Hugging Face Trainer": lambda: __import__("transformers").Trainer,
    "peft (LoRA targets)": lambda: __import__("peft"),
    "torchao float8": lambda: __import__("torchao.float8"),
}


def check(only: Iterable[str] = ()) -> list[str]:
    """One line per need (of ``only``, or all) that fails to import here."""
    failed = []
    for what, need in NEEDS.items():
        if only and what not in only:
            continue
        try:
            need()
        except Exception as exc:
            failed.append(f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return failed


_AS_DEVICE = """
import importlib.machinery, json, sys
hidden_modules, hidden_dists = set(json.loads(sys.argv[1])[0]), json.loads(sys.argv[1])[1]
finder = importlib.machinery.PathFinder
find_spec, find = finder.find_spec, finder.find_distributions
def spec(name, path=None, target=None):  # as if the module's files were not there
    return None if name.split(".")[0] in hidden_modules else find_spec(name, path, target)
finder.find_spec = spec
def visible(*args, **kwargs):
    from packaging.utils import canonicalize_name
    for d in find(*args, **kwargs):
        if canonicalize_name(d.metadata["Name"] or "") not in hidden_dists:
            yield d
finder.find_distributions = visible
sys.path.insert(0, sys.argv[2])
import device_wheels
failed = device_wheels.check(json.loads(sys.argv[3]))
print("\\n".join(failed) if failed else "device_wheels: every need imports")
sys.exit(1 if failed else 0)
"""


def as_device(
    leave_out: Iterable[str] = (), python: str = "3.12", only: Iterable[str] = ()
) -> subprocess.CompletedProcess:
    """--check (of the needs ``only``, or all) in a child that sees only the machine's packages
    and the pinned ones, less ``leave_out``."""
    from pathlib import Path

    left = {canonicalize_name(n) for n in leave_out}
    allowed = set(machine_closure(python)) | {"autoshard"}
    allowed |= {canonicalize_name(p.split("==")[0]) for p in pins(python)} - left
    modules = metadata.packages_distributions()
    hidden_dists = {
        canonicalize_name(d.metadata["Name"] or "") for d in metadata.distributions()
    } - allowed
    hidden_modules = sorted(
        m for m, dists in modules.items()
        if m not in sys.stdlib_module_names
        and all(canonicalize_name(d) in hidden_dists for d in dists)
    )  # fmt: skip
    argument = json.dumps([hidden_modules, sorted(hidden_dists)])
    here = str(Path(__file__).resolve().parent)
    command = [sys.executable, "-c", _AS_DEVICE, argument, here, json.dumps(list(only))]
    return subprocess.run(command,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="3.12", help="The GPU machine's Python version.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--pins", action="store_true", help="Print name==version of each wheel.")
    what.add_argument("--check", action="store_true", help="Import what gpu.sh's parts import.")
    what.add_argument("--as-device", action="store_true", help="--check as on the GPU machine.")
    parser.add_argument("--leave-out", action="append", default=[], help="With --as-device.")
    parser.add_argument(
        "--need", action="append", default=[], choices=list(NEEDS), help="Only these needs."
    )
    args = parser.parse_args()
    if args.pins:
        print("\n".join(pins(args.python)))
    elif args.check:
        failed = check(args.need)
        print("\n".join(failed) if failed else "device_wheels: every need imports")
        sys.exit(1 if failed else 0)
    else:
        done = as_device(args.leave_out, args.python, args.need)
        print((done.stdout + done.stderr).strip())
        sys.exit(done.returncode)


if __name__ == "__main__":
    main()
