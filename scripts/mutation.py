"""Mutation testing of one core module at a time (mutmut), in a time budget: see mutation.sh.

Each module runs in its own scratch copy of the working tree (``.mutation/<module>/``), so
runs of different modules never share mutmut's caches, and the tests run against the
module's own test files plus the quick tier (``-m "not slow"``). mutmut maps every test to the
functions it calls, so a mutant runs only the tests that reach it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# module -> its own test files (the ones that must catch its mistakes)
MODULES: dict[str, list[str]] = {
    "units": ["tests/test_units.py"],
    "space": ["tests/test_space.py", "tests/test_estimate.py", "tests/test_search.py"],
    "decide": ["tests/test_decide.py", "tests/test_measure.py", "tests/test_api.py"],
    "measure": ["tests/test_measure.py"],
    "sharding": ["tests/test_sharding.py", "tests/test_sharding_applied.py", "tests/test_emit.py"],
    "analyze": ["tests/test_analyze.py"],
    "plan": ["tests/test_plan.py", "tests/test_parity.py", "tests/target/test_resolve.py"],
    "target/step": ["tests/target/test_step.py"],
    "trials/worker": ["tests/trials/test_worker.py", "tests/trials/test_accounting.py"],
    "trials/protocol": ["tests/trials/test_protocol.py"],
    "trials/isolation": ["tests/trials/test_isolation.py"],
    "study/lessons": ["tests/study/test_lessons.py"],
    "study/causes": ["tests/study/test_causes.py"],
    "study/journal": ["tests/study/test_journal.py", "tests/study/test_storage.py"],
    "emit": [
        "tests/test_emit.py",
        "tests/test_handover.py",
        "tests/emit/test_formats.py",
        "tests/emit/test_text.py",
        "tests/emit/test_torchtitan.py",
        "tests/emit/test_prose.py",
    ],
    "predict/speed": ["tests/predict/test_speed.py", "tests/predict/test_calibrate.py"],
    "predict/optimizer_step": [
        "tests/predict/test_optimizer_step.py",
        "tests/predict/test_speed.py",
    ],
    "predict/host_bound": ["tests/predict/test_host_bound.py"],
    "predict/analytic": ["tests/predict/test_analytic.py", "tests/test_estimate.py"],
    "predict/step_memory": ["tests/predict/test_step_memory.py", "tests/predict/test_analytic.py"],
    "predict/timeline": ["tests/predict/test_timeline.py", "tests/predict/test_step_memory.py"],
    "child_env": ["tests/test_child_env.py"],
    "predict/attention_kernels": ["tests/predict/test_attention_kernels.py"],
}
# Where a module's job for this purpose is only part of it: trials/worker's result accounting
# (what a rank counts and how the ranks' reports become the trial's result, its status and its
# error). The rest of the worker runs inside the trial processes (building, timing, serving) and
# is covered by the slow tier, which a mutation run cannot afford.
ONLY_FUNCTIONS: dict[str, list[str]] = {
    "trials/worker": [
        "step_counts",
        "summarize",
        "_one_line",
        "agree",
        "published_failures",
        "failure_path",
        "target_shape",
    ],
}
STATUS = {1: "killed", 3: "killed", 0: "survived", 33: "no tests", 34: "skipped"}
STATUS |= {36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout"}
STATUS |= {37: "caught by type check", -11: "segfault", -9: "segfault"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/mutation.sh",
        description=(
            "Mutation-test core modules with mutmut, one module at a time, against the module's "
            "own test files and the quick tier (-m 'not slow'). Prints, per module, mutants, "
            "killed, survived and the kill rate (timeouts count as killed; 'no tests' are listed "
            "apart but count as not killed). Runs under nice -n 19 with one worker."
        ),
        epilog="modules: " + ", ".join(MODULES) + ". Example: scripts/mutation.sh units plan",
    )
    parser.add_argument("modules", nargs="+", metavar="MODULE", help="e.g. units, predict/speed")
    parser.add_argument(
        "--budget",
        type=float,
        default=1800,
        help="seconds per module (default 1800); mutants left when it is spent are 'not run'",
    )
    parser.add_argument(
        "--sample",
        type=int,
        default=0,
        help="test a random sample of N mutants per module (default: all)",
    )
    parser.add_argument("--seed", type=int, default=26, help="the sample's seed (default 26)")
    parser.add_argument(
        "--own-tests-only",
        action="store_true",
        help="run the module's own test files only, not the whole quick tier",
    )
    parser.add_argument(
        "--rerun",
        action="store_true",
        help="run the mutants the module's last run did not kill again, against the tests as "
        "they are now (after adding tests for its survivors)",
    )
    parser.add_argument(
        "--deselect",
        action="append",
        default=[],
        metavar="TEST",
        help="leave out this test (a pytest node id; repeatable), e.g. one that takes minutes "
        "under tracing: fewer tests can only kill fewer mutants, so the rate is a lower bound",
    )
    parser.add_argument(
        "--json", type=Path, help="also write the counts and the survivors' names to this file"
    )
    parser.add_argument(
        "--show",
        nargs="+",
        metavar="NAME",
        help="print these mutants' diffs from MODULE's last run (runs nothing)",
    )
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m.strip("/") not in MODULES]
    if unknown:
        parser.error(f"unknown module {unknown[0]!r}; choose from: {', '.join(MODULES)}")
    # a test file moved or renamed would make every mutant "no tests", not an error
    for module in args.modules:
        gone = [t for t in MODULES[module.strip("/")] if not (ROOT / t).is_file()]
        if gone:
            parser.error(
                f"{module}'s test file {gone[0]} does not exist: fix MODULES in {__file__}"
            )
    return args


def source_globs(module: str) -> list[str]:
    path = ROOT / "autoshard" / module
    if path.is_dir():
        return [f"autoshard/{module}/*.py"]
    return [f"autoshard/{module}.py"]


def scratch_copy(module: str) -> Path:
    """A fresh copy of the working tree (tracked and untracked, not ignored) for one module."""
    work = ROOT / ".mutation" / module.replace("/", "-")
    if work.exists():
        shutil.rmtree(work)
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if not src.is_file() or name.startswith(".venv"):
            continue
        dst = work / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    return work


def configure(work: Path, module: str, own_only: bool, deselect: list[str]) -> None:
    """Narrow the shared [tool.mutmut] settings to this module and its tests."""
    tests = list(MODULES[module]) + ([] if own_only else ["tests"])
    tests += [arg for test in deselect for arg in ("--deselect", test)]
    lines = [
        f"only_mutate = {json.dumps(source_globs(module))}",
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
    ]
    pyproject = work / "pyproject.toml"
    text = pyproject.read_text()
    text = text.replace("[tool.mutmut]\n", "[tool.mutmut]\n" + "\n".join(lines) + "\n")
    pyproject.write_text(text)


def mutmut(work: Path, args: list[str], timeout: float | None = None, log: bool = True) -> int:
    """Run mutmut in ``work`` (its output in ``work/mutmut.log``); 124 when out of time."""
    from autoshard.child_env import child_env  # torch's import: not for --help

    env = child_env(work / "mutants")
    # python -m, not the venv's mutmut script: a venv moved or shared keeps a stale shebang
    command = [sys.executable, "-m", "mutmut", *args]
    if not log:
        return subprocess.run(command, cwd=work, env=env).returncode
    with open(work / "mutmut.log", "a") as out:
        # its own session, so that the budget ends mutmut's workers too
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return 124


def generate(work: Path) -> list[str]:
    """Write the mutants (no tests run) and return their names."""
    code = (
        "from mutmut.__main__ import copy_src_dir, copy_also_copy_files, setup_source_paths, "
        "create_mutants\n"
        "import os; os.makedirs('mutants', exist_ok=True)\n"
        "copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants(1)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=work, check=True, stdout=subprocess.DEVNULL)
    return sorted(name for _, name, _ in results(work))


def results(work: Path) -> list[tuple[str, str, int | None]]:
    """(source file, mutant name, exit code or None when not run) of every mutant."""
    found = []
    pattern = str(work / "mutants" / "autoshard" / "**" / "*.py.meta")
    for meta in sorted(glob.glob(pattern, recursive=True)):
        data = json.loads(Path(meta).read_text())
        for name, code in data["exit_code_by_key"].items():
            found.append((meta, name, code))
    return found


def forget(work: Path, names: set[str]) -> None:
    """Clear these mutants' results in mutmut's files, so that they read as not run."""
    for meta, name, _ in results(work):
        if name in names:
            data = json.loads(Path(meta).read_text())
            data["exit_code_by_key"][name] = None
            Path(meta).write_text(json.dumps(data))


def mutated_function(name: str) -> str:
    # autoshard.units.x_parse_size__mutmut_3 -> parse_size; methods: xǁClassǁmethod__mutmut_3
    tail = name.rsplit(".", 1)[-1]
    return re.sub(r"__mutmut_\d+$", "", tail).removeprefix("x_").replace("ǁ", ".").strip(".")


def run_module(module: str, args: argparse.Namespace) -> dict[str, object]:
    start = time.monotonic()
    work = ROOT / ".mutation" / module.replace("/", "-")
    if args.rerun and (work / "chosen.json").exists():
        # the last run's mutants, against the tests as they are now: only those not yet killed
        names, chosen = json.loads((work / "chosen.json").read_text())
        for folder in (work / "tests", work / "mutants" / "tests"):
            shutil.rmtree(folder)
            shutil.copytree(ROOT / "tests", folder)
        (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)  # tests changed
        # the module's test files as MODULES names them now (a new own test file included)
        for folder in (work, work / "mutants"):
            shutil.copy2(ROOT / "pyproject.toml", folder / "pyproject.toml")
            configure(folder, module, args.own_tests_only, args.deselect)
        done = {name for _, name, code in results(work) if STATUS.get(code) == "killed"}
        todo = [n for n in chosen if n not in done]
        forget(work, set(todo))  # one the budget leaves unrun reads "not run", not its old result
    else:
        work = scratch_copy(module)
        configure(work, module, args.own_tests_only, args.deselect)
        names = generate(work)
        only = ONLY_FUNCTIONS.get(module)
        if only:
            names = [n for n in names if mutated_function(n).split(".")[-1] in only]
        chosen = names
        if args.sample and args.sample < len(names):
            chosen = sorted(random.Random(args.seed).sample(names, args.sample))
        (work / "chosen.json").write_text(json.dumps([names, chosen]))
        todo = chosen
    print(f"== {module}: {len(names)} mutants, testing {len(todo)} of {len(chosen)}", flush=True)
    left = args.budget - (time.monotonic() - start)
    code = mutmut(work, ["run", "--max-children", "1", *todo], timeout=max(60.0, left))
    timed_out = code == 124
    if code not in (0, 124):
        print(f"mutmut ended with exit code {code}: see {work / 'mutmut.log'}", flush=True)
    status = {
        name: STATUS.get(code, "not run" if code is None else "suspicious")
        for _, name, code in results(work)
    }
    counts = Counter(status[n] for n in chosen)
    killed = counts["killed"] + counts["timeout"] + counts["caught by type check"]
    survived = counts["survived"] + counts["suspicious"]
    # a mutant no test reaches is a mistake nobody would notice: it counts against the rate
    tested = killed + survived + counts["no tests"]
    rate = killed / tested if tested else 0.0
    report = {
        "module": module,
        "mutants": len(names),
        "sampled": len(chosen),
        "seed": args.seed if len(chosen) < len(names) else None,
        "deselected": args.deselect,
        "killed": killed,
        "survived": survived,
        "no_tests": counts["no tests"],
        "not_run": counts["not run"],
        "kill_rate": round(rate, 4),
        "budget_spent": timed_out,
        "mutmut_exit": code,
        "seconds": round(time.monotonic() - start),
        "survivors": sorted(n for n in chosen if status[n] in ("survived", "suspicious")),
        "no_test_mutants": sorted(n for n in chosen if status[n] == "no tests"),
        "work": str(work.relative_to(ROOT)),
    }
    return report


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.show:
        work = ROOT / ".mutation" / args.modules[0].strip("/").replace("/", "-")
        for name in args.show:
            mutmut(work, ["show", name], log=False)
        return 0
    reports = [run_module(m.strip("/"), args) for m in args.modules]
    print()
    print(
        f"{'module':18} {'mutants':>8} {'tested':>7} {'killed':>7} {'survived':>9} "
        f"{'no tests':>9} {'not run':>8} {'kill rate':>10}"
    )
    for r in reports:
        print(
            f"{r['module']:18} {r['mutants']:>8} {r['sampled']:>7} {r['killed']:>7} "
            f"{r['survived']:>9} {r['no_tests']:>9} {r['not_run']:>8} {r['kill_rate']:>10.1%}"
        )
    for r in reports:
        for kind in ("survivors", "no_test_mutants"):
            for name in r[kind]:  # type: ignore[attr-defined]
                print(f"{kind[:-1].replace('_', ' ')}: {name}")
    if any(r["survivors"] or r["no_test_mutants"] for r in reports):
        print("a mutant's diff: scripts/mutation.sh MODULE --show NAME (after its run)")
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
