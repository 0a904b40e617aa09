"""How should a large frame travel: inside the list, or by reference? Measured.

Moves N values of one size through a private redis-server, push then pop, four ways:

* raw      plain LPUSH / RPOP of the bytes (no cap: the floor every other path pays on top)
* inline   a capped-push Lua script with the frame as ARGV, a pop script returning it
* ref      SET frame-key + capped-push script of the key's name (one pipeline), then a
           pop script returning the name + GETDEL (what batchq does above 64 KiB)
* stage    LPUSH into a staging list + a script LMOVE-ing it under the cap

Prints MB/s for push, pop and both, and each path's ratio to raw, for every size given.
Usage: python bench/frame_path.py [--sizes 65536,1572864,4816896] [--n 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

from batchq.client.connection import make_client, tune_malloc
from batchq.host.embedded import EmbeddedRedis

CAPPED_PUSH = """
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('HINCRBY', KEYS[2], 'pushed', 1)
return 1
"""
POP = """
local v = redis.call('RPOP', KEYS[1])
redis.call('HINCRBY', KEYS[2], 'popped', 1)
return v
"""
MOVE = """
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('LMOVE', KEYS[3], KEYS[1], 'RIGHT', 'LEFT')
redis.call('HINCRBY', KEYS[2], 'pushed', 1)
return 1
"""
CAP = 10**9


def measure(push: Callable[[int], Any], pop: Callable[[int], Any], n: int) -> tuple[float, float]:
    """Seconds spent pushing and popping n values, alternating, a few kept in the list."""
    for i in range(4):
        push(i)
    t_push = t_pop = 0.0
    for i in range(4, n + 4):
        t0 = time.perf_counter()
        push(i)
        t1 = time.perf_counter()
        pop(i)
        t_push += t1 - t0
        t_pop += time.perf_counter() - t1
    return t_push, t_pop


def paths(
    client: Any, value: bytes
) -> dict[str, tuple[Callable[[int], Any], Callable[[int], Any]]]:
    push_sha = client.script_load(CAPPED_PUSH)
    pop_sha = client.script_load(POP)
    move_sha = client.script_load(MOVE)

    def ref_push(i: int) -> None:
        pipe = client.pipeline(transaction=False)
        pipe.set(f"bench:f{i}", value)
        pipe.evalsha(push_sha, 2, "bench:d", "bench:s", f"bench:f{i}", CAP)
        pipe.execute()

    def ref_pop(i: int) -> None:
        name = client.evalsha(pop_sha, 2, "bench:d", "bench:s")
        client.execute_command("GETDEL", name)

    def stage_push(i: int) -> None:
        pipe = client.pipeline(transaction=False)
        pipe.lpush("bench:st", value)
        pipe.evalsha(move_sha, 3, "bench:d", "bench:s", "bench:st", CAP)
        pipe.execute()

    return {
        "raw": (lambda i: client.lpush("bench:d", value), lambda i: client.rpop("bench:d")),
        "inline": (
            lambda i: client.evalsha(push_sha, 2, "bench:d", "bench:s", value, CAP),
            lambda i: client.evalsha(pop_sha, 2, "bench:d", "bench:s"),
        ),
        "ref": (ref_push, ref_pop),
        "stage": (stage_push, lambda i: client.evalsha(pop_sha, 2, "bench:d", "bench:s")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="65536,1572864,4816896")
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tune_malloc()
    results: list[dict[str, Any]] = []
    with EmbeddedRedis() as server:
        client = make_client(server.url)
        for size in (int(s) for s in args.sizes.split(",")):
            value = os.urandom(size)
            n = max(20, min(args.n, int(args.n * 1_572_864 / size)))
            for name, (push, pop) in paths(client, value).items():
                best = None
                for _ in range(args.repeat):
                    client.delete("bench:d", "bench:st")
                    t_push, t_pop = measure(push, pop, n)
                    if best is None or t_push + t_pop < sum(best):
                        best = (t_push, t_pop)
                assert best is not None
                mb = n * size / 1e6
                results.append(
                    {
                        "size": size,
                        "path": name,
                        "push_mb_s": mb / best[0],
                        "pop_mb_s": mb / best[1],
                        "both_mb_s": mb / sum(best),
                    }
                )
                print(f"  {size:>9} B {name:<7} done", flush=True)
        client.close()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"\n{'size (B)':>10} {'path':<7}{'push MB/s':>11}{'pop MB/s':>10}"
        f"{'both MB/s':>11}{'vs raw':>8}"
    )
    for r in results:
        raw = next(x for x in results if x["size"] == r["size"] and x["path"] == "raw")
        print(
            f"{r['size']:>10} {r['path']:<7}{r['push_mb_s']:>11.0f}{r['pop_mb_s']:>10.0f}"
            f"{r['both_mb_s']:>11.0f}{r['both_mb_s'] / raw['both_mb_s']:>8.2f}"
        )


if __name__ == "__main__":
    main()
