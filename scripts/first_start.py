"""Time `make serve` on a fresh clone: install, server start to /health, to the first answer;
then a warm restart (same venv and caches) to its first answer.

The clone goes into a temporary folder (removed after, unless --keep-clone) and gets its own
fresh .venv. `--caches fresh` points modserve's caches (C++ kernels, the demo model, test
checkpoints) and inductor's at empty folders of their own, the state of a machine that never
ran modserve, without deleting anyone's files; `--caches clear` deletes the real ones
(~/.cache/modserve's kernels, demo and checkpoints, /tmp/torchinductor_$USER) first.
`--package-cache fresh` does the same for uv's and pip's download caches.

    .venv/bin/python scripts/first_start.py --caches fresh          # a new machine, packages cached
    .venv/bin/python scripts/first_start.py                         # the caches as they are
    .venv/bin/python scripts/first_start.py --ref 7da2ae0 --caches fresh   # an older commit

Prints a table and writes --json (default build/first-start.json). Without the openai
client importable, the completion goes through urllib.
"""

from __future__ import annotations

import argparse
import datetime
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "modserve-demo"
# What the server's log says at the start and end of each phase (timed here on arrival).
KERNEL_BUILD = re.compile(r"building C\+\+ kernel (\S+)")
KERNEL_LOADED = re.compile(r"C\+\+ kernel (\S+) loaded in ([\d.]+) s")
WARM_UP = re.compile(r"compile: warm-up took ([\d.]+) s")
SERVING = re.compile(r"modserve is serving")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clone(repo: Path, ref: str | None, changes: list[str] | None, into: Path) -> str:
    subprocess.run(["git", "clone", "-q", str(repo), str(into)], check=True)
    if ref:
        subprocess.run(["git", "-C", str(into), "checkout", "-q", ref], check=True)
    if changes is not None:  # the checkout's uncommitted edits and new (not ignored) files, under changes
        paths = ["--", *changes] if changes else []
        diff = subprocess.run(["git", "-C", str(repo), "diff", "HEAD", "--binary", *paths], check=True,
                              capture_output=True).stdout
        if diff:
            subprocess.run(["git", "-C", str(into), "apply", "--whitespace=nowarn"], input=diff, check=True)
        new = subprocess.run(["git", "-C", str(repo), "ls-files", "--others", "--exclude-standard", "-z", *paths],
                             check=True, capture_output=True, text=True).stdout.split("\0")
        for name in filter(None, new):
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / name, into / name)
    commit = subprocess.run(["git", "-C", str(into), "rev-parse", "--short", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    return commit if changes is None else f"{commit} + uncommitted changes ({' '.join(changes) or 'all'})"


def cache_env(caches: str, package_cache: str, scratch: Path) -> dict[str, str]:
    """The environment `make serve` runs in, for the cache modes (see the module docstring)."""
    env = dict(os.environ)
    home_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    if caches == "clear":
        for folder in (home_cache / "modserve" / "kernels", home_cache / "modserve" / "demo",
                       home_cache / "modserve" / "checkpoints", Path(tempfile.gettempdir()) /
                       f"torchinductor_{getpass.getuser()}"):
            shutil.rmtree(folder, ignore_errors=True)
    if caches == "fresh":
        # XDG_CACHE_HOME moves platformdirs' folder (the demo model) and everything else under
        # ~/.cache, so the package caches are pointed back at the user's unless asked otherwise.
        env["XDG_CACHE_HOME"] = str(scratch / "xdg")
        env["MODSERVE_CACHE"] = str(scratch / "xdg" / "modserve")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "torchinductor")
        env.pop("MODSERVE_TEST_CACHE", None)
        if package_cache == "keep":
            env.setdefault("UV_CACHE_DIR", str(home_cache / "uv"))
            env.setdefault("PIP_CACHE_DIR", str(home_cache / "pip"))
    if package_cache == "fresh":
        env["UV_CACHE_DIR"] = str(scratch / "uv-cache")
        env["PIP_CACHE_DIR"] = str(scratch / "pip-cache")
    return env


class Start:
    """One `make serve`: its output lines timed on arrival, echoed with the elapsed time."""

    def __init__(self, label: str, cwd: Path, port: int, make_vars: list[str], env: dict[str, str],
                 quiet: bool) -> None:
        self.label, self.quiet = label, quiet
        self.lines: list[tuple[float, str]] = []
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(["make", "serve", f"ARGS=--port {port}", *make_vars], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     start_new_session=True)  # its own group: SIGTERM reaches make's child
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            t, line = self.elapsed(), line.rstrip("\n")
            self.lines.append((t, line))
            if not self.quiet or any(p.search(line) for p in (KERNEL_BUILD, KERNEL_LOADED, WARM_UP, SERVING)):
                print(f"  [{self.label} {t:6.1f} s] {line}", flush=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.reader.join(5)

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def complete(base: str, prompt: str, max_tokens: int) -> str:
    """One greedy completion, through the official client where it is importable."""
    try:
        import openai
    except ImportError:
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.load(r)["choices"][0]["text"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


def phases(lines: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds of each logged phase: each kernel's build, the warm-up."""
    out: dict[str, float] = {}
    for t, line in lines:
        if m := KERNEL_LOADED.search(line):
            out[f"kernel {m.group(1)}"] = float(m.group(2))
        if m := WARM_UP.search(line):
            out["compile warm-up"] = float(m.group(1))
    return out


def measure(label: str, cwd: Path, port: int, make_vars: list[str], env: dict[str, str], args) -> dict:
    base = f"http://127.0.0.1:{port}"
    stamp = cwd / ".venv" / ".installed"
    installed_before = stamp.exists()
    print(f"{label}: make serve in {cwd} (port {port})", flush=True)
    start = Start(label, cwd, port, make_vars, env, args.quiet)
    result: dict = {"label": label}
    last_note = 0.0
    try:
        while not healthy(base):
            if start.proc.poll() is not None:
                raise RuntimeError(f"make serve exited with {start.proc.returncode}:\n{start.tail()}")
            if start.elapsed() > args.timeout:
                raise TimeoutError(f"no /health within {args.timeout:.0f} s:\n{start.tail()}")
            if "install_s" not in result and stamp.exists() and not installed_before:
                result["install_s"] = round(start.elapsed(), 1)
            quiet_for = start.elapsed() - (start.lines[-1][0] if start.lines else 0.0)
            if quiet_for > 20 and start.elapsed() - last_note > 20:
                last_note = start.elapsed()
                print(f"  [{label} {last_note:6.1f} s] ... waiting for /health (no output for {quiet_for:.0f} s)",
                      flush=True)
            time.sleep(0.25)
        result["health_s"] = round(start.elapsed(), 1)
        result["answer"] = complete(base, args.prompt, args.max_tokens)
        result["first_answer_s"] = round(start.elapsed(), 1)
        print(f"  [{label} {result['first_answer_s']:6.1f} s] first answer: {result['answer']!r}", flush=True)
    finally:
        start.stop()
    result.setdefault("install_s", 0.0)
    # The server's own start: from the install's end (make goes straight on to `modserve serve`).
    result["server_to_health_s"] = round(result["health_s"] - result["install_s"], 1)
    result["phases"] = phases(start.lines)
    result["log"] = [f"{t:.1f} {line}" for t, line in start.lines]
    return result


def forget_kernels(scratch: Path, env: dict[str, str]) -> None:
    """Delete the kernel builds made for the clone's venv: a folder per venv (see
    modserve/api/cpp.py), of no use once the clone is gone."""
    root = Path(env.get("MODSERVE_CACHE", Path.home() / ".cache" / "modserve")) / "kernels"
    for ninja in root.glob("*/build.ninja"):
        if str(scratch) in ninja.read_text(errors="replace"):
            shutil.rmtree(ninja.parent, ignore_errors=True)


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"


def table(runs: list[dict]) -> str:
    rows = [("install (uv or pip, fresh venv)", "install_s"), ("server start -> /health", "server_to_health_s"),
            ("make serve -> /health", "health_s"), ("make serve -> first answer", "first_answer_s")]
    head = "| phase | " + " | ".join(r["label"] for r in runs) + " |"
    lines = [head, "|---" * (len(runs) + 1) + "|"]
    for name, key in rows:
        lines.append(f"| {name} | " + " | ".join(f"{r[key]:.1f} s" for r in runs) + " |")
    names = sorted({k for r in runs for k in r["phases"]})
    for name in names:
        lines.append(f"| of which: {name} | " + " | ".join(
            f"{r['phases'][name]:.1f} s" if name in r["phases"] else "-" for r in runs) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=ROOT, help="the checkout to clone (default: this one)")
    ap.add_argument("--ref", help="commit to check out in the clone (default: the checkout's HEAD)")
    ap.add_argument("--with-changes", nargs="*", metavar="PATH",
                    help="apply the checkout's uncommitted changes and new files to the clone (only under "
                         "the PATHs given, if any)")
    ap.add_argument("--caches", choices=("keep", "fresh", "clear"), default="keep",
                    help="modserve's and inductor's caches: as they are, empty folders of the run's own, "
                         "or the real ones deleted first")
    ap.add_argument("--package-cache", choices=("keep", "fresh"), default="keep",
                    help="uv's and pip's download caches: the user's, or empty ones")
    ap.add_argument("--make-var", action="append", default=[], metavar="NAME=VALUE",
                    help="passed to make, e.g. INSTALLER=pip")
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument("--prompt", default="Hello")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=900, help="seconds each start may take to /health")
    ap.add_argument("--json", type=Path, default=Path("build/first-start.json"))
    ap.add_argument("--keep-clone", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="echo only the phase lines, not all of make's output")
    args = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="modserve-first-start-"))
    work = scratch / "modserve"
    env = cache_env(args.caches, args.package_cache, scratch)
    info = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "load_before": load(),
            "caches": args.caches, "package_cache": args.package_cache, "make_vars": args.make_var}
    runs = []
    try:
        t = time.monotonic()
        info["commit"] = clone(args.repo.resolve(), args.ref, args.with_changes, work)
        info["clone_s"] = round(time.monotonic() - t, 1)
        port = args.port or free_port()
        runs.append(measure("fresh clone", work, port, args.make_var, env, args))
        runs.append(measure("warm restart", work, args.port or free_port(), args.make_var, env, args))
    finally:
        forget_kernels(scratch, env)
        if not args.keep_clone:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(f"clone kept in {work}")
    info["load_after"] = load()
    info["same_answer"] = runs[0]["answer"] == runs[1]["answer"]
    print(f"\n{info['date']}, {info['cpus']} CPUs, load {info['load_before']} -> {info['load_after']}, commit "
          f"{info['commit']}, caches {args.caches}, package cache {args.package_cache}\n")
    print(table(runs))
    print(f"\nsame greedy answer on both starts: {info['same_answer']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**info, "runs": runs}, indent=2) + "\n")
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
