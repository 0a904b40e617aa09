"""Every rank of a data-parallel job started as torchrun starts them: one process per
rank with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
(a free loopback port) set, and tests/support on the path."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

SUPPORT = Path(__file__).resolve().parent


def job_parser(resume_path: bool = False) -> argparse.ArgumentParser:
    """The command line of the framework jobs (lightning_job.py, accelerate_job.py,
    transformers_job.py): ``URL QUEUE OUT_DIR EPOCHS [--stop-at N] [--resume]``, the
    resume a checkpoint's path where ``resume_path``, else a flag."""
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("queue")
    p.add_argument("out_dir")
    p.add_argument("epochs", type=int)
    p.add_argument("--stop-at", type=int)
    if resume_path:
        p.add_argument("--resume")
    else:
        p.add_argument("--resume", action="store_true")
    return p


def run_ranks(
    spawn_proc: Any,
    argv: list[str],
    world: int,
    per_rank: Callable[[int], list[str]] = lambda rank: [],
    timeout_s: float = 120,
) -> list[int]:
    """Run ``python *argv *per_rank(rank)`` as every rank; their exit codes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        env.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.update(
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
        )
        procs.append(spawn_proc([sys.executable, *argv, *per_rank(rank)], env=env))
    return [proc.wait(timeout=timeout_s) for proc in procs]
