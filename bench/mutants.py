"""Mutation testing: plant each bug of bench/mutant_list.py and check that its tests catch it.

    .venv/bin/python bench/mutants.py                      # every mutant -> bench/results/mutants.json
    .venv/bin/python bench/mutants.py --list               # names, files, bugs, targets
    .venv/bin/python bench/mutants.py --only NAME [NAME ...] --out /tmp/m.json
    .venv/bin/python bench/mutants.py --jobs 2             # two copies of the tree, two mutants at a time

The working tree is never modified. The repository's files (``git ls-files -co --exclude-standard``:
tracked, and untracked but not ignored) are copied once into a temporary folder, and a package view
of the copy (bench/pkg_view.py: links laid out as pyproject.toml's package-dir maps them) is put
first on ``PYTHONPATH``, with ``PYTHONSAFEPATH=1`` so that neither ``./mcompile`` nor the editable
install of the working tree is what the tests import; the runner checks once, before anything
else, that ``mcompile`` and its subpackages are imported from the copy. Bytecode is not written
(``PYTHONDONTWRITEBYTECODE``): a stale ``.pyc`` of a restored file can never be run.

Then:

1. baseline: every target of the selected mutants runs once on the unmutated copy (the node ids
   together in one pytest run, each ``-k`` target on its own). A target that fails there says
   nothing about a mutant ("baseline failed"); one whose file or test does not exist (yet), or that
   selects no test, is "target missing";
2. per mutant: its ``old`` snippet (exactly once in its file, else the runner stops before
   anything runs) is replaced by ``new`` in the copy, ``python -m pytest -x -q -p no:cacheprovider
   <targets>`` runs, and the file is restored.

Outcomes: ``caught`` (pytest exit 1, a test failed; or exit 2 with a collection error, which the
mutant caused since the baseline collected: ``caught_how`` says which), ``survived`` (exit 0: a
blind spot), ``timeout``, ``error`` (any other exit: usage error, internal error, interrupted),
``target missing`` and ``baseline failed`` (not run). The JSON report lists every mutant (name,
file, description, targets, outcome, caught_by: the first failing test's node id, seconds), the
totals, the survivors, the machine, the commit (and whether the tree was dirty), torch's version
and the total time.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import _results  # noqa: E402 - bench/_results.py: where the JSON goes (bench/ is the script's folder)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutant_list import MUTANTS, Mutant  # noqa: E402
from pkg_view import build_view  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
SUBPACKAGES = ("mcompile", "mcompile.passes", "mcompile.runtime", "mcompile.kernels", "mcompile.models")
CAUGHT, SURVIVED, ERROR, TIMEOUT, MISSING, BASELINE_FAILED = (
    "caught", "survived", "error", "timeout", "target missing", "baseline failed")
OUTCOMES = (CAUGHT, SURVIVED, ERROR, TIMEOUT, MISSING, BASELINE_FAILED)


class MutantError(RuntimeError):
    """A mutant that cannot be applied (its snippet moved, doubled or vanished): fix bench/mutant_list.py."""


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """One entry of a mutant's targets: a node id or a file (``path``), optionally with ``-k``."""

    text: str
    path: str  # file part, relative to the root
    node: str  # the whole node id / file argument
    keyword: str | None

    @staticmethod
    def parse(text: str) -> Target:
        parts = shlex.split(text)
        keyword = None
        if len(parts) == 3 and parts[1] == "-k":
            keyword = parts[2]
        elif len(parts) != 1:
            raise MutantError(f"target {text!r}: write a node id or 'path -k expression'")
        return Target(text, parts[0].split("::")[0], parts[0], keyword)

    def pytest_args(self) -> list[str]:
        return [self.node] + (["-k", self.keyword] if self.keyword else [])

    def missing_reason(self, root: Path) -> str | None:
        """Why this target cannot exist in the tree at ``root`` (None: it may)."""
        f = root / self.path
        if not f.is_file():
            return f"target missing: {self.path} does not exist"
        if "::" in self.node:
            func = self.node.split("::")[-1].split("[")[0]
            if func not in _test_names(f):
                return f"target missing: {self.path} defines no {func}"
        return None

    def selects(self, nodeid: str) -> bool:
        return nodeid == self.node or nodeid.startswith(self.node + ("[" if "::" in self.node else "::"))


def _test_names(path: Path) -> set[str]:
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        return set()  # the baseline's collection error says more
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}


def check_mutant(m: Mutant, root: Path) -> str:
    """The text of ``m.file`` at ``root``; raises MutantError unless ``m.old`` occurs exactly once."""
    f = root / m.file
    if not f.is_file():
        raise MutantError(f"mutant {m.name}: {m.file} does not exist")
    text = f.read_text()
    n = text.count(m.old)
    if n != 1:
        raise MutantError(f"mutant {m.name}: its old snippet occurs {n} times in {m.file} (must be exactly once); "
                          f"update it in bench/mutant_list.py:\n{m.old}")
    if m.old == m.new:
        raise MutantError(f"mutant {m.name}: new is old")
    for t in m.targets:
        Target.parse(t)
    return text


# --------------------------------------------------------------------------- the copy and pytest runs


def tree_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                         capture_output=True).stdout.decode()
    return [f for f in out.split("\0") if f]


def commit_info(root: Path) -> dict:
    def git(*args):
        return subprocess.run(["git", "--no-optional-locks", *args], cwd=root, capture_output=True,
                              text=True).stdout.strip()

    return {"head": git("rev-parse", "HEAD") or "unknown", "dirty": bool(git("status", "--porcelain"))}


@dataclass
class PytestRun:
    exit_code: int | None  # None: timed out
    seconds: float
    output: str

    def failed_nodeids(self) -> list[str]:
        """Node ids of the FAILED / ERROR lines of the short summary, in order."""
        out = []
        for line in self.output.splitlines():
            m = re.match(r"^(FAILED|ERROR) (\S+)", line)
            if m and m.group(2) not in out:
                out.append(m.group(2))
        return out

    def passed_nodeids(self) -> set[str]:
        return {m.group(1) for m in re.finditer(r"^PASSED (\S+)", self.output, re.M)}

    def not_found(self) -> list[str]:
        return re.findall(r"ERROR: not found: (\S+)", self.output)

    def collection_error(self) -> bool:
        return bool(re.search(r"errors? during collection", self.output))

    def tail(self, n: int = 2000) -> str:
        return self.output[-n:]


class Workspace:
    """A copy of the tree and its package view; mutants are applied to the copy only."""

    def __init__(self, root: Path, tmp: Path):
        self.root = tmp / "tree"
        for rel in tree_files(root):
            src = root / rel
            if not (src.is_file() or src.is_symlink()):
                continue  # deleted in the working tree, or a submodule
            dst = self.root / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)
        self.view = tmp / "view"
        build_view(self.root, self.view)
        self.env = dict(os.environ)
        self.env.update(PYTHONPATH=str(self.view), PYTHONSAFEPATH="1", PYTHONDONTWRITEBYTECODE="1")
        self.env.pop("PYTEST_ADDOPTS", None)
        self.proc: subprocess.Popen | None = None  # the pytest run in progress

    def imports(self) -> dict:
        """Where the package and torch are imported from, as the tests will import them."""
        code = ("import json, os, torch, importlib\n"
                f"mods = {list(SUBPACKAGES)!r}\n"
                "print(json.dumps({'torch': torch.__version__, 'files': {m: os.path.realpath("
                "importlib.import_module(m).__file__) for m in mods}}))")
        out = subprocess.run([sys.executable, "-c", code], cwd=self.root, env=self.env, capture_output=True,
                             text=True, timeout=300)
        if out.returncode:
            raise RuntimeError(f"importing mcompile from the copy failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def pytest(self, args: list[str], timeout: float) -> PytestRun:
        start = time.perf_counter()
        with tempfile.TemporaryFile("w+") as log:
            proc = subprocess.Popen([sys.executable, *PYTEST, *args], cwd=self.root, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            self.proc = proc
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
                _kill_group(proc)
            finally:  # interrupted (KeyboardInterrupt) or done: no worker of the run left behind
                _kill_group(proc)
                self.proc = None
            log.seek(0)
            output = log.read()
        return PytestRun(code, time.perf_counter() - start, output)


def _kill_group(proc: subprocess.Popen) -> None:
    """End what is left of a pytest run we started (its own process group: pytest and its workers):
    TERM, then KILL what is still there 15 s later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            proc.poll()  # reap pytest itself: a zombie still counts as a member of the group
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
    proc.poll()


# --------------------------------------------------------------------------- baseline


@dataclass
class TargetStatus:
    status: str  # "pass" | "fail" | "missing"
    detail: str = ""


def baseline(ws: Workspace, targets: list[Target], timeout: float, log) -> tuple[dict[str, TargetStatus], float]:
    """Run every target once on the unmutated copy: node ids together, each ``-k`` target alone."""
    start = time.perf_counter()
    status: dict[str, TargetStatus] = {}
    for t in targets:
        reason = t.missing_reason(ws.root)
        if reason:
            status[t.text] = TargetStatus("missing", reason)
    nodes = [t for t in targets if t.text not in status and not t.keyword]
    while nodes:
        args = list(dict.fromkeys(t.node for t in nodes))
        log(f"baseline: {len(args)} node ids in one run")
        run = ws.pytest(["-rA", "--continue-on-collection-errors", *args], timeout)
        gone = set(run.not_found())
        if run.exit_code == 4 and gone:  # an id that does not exist stops the whole run: drop it, again
            for t in nodes:
                if any(g.endswith(t.node) for g in gone):
                    status[t.text] = TargetStatus("missing", f"target missing: pytest finds no {t.node}")
            nodes = [t for t in nodes if t.text not in status]
            continue
        passed, failed = run.passed_nodeids(), run.failed_nodeids()
        for t in nodes:
            bad = [n for n in failed if t.selects(n) or n == t.path]
            good = [n for n in passed if t.selects(n)]
            if run.exit_code is None:
                status[t.text] = TargetStatus("fail", f"the baseline run timed out after {timeout:.0f} s")
            elif bad:
                status[t.text] = TargetStatus("fail", "fails unmutated: " + ", ".join(bad[:3]))
            elif good:
                status[t.text] = TargetStatus("pass", f"{len(good)} test(s)")
            else:
                status[t.text] = TargetStatus("missing", "target missing: it selects no test")
        if run.exit_code not in (0, 1, 2, None) and not any(s.status == "pass" for s in status.values()):
            log(f"baseline pytest exited {run.exit_code}:\n{run.tail()}")
        break
    for t in targets:
        if t.text in status:
            continue
        log(f"baseline: {t.text}")
        run = ws.pytest(t.pytest_args(), timeout)
        if run.exit_code == 0:
            status[t.text] = TargetStatus("pass")
        elif run.exit_code == 5:
            status[t.text] = TargetStatus("missing", "target missing: it selects no test")
        elif run.exit_code is None:
            status[t.text] = TargetStatus("fail", f"the baseline run timed out after {timeout:.0f} s")
        else:
            status[t.text] = TargetStatus("fail", f"fails unmutated (exit {run.exit_code}): "
                                                  + ", ".join(run.failed_nodeids()[:3]))
    return status, time.perf_counter() - start


# --------------------------------------------------------------------------- one mutant


@dataclass
class Result:
    name: str
    file: str
    description: str
    targets: list[str]
    outcome: str
    caught_by: str | None = None
    caught_how: str | None = None
    exit_code: int | None = None
    seconds: float = 0.0
    missing_targets: list[str] = field(default_factory=list)
    baseline_failed_targets: list[str] = field(default_factory=list)
    detail: str = ""


def run_mutant(ws: Workspace, m: Mutant, status: dict[str, TargetStatus], timeout: float | None) -> Result:
    targets = [Target.parse(t) for t in m.targets]
    res = Result(m.name, m.file, m.description, list(m.targets), SURVIVED)
    res.missing_targets = [t.text for t in targets if status[t.text].status == "missing"]
    res.baseline_failed_targets = [t.text for t in targets if status[t.text].status == "fail"]
    live = [t for t in targets if status[t.text].status == "pass"]
    if not live:
        res.outcome = BASELINE_FAILED if res.baseline_failed_targets else MISSING
        res.detail = "; ".join(f"{t.text}: {status[t.text].detail}" for t in targets)
        return res
    path = ws.root / m.file
    original = check_mutant(m, ws.root)
    runs = [[a for t in live if not t.keyword for a in t.pytest_args()]] + [t.pytest_args() for t in live if t.keyword]
    start = time.perf_counter()
    try:
        path.write_text(original.replace(m.old, m.new, 1))
        for args in (r for r in runs if r):
            run = ws.pytest(["-x", *args], timeout or m.timeout)
            res.exit_code = run.exit_code
            if run.exit_code == 0:
                continue
            if run.exit_code is None:
                res.outcome, res.detail = TIMEOUT, f"no result within {timeout or m.timeout:.0f} s: {' '.join(args)}"
            elif run.exit_code == 1:
                res.outcome, res.caught_how = CAUGHT, "a test failed"
            elif run.exit_code == 2 and run.collection_error():
                res.outcome = CAUGHT
                res.caught_how = "collection error (the unmutated targets collected: the mutant broke the import)"
            else:
                res.outcome, res.detail = ERROR, f"pytest exited {run.exit_code}:\n{run.tail()}"
            failed = run.failed_nodeids()
            res.caught_by = failed[0] if failed and res.outcome == CAUGHT else None
            break
    finally:
        path.write_text(original)
    if path.read_text() != original:
        raise RuntimeError(f"{path} was not restored")
    res.seconds = round(time.perf_counter() - start, 1)
    return res


# --------------------------------------------------------------------------- main


def _select(only: list[str] | None) -> list[Mutant]:
    if not only:
        return list(MUTANTS)
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in only if n not in known]
    if unknown:
        raise SystemExit(f"unknown mutant(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in only]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at a time, each in its own copy (default 1)")
    _results.add_arguments(ap, "mutants")  # neither: the report goes to a temporary file, named at the end
    ap.add_argument("--timeout", type=float, default=None, help="seconds per mutant (default: each mutant's own)")
    ap.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)  # the tree to copy (tests)
    args = ap.parse_args(argv)
    mutants = _select(args.only)
    if args.list:
        for m in mutants:
            print(f"{m.name}\n    {m.file}: {m.description}\n    targets: {'; '.join(m.targets)}")
        print(f"{len(mutants)} mutants")
        return 0
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs}: use 1 or more")
    root = Path(args.root).resolve()
    t0 = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lock = threading.Lock()

    def log(msg: str) -> None:
        with lock:
            print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)

    try:
        for m in mutants:  # before anything runs: every snippet exactly once in the tree
            check_mutant(m, root)
    except MutantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    commit = commit_info(root)
    tmp = Path(tempfile.mkdtemp(prefix="mcompile-mutants-"))
    try:
        spaces = [Workspace(root, tmp / f"w{i}") for i in range(args.jobs)]
        for ws in reversed(spaces):  # once per copy, before anything runs
            imports = ws.imports()
            copy = os.path.realpath(ws.root)
            wrong = {m: f for m, f in imports["files"].items() if not f.startswith(copy + os.sep)}
            if wrong:  # the editable install or ./mcompile shadowing the view would test the working tree
                raise RuntimeError(f"the copy is not what gets imported: {wrong} (expected under {copy})")
        log(f"copy of {root} in {tmp}; mcompile imported from {imports['files']['mcompile']}")
        targets = list({t: Target.parse(t) for m in mutants for t in m.targets}.values())
        status, base_s = baseline(spaces[0], targets, 1800.0, log)
        for t in targets:
            log(f"baseline {status[t.text].status:7} {t.text} {status[t.text].detail}")
        work: queue.Queue = queue.Queue()
        for i, m in enumerate(mutants):
            work.put((i, m))
        results: list[Result | None] = [None] * len(mutants)
        failures: list[BaseException] = []

        def worker(ws: Workspace) -> None:
            while not failures:
                try:
                    i, m = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    r = run_mutant(ws, m, status, args.timeout)
                except BaseException as e:  # noqa: BLE001 - reported after the other workers stop
                    failures.append(e)
                    return
                results[i] = r
                log(f"{r.outcome:15} {r.name} ({r.seconds:.0f} s){' by ' + r.caught_by if r.caught_by else ''}")

        threads = [threading.Thread(target=worker, args=(ws,)) for ws in spaces]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if failures:
            raise failures[0]
    finally:
        for ws in locals().get("spaces", []):  # interrupted: end the runs in flight before removing the copies
            if ws.proc is not None and ws.proc.poll() is None:
                _kill_group(ws.proc)
        shutil.rmtree(tmp, ignore_errors=True)
    done = [r for r in results if r is not None]
    totals = {o: sum(r.outcome == o for r in done) for o in OUTCOMES}
    judged = totals[CAUGHT] + totals[SURVIVED]
    report = {
        "schema": 1,
        "started": started,
        "command": shlex.join(["python", "bench/mutants.py", *(argv if argv is not None else sys.argv[1:])]),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count()},
        "commit": commit,
        "torch": imports["torch"],
        "jobs": args.jobs,
        "imported_from_copy": {m: os.path.relpath(f, copy) for m, f in imports["files"].items()},
        "baseline": {"seconds": round(base_s, 1),
                     "targets": {t: {"status": s.status, "detail": s.detail} for t, s in status.items()}},
        "totals": {"mutants": len(done), **totals,
                   "caught_of_run": f"{totals[CAUGHT]}/{judged}" if judged else "0/0"},
        "survivors": [r.name for r in done if r.outcome == SURVIVED],
        "mutants": [r.__dict__ for r in done],
    }
    out = _results.destination("mutants", args.write, args.out, temporary=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    log(f"{len(done)} mutants: " + ", ".join(f"{v} {k}" for k, v in totals.items() if v)
        + f"; report {out}")
    for r in done:
        if r.outcome == SURVIVED:
            log(f"SURVIVED {r.name}: {r.description} [{'; '.join(r.targets)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
