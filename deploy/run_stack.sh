#!/usr/bin/env bash
# Run the docker-compose stack without Docker: the exact commands of docker-compose.yml's
# services, as processes on this machine, against a private redis-server.
#
#   deploy/run_stack.sh                  # 3 producers, the trainer, the exporter
#   deploy/run_stack.sh --producers 5
#   BATCHQ_EPOCHS=2 TUTORIAL_LOAD_MS=25 deploy/run_stack.sh
#
# It reads docker-compose.yml, so it runs what the stack runs: the `redis` service's
# redis-server arguments (on a free loopback port, never 6379), N replicas of `producer`,
# `trainer` and `exporter` (on 127.0.0.1 here; skipped, with a note, where `batchq
# exporter` does not exist), each with its service's environment, compose defaults filled in from yours, like
# `docker compose up` does. Output is prefixed with the service's name. It ends when the
# trainer has finished its epochs and the producers have exited, and exits 0 only if the
# trainer and every producer did. Ctrl-C stops everything.
#
# Needs the project's venv (`make demo` or `make test` creates it; or set PYTHON) and
# a YAML parser there (ruamel.yaml comes with the test extra; PyYAML works too).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
cd "$ROOT"
export BATCHQ_STACK_ROOT="$ROOT"
exec "$PYTHON" - "$@" <<'PY'
"""The body of deploy/run_stack.sh (see its header)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from batchq.host.embedded import EmbeddedRedis
from batchq.host.procs import spawn, stop_group

ROOT = Path(os.environ["BATCHQ_STACK_ROOT"])
_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def load_compose() -> dict[str, Any]:
    text = (ROOT / "docker-compose.yml").read_text()
    try:
        from ruamel.yaml import YAML
    except ImportError:
        try:
            import yaml
        except ImportError:
            sys.exit("run_stack.sh: needs ruamel.yaml or PyYAML: pip install ruamel.yaml")
        return yaml.safe_load(text)
    return YAML(typ="safe").load(text)


def interpolate(value: Any, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error} and $$."""

    def sub(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        name, op, arg = m[1] or m[4], m[2], m[3] or ""
        have = env.get(name)
        if op in (":-", ":?") and not have or op in ("-", "?") and have is None:
            if op.endswith("?"):
                sys.exit(f"run_stack.sh: {name} must be set: {arg}")
            return arg
        return have or ""

    return _VAR.sub(sub, str(value))


class Service:
    """One process of the stack, its output prefixed with its name."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], width: int) -> None:
        self.name = name
        self.proc = spawn(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.thread = threading.Thread(target=self._echo, args=(width,), daemon=True)
        self.thread.start()

    def _echo(self, width: int) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, b""):
            text = line.decode(errors="replace").rstrip()
            print(f"{self.name:<{width}} | {text}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="deploy/run_stack.sh", description=__doc__)
    parser.add_argument(
        "--producers", type=int, default=int(os.environ.get("PRODUCERS", "3")),
        help="producer replicas (default $PRODUCERS, else 3)",
    )
    parser.add_argument(
        "--exporter-port", type=int, default=None,
        help="replace the exporter's --port (default: the compose file's)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=600.0, help="give up on the trainer after this long"
    )
    args = parser.parse_args()
    if args.producers < 1:
        parser.error(f"--producers {args.producers!r} is not valid: expected >= 1")
    services = load_compose()["services"]
    user_env = dict(os.environ)

    def command(name: str) -> list[str]:
        argv = [interpolate(a, user_env) for a in services[name]["command"]]
        if argv[0] == "batchq":  # the image's console script: this venv's
            script = shutil.which("batchq", path=os.path.dirname(sys.executable))
            argv[:1] = [script] if script else [sys.executable, "-m", "batchq.cli"]
        elif argv[0] == "python":
            argv[0] = sys.executable
        return argv

    redis_args = [interpolate(a, user_env) for a in services["redis"]["command"][1:]]
    with EmbeddedRedis(extra_args=redis_args) as server:
        print(f"run_stack: redis-server at {server.url} with {' '.join(redis_args)}", flush=True)

        def env(name: str) -> dict[str, str]:
            out = dict(user_env)
            for key, value in (services[name].get("environment") or {}).items():
                out[key] = interpolate(value, user_env)
            out["BATCHQ_URL"] = server.url  # redis://redis:6379/0 in the stack
            out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), out.get("PYTHONPATH")]))
            return out

        probe = [sys.executable, "-m", "batchq.cli", "exporter", "--help"]
        has_exporter = subprocess.run(probe, capture_output=True, check=False).returncode == 0
        width = len(f"producer-{args.producers}")
        started: list[Service] = []
        try:
            producers = [
                Service(f"producer-{i}", command("producer"), env("producer"), width)
                for i in range(1, args.producers + 1)
            ]
            started += producers
            if has_exporter:
                argv = command("exporter")
                if "--host" in argv:  # 0.0.0.0 in a container; here this host only
                    argv[argv.index("--host") + 1] = "127.0.0.1"
                if args.exporter_port is not None:
                    argv[argv.index("--port") + 1] = str(args.exporter_port)
                started.append(Service("exporter", argv, env("exporter"), width))
            else:
                print("run_stack: `batchq exporter` does not exist here: not started", flush=True)
            trainer = Service("trainer", command("trainer"), env("trainer"), width)
            started.append(trainer)
            trainer_code = trainer.proc.wait(timeout=args.timeout_s)
            deadline = time.monotonic() + 60
            codes = []
            for p in producers:
                try:
                    codes.append(p.proc.wait(timeout=max(deadline - time.monotonic(), 0.1)))
                except subprocess.TimeoutExpired:
                    codes.append(None)
        except KeyboardInterrupt:
            print("run_stack: interrupted; stopping", flush=True)
            return 130
        except subprocess.TimeoutExpired:
            print(f"run_stack: the trainer did not finish within {args.timeout_s:g} s", flush=True)
            return 1
        finally:
            for service in reversed(started):
                stop_group(service.proc, timeout_s=10)
                service.thread.join(timeout=5)
    ok = trainer_code == 0 and all(c == 0 for c in codes)
    print(
        f"run_stack: trainer exited {trainer_code}; producers exited {codes}; "
        f"{'OK' if ok else 'FAILED'}",
        flush=True,
    )
    return 0 if ok else 1


sys.exit(main())
PY
