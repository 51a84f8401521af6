"""Run TRL's own trainer test files offline on CPU, with stock TRL and with the classes swapped for trl_longrm's.

What it measures: of the tests in TRL main's `tests/test_reward_trainer.py`, `tests/experimental/test_cpo_trainer.py`
and `tests/test_sft_trainer.py` that pass with the stock classes, how many still pass when `RewardTrainer`,
`CPOTrainer` and `SFTTrainer` (and their configs) are replaced by `SimPODisRMTrainer`, `SimPOGRMTrainer` and
`LongSFTTrainer`. Steps, all inside `--work-dir`:

1. Extract `tests/` and `scripts/` of TRL at `--trl-commit` from a TRL git checkout or bare mirror (`git archive`),
   and the toolcall dataset generator at `--toolcall-commit` (`git show`). Nothing of TRL's is stored in this repo.
2. Build the stand-ins of the Hub datasets and tiny models the tests load (`datasets_stand_ins.py`,
   `stand_ins.py`) under `<work-dir>/hubroot`, unless already built for the same commits, installed packages and
   builder code (`--rebuild` forces it).
3. Run each test file in each mode as its own pytest process, offline, from `<work-dir>/hubroot` (so that
   `trl-internal-testing/<name>` resolves to the local stand-in), with the plugins in `plugins/`.
4. Compare the junit reports, print the table and write it as JSON (`--out`).

    python bench/trl_suites/run.py                                  # everything, about 12 minutes on 2 CPU cores
    python bench/trl_suites/run.py --files reward cpo --modes ours  # reuses stock's earlier reports in work dir
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


HERE = Path(__file__).resolve().parent
PLUGINS = HERE / "plugins"
DEFAULT_TRL_REPO = Path("/work/.mirror/huggingface+trl/repo")
DEFAULT_TRL_COMMIT = "f2cd57710"
# The last revision whose generator writes `tools` as JSON strings, as the Hub copy the tests read still holds them
# (ac5421b4f switched the script to structured values).
DEFAULT_TOOLCALL_COMMIT = "ac5421b4f^"

SUITES = {
    "reward": ("tests/test_reward_trainer.py", "RewardTrainer -> SimPODisRMTrainer"),
    "cpo": ("tests/experimental/test_cpo_trainer.py", "CPOTrainer -> SimPOGRMTrainer"),
    "sft": ("tests/test_sft_trainer.py", "SFTTrainer -> LongSFTTrainer"),
}
# No .pytest_cache written into the work dir; -rA lists every outcome with its one-line reason in the log.
PYTEST_OPTIONS = ["-p", "no:cacheprovider", "-q", "-rA"]
MODE_PLUGINS = {"stock": ["trl_main_compat"], "ours": ["trl_main_compat", "swap_to_trl_longrm"]}
REPORTED_PACKAGES = ["trl", "transformers", "torch", "datasets", "peft", "accelerate", "tokenizers", "pytest"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def resolve_commit(repo: Path, revision: str) -> str:
    try:
        return git(repo, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"{repo}: no commit {revision!r}") from None


def extract_trl(repo: Path, commit: str, toolcall_commit: str, src: Path) -> Path:
    """Fresh `tests/` and `scripts/` at `commit` in `src`, and the toolcall generator at `toolcall_commit`."""
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(repo), "archive", commit, "tests", "scripts"], stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(src)], stdin=archive.stdout)
    archive.stdout.close()
    if archive.wait() != 0 or untar.returncode != 0:
        raise SystemExit(f"extracting tests/ and scripts/ of {commit} from {repo} failed")
    toolcall = src / "toolcall" / "generate_toolcall_dataset.py"
    toolcall.parent.mkdir()
    toolcall.write_text(git(repo, "show", f"{toolcall_commit}:scripts/generate_toolcall_dataset.py") + "\n")
    # Stop pytest's search for a config file here, so the test files run under pytest's defaults: TRL's
    # pyproject.toml is not extracted, and a stray pytest.ini or pyproject.toml above the work dir must not apply.
    (src / "pytest.ini").write_text("[pytest]\n")
    return toolcall


def suite_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        # One thread per run: the suites are pass/fail, not timed, and must not crowd a small CPU machine.
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        TOKENIZERS_PARALLELISM="false",
        # Offline: every model and dataset must come from the stand-ins, never from the network or a user cache.
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_DISABLED="true",
        HF_HOME=str(work / "hf_home"),
        HF_DATASETS_CACHE=str(work / "hf_datasets_cache"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")])),
    )
    return env


def run_logged(command: list[str], log: Path, cwd: Path, env: dict[str, str]) -> tuple[int, float]:
    print("+ " + shlex.join(command), flush=True)
    start = time.monotonic()
    with open(log, "w") as out:
        returncode = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    return returncode, time.monotonic() - start


def build_stand_ins(work: Path, src: Path, toolcall: Path, hub: Path, stamp: dict, env: dict, rebuild: bool) -> None:
    stamp_file = work / "stand_ins.json"
    if not rebuild and stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        print(f"stand-ins: already built in {hub} (--rebuild to rebuild)", flush=True)
        return
    if hub.exists():
        shutil.rmtree(hub)
    hub.mkdir(parents=True)
    stamp_file.unlink(missing_ok=True)
    steps = [
        ("datasets", [str(HERE / "datasets_stand_ins.py"), "--trl-src", str(src), "--toolcall-script", str(toolcall)]),
        ("models", [str(HERE / "stand_ins.py"), "--trl-src", str(src)]),
    ]
    for name, args in steps:
        log = work / f"build_{name}.log"
        returncode, seconds = run_logged([sys.executable, *args, "--hub", str(hub)], log, work, env)
        print(f"stand-ins: {name} rc={returncode} {seconds:.0f}s (log: {log})", flush=True)
        if returncode != 0:
            raise SystemExit(f"building the {name} stand-ins failed; see {log}")
    stamp_file.write_text(json.dumps(stamp, indent=1) + "\n")


# -- junit reports ---------------------------------------------------------------------------------------------------
def one_line(message: str, limit: int = 240) -> str:
    message = re.sub(r"\s+", " ", message).strip()
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _reason(element: ET.Element) -> str:
    text = element.get("message") or ""
    if not text and element.text and element.text.strip():
        text = element.text.strip().splitlines()[-1]
    return one_line(text)


# A test can have several outcomes in one report (a failed call and a teardown error): the first of these wins.
STATUS_PRIORITY = {"failure": "failed", "error": "error", "skipped": "skipped"}


def read_junit(path: Path) -> dict[str, tuple[str, str]] | None:
    """Test id (`Class::name`) -> (status, one-line reason), or None when there is no report."""
    if not path.exists():
        return None
    results: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{(case.get('classname') or '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = ("passed", "")
        for tag, status in STATUS_PRIORITY.items():
            element = case.find(tag)
            if element is not None:
                outcome = (status, _reason(element))
                break
        if test_id not in results or results[test_id][0] == "passed":
            results[test_id] = outcome
    return results


def counts(results: dict[str, tuple[str, str]] | None) -> dict[str, int]:
    tally: dict[str, int] = {}
    for status, _ in (results or {}).values():
        tally[status] = tally.get(status, 0) + 1
    return tally


def compare(name: str, results_dir: Path) -> dict:
    test_file, swapped = SUITES[name]
    stock = read_junit(results_dir / f"stock_{name}.xml")
    ours = read_junit(results_dir / f"ours_{name}.xml")
    summary = dict(
        test_file=test_file,
        swapped=swapped,
        collected=len(stock or ours or {}),
        stock=counts(stock),
        ours=counts(ours),
    )
    if stock is None or ours is None:
        summary["missing"] = [mode for mode, results in (("stock", stock), ("ours", ours)) if results is None]
        return summary
    passing = [test for test, (status, _) in stock.items() if status == "passed"]
    regressions = []
    for test in passing:
        status, reason = ours.get(test, ("not run", "absent from ours' report"))
        if status != "passed":
            regressions.append(dict(test=test, status=status, reason=reason))
    summary.update(
        stock_passed=len(passing),
        ours_passed_of_those=len(passing) - len(regressions),
        regressions=regressions,
        stock_not_passed={test: list(result) for test, result in stock.items() if result[0] != "passed"},
    )
    return summary


def print_table(files: dict[str, dict]) -> None:
    """A markdown table, one row per test file, then one line per regression."""
    print("\n| file | swapped | collected | stock passed | of those, ours passed | regressions |")
    print("|---|---|---:|---:|---:|---:|")
    for summary in files.values():
        row = f"| {summary['test_file']} | {summary['swapped']} | {summary['collected']} |"
        if "missing" in summary:
            print(f"{row} no report for {' and '.join(summary['missing'])} | | |")
            continue
        passed = summary["ours_passed_of_those"]
        print(f"{row} {summary['stock_passed']} | {passed} | {len(summary['regressions'])} |")
    regressions = [(s["test_file"], r) for s in files.values() for r in s.get("regressions", [])]
    if regressions:
        print("\nPass with stock, not with ours:")
    for test_file, regression in regressions:
        print(f"- {test_file}::{regression['test']} [{regression['status']}] {regression['reason']}")


def package_versions() -> dict[str, str]:
    versions = {}
    for package in REPORTED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--trl-repo",
        type=Path,
        default=DEFAULT_TRL_REPO if DEFAULT_TRL_REPO.exists() else None,
        help=f"TRL git checkout or bare mirror (default: {DEFAULT_TRL_REPO} if it exists)",
    )
    parser.add_argument("--trl-commit", default=DEFAULT_TRL_COMMIT, help="TRL revision of tests/ and scripts/")
    parser.add_argument(
        "--toolcall-commit",
        default=DEFAULT_TOOLCALL_COMMIT,
        help="revision of scripts/generate_toolcall_dataset.py (tools as JSON strings)",
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/trl_suites"))
    parser.add_argument("--files", nargs="+", choices=list(SUITES), default=list(SUITES))
    parser.add_argument("--modes", nargs="+", choices=list(MODE_PLUGINS), default=list(MODE_PLUGINS))
    parser.add_argument("--rebuild", action="store_true", help="rebuild the stand-ins even if already built")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. \"-k 'toolcall'\"")
    parser.add_argument("--out", type=Path, help="summary JSON (default: <work-dir>/summary.json)")
    args = parser.parse_args(argv)
    if args.trl_repo is None:
        parser.error(f"--trl-repo is required ({DEFAULT_TRL_REPO} does not exist)")

    started = time.monotonic()
    work = args.work_dir.resolve()
    src, hub, results_dir = work / "trl", work / "hubroot", work / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    repo = args.trl_repo.resolve()
    commit = resolve_commit(repo, args.trl_commit)
    toolcall_commit = resolve_commit(repo, args.toolcall_commit)
    toolcall = extract_trl(repo, commit, toolcall_commit, src)
    print(f"TRL {commit} (toolcall generator {toolcall_commit}) extracted from {repo} into {src}", flush=True)

    env = suite_env(work)
    versions = package_versions()
    # The stand-ins are rebuilt when any of these changes: the TRL revisions, the packages, the builders' code.
    builders = hashlib.sha256(b"".join((HERE / f).read_bytes() for f in ("stand_ins.py", "datasets_stand_ins.py")))
    stamp = dict(trl_commit=commit, toolcall_commit=toolcall_commit, packages=versions, builders=builders.hexdigest())
    build_stand_ins(work, src, toolcall, hub, stamp, env, args.rebuild)

    runs = []
    for name in args.files:
        for mode in args.modes:
            report = results_dir / f"{mode}_{name}.xml"
            report.unlink(missing_ok=True)
            plugins = [option for plugin in MODE_PLUGINS[mode] for option in ("-p", plugin)]
            options = [*plugins, *PYTEST_OPTIONS, f"--junitxml={report}", *shlex.split(args.pytest_args)]
            command = [sys.executable, "-m", "pytest", *options, str(src / SUITES[name][0])]
            returncode, seconds = run_logged(command, results_dir / f"{mode}_{name}.log", hub, env)
            tally = counts(read_junit(report))
            print(f"{mode:5} {name:6} rc={returncode} {seconds:.0f}s {tally}", flush=True)
            runs.append(dict(file=name, mode=mode, returncode=returncode, seconds=round(seconds, 1), counts=tally))

    files = {name: compare(name, results_dir) for name in args.files}
    print_table(files)
    wall = time.monotonic() - started
    out = args.out or work / "summary.json"
    summary = dict(
        trl_repo=str(repo),
        trl_commit=commit,
        toolcall_commit=toolcall_commit,
        packages=versions,
        work_dir=str(work),
        runs=runs,
        files=files,
        wall_seconds=round(wall, 1),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nwall time {wall:.0f}s; summary: {out}")
    # Regressions are the measurement, not an error; a run without a junit report (pytest crashed) is one.
    return 0 if all(run["counts"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
