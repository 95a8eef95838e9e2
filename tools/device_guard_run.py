"""Run any specrl command with the placement guard in every process it starts: `python tools/device_guard_run.py
[--raise] [--log DIR] -- specrl run CONFIG ...` (or `-- python ...`).

The guard (`tests/device_guard.py`) marks what a CUDA machine would put on the host and refuses ops that mix it
with the policy's tensors; `tools/device_guard_site/sitecustomize.py` installs it at the first `import torch` of
every Python process the command starts (the main process, spawned ranks, Ray's workers), through PYTHONPATH and
SPECRL_DEVICE_GUARD, which children inherit. By default each violation is recorded and the op runs on, so one run
lists every site; `--raise` makes the first one raise, as CUDA would. The runner prints one line per guarded process
kind and one per violating site (op, file:line, count), writes LOG/summary.json, and exits with the command's
status, or 3 when the command succeeded but the guard found violations, or 4 when no process imported torch under
the guard. `--device cuda` runs it on a real accelerator (there the device check is real; the guard adds the
host-allocation check and the sites). Nothing here is imported by the specrl package.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(__file__).resolve().parent / "device_guard_site"


def guarded_env(log: Path, mode: str = "record", device: str = "") -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["SPECRL_DEVICE_GUARD"] = str(log)
    env["SPECRL_DEVICE_GUARD_MODE"] = mode
    env["SPECRL_DEVICE_GUARD_DEVICE"] = device
    return env


def command_line(cmd: list[str]) -> list[str]:
    if not cmd:
        raise SystemExit("device_guard_run: give a command after --, e.g. -- specrl run examples/x.yaml")
    if cmd[0] == "specrl":
        return [sys.executable, "-m", "specrl.cli", *cmd[1:]]
    if cmd[0] in ("python", "python3"):
        return [sys.executable, *cmd[1:]]
    return cmd


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(log: Path, returncode: int) -> dict:
    procs = read_jsonl(log / "processes.jsonl")
    viol = read_jsonl(log / "violations.jsonl")
    sites = collections.Counter((v["msg"].split(":", 1)[0], v["site"]) for v in viol)
    kinds = collections.Counter(Path(p["argv"][0]).name if p["argv"] else "?" for p in procs)
    return {"returncode": returncode, "processes": len(procs), "process_kinds": dict(kinds),
            "violations": len(viol), "sites": [{"op": op, "site": site, "count": n}
                                               for (op, site), n in sites.most_common()]}


def run(cmd: list[str], log: Path, mode: str = "record", device: str = "", cwd: str | None = None,
        timeout: float | None = None) -> dict:
    log.mkdir(parents=True, exist_ok=True)
    for f in ("processes.jsonl", "violations.jsonl"):
        (log / f).unlink(missing_ok=True)
    proc = subprocess.run(command_line(cmd), env=guarded_env(log, mode, device), cwd=cwd, timeout=timeout)
    summary = summarize(log, proc.returncode)
    (log / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: tools/device_guard_run.py [--raise] [--log DIR] [--device cuda] -- specrl <command> ...",
              file=sys.stderr)
        return 2
    i = argv.index("--")
    ap = argparse.ArgumentParser(prog="device_guard_run.py")
    ap.add_argument("--raise", dest="raise_", action="store_true", help="the first violation raises")
    ap.add_argument("--log", default=None, help="where the guard's records go (default: a new temp directory)")
    ap.add_argument("--device", default="", help="a real accelerator (cuda) instead of the CPU's cpu:0 marker")
    a = ap.parse_args(argv[:i])
    if a.device and not a.device.startswith("cuda"):
        ap.error(f"--device must be cuda or cuda:N (got {a.device!r}); leave it out on a CPU machine")
    log = Path(a.log) if a.log else Path(tempfile.mkdtemp(prefix="device-guard-"))
    s = run(argv[i + 1:], log, "raise" if a.raise_ else "record", a.device)
    print(f"device guard: {s['processes']} guarded process(es) {s['process_kinds']}; {s['violations']} "
          f"violation(s) at {len(s['sites'])} site(s); command exit {s['returncode']}; records in {log}")
    for row in s["sites"]:
        print(f"  {row['count']:>6}  {row['op']:<40} {row['site']}")
    if s["returncode"]:
        return s["returncode"]
    if s["violations"]:
        return 3
    return 4 if not s["processes"] else 0


if __name__ == "__main__":
    sys.exit(main())
