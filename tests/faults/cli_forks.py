"""Run many `tandem` command lines cheaply, each in bounded memory and time: a helper of the params fuzz test.

`python tests/faults/cli_forks.py CASES.json` imports (and warms up) the CLI once, then runs each case (`{"name", "argv",
"env"}`) in a forked child under an address-space limit (RLIMIT_AS: the interpreter's size plus `--limit-mb`)
and a wall-clock limit, and prints one JSON list: per case its exit code, stdout, stderr, wall seconds and
peak resident memory (from `wait4`). A child that dies on a signal (killed at the time limit) reports
`-signal`. Linux only (fork, /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _vm_size_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _child(argv: list[str], env: dict[str, str], limit: int, out: int, err: int) -> None:
    """In the forked child: limit memory, redirect output, run the CLI, exit with its code (never returns)."""
    code = 1
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.update(env)
        from cli.main import app

        try:
            app(argv, prog_name="tandem")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # what an uncaught exception does to a real `tandem` process
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run_case(argv: list[str], env: dict[str, str], limit: int, timeout: float) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(argv, env, limit, out.fileno(), err.fileno())
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - t0 > timeout:
                os.kill(pid, signal.SIGKILL)
                _, status, usage = os.wait4(pid, 0)
                break
            time.sleep(0.005)
        wall = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        code = os.waitstatus_to_exitcode(status)
        return {"code": code, "stdout": out.read().decode("utf-8", "replace")[-20000:],
                "stderr": err.read().decode("utf-8", "replace")[-20000:], "seconds": round(wall, 3),
                "max_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", help="JSON file: a list of {name, argv, env}")
    ap.add_argument("--limit-mb", type=int, default=512, help="address space each case may add (MiB)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds before a case is killed")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import contextlib
    import io

    from cli.main import app

    # one refused call before forking, so every lazy import of the CLI's first call is done once, here
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            app(["check-params", str(REPO / "no-such-params-file.yaml")], prog_name="tandem")
        except SystemExit:
            pass

    limit = _vm_size_bytes() + a.limit_mb * 2**20
    results = {}
    for case in json.loads(Path(a.cases).read_text()):
        results[case["name"]] = run_case(case["argv"], case.get("env", {}), limit, a.timeout)
    print(json.dumps({"limit_mb": round(limit / 2**20), "results": results}))


if __name__ == "__main__":
    main()
