"""The rendezvous store at 64 to 1,024 clients on one machine: the TCPStore ddpflow's rank 0
opens (ddpflow.cluster.rendezvous.master_store: libuv, listening on 127.0.0.1 only) and N
clients, one per simulated rank, each a thread of this process holding its own TCPStore
client (its own connection), as every rank holds one.

Per size, in a fresh child process (a hung store cannot outlive --timeout):

* **joined**: from the start signal until the last client's TCPStore constructor returned
  (connected and validated);
* **barrier**: until the last client passed one barrier after joining (store.add on a
  counter; the client that brings it to N sets a key; everyone waits on that key), which is
  the pattern of torch's own store barrier;
* the median client's join, and how many clients took longer than --stall-s to join.

Growth: a least-squares fit of time = a * N^b on log-log axes (b = 1 is linear) and the ratio
of the time at the largest N to the time at the smallest.

Resolver stalls: the store looks up its peers' names while connecting; where the resolver
in /etc/resolv.conf does not answer (this sandbox), a lookup waits for the resolver's timeout
(5 s by default) and holds up the store's connections meanwhile. `--res-options` passes
glibc's RES_OPTIONS to the clients' process (e.g. "timeout:1 attempts:1") to show which part
of the time is the resolver's; the JSON keeps both passes.

    bench/store_scale.py                                    # 64 ... 1,024, ~1 min
    bench/store_scale.py --sizes 8 16 --out /tmp/s.json     # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time

import harness

DEFAULT_SIZES = [64, 128, 256, 512, 1024]
QUICK_RES_OPTIONS = "timeout:1 attempts:1"


# the performance page's heading
DESCRIPTION = "the rendezvous store: time until N clients joined and passed a barrier"


def one_size(clients: int, timeout_s: float, stall_s: float) -> dict:
    """In the child: rank 0's store and `clients` client threads; the timings (seconds)."""
    import torch.distributed as dist
    from ddpflow.cluster import rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    master = rendezvous.master_store("127.0.0.1", 0, clients, timeout, wait_for_workers=False)
    joined, passed, errors = [0.0] * clients, [0.0] * clients, []
    held = []  # every client stays connected until all have passed, as ranks stay
    start = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        try:
            start.wait()
            t0 = time.perf_counter()
            store = dist.TCPStore("127.0.0.1", master.port, clients, False, timeout=timeout)
            held.append(store)
            joined[i] = time.perf_counter() - t0
            if store.add("arrived", 1) == clients:
                store.set("all-arrived", "1")
            store.wait(["all-arrived"])
            passed[i] = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001 - reported in the JSON, not raised in a thread
            errors.append(f"client {i}: {type(err).__name__}: {err}"[:300])

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    for thread in threads:
        thread.join(timeout_s)
    return {
        "clients": clients,
        "joined_s": max(joined),
        "barrier_s": max(passed),
        "median_join_s": statistics.median(joined),
        "stalled_clients": sum(t > stall_s for t in joined),
        "errors": errors[:5],
    }


def run_size(clients: int, args, res_options: str | None) -> dict:
    """one_size in a fresh process, killed after --timeout."""
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}  # one warning per client otherwise
    if res_options:
        env["RES_OPTIONS"] = res_options
    command = [sys.executable, __file__, "--child", str(clients), "--timeout", str(args.timeout)]
    command += ["--stall-s", str(args.stall_s)]
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=args.timeout + 30
    )
    if done.returncode != 0:
        return {"clients": clients, "errors": [done.stderr[-500:]]}
    return json.loads(done.stdout.splitlines()[-1])


def growth(rows: list[dict], key: str) -> dict:
    """time = a * N^b fitted on log-log axes; ratio of the largest N's time to the smallest's."""
    points = [(math.log(r["clients"]), math.log(r[key])) for r in rows if r.get(key)]
    if len(points) < 2:
        return {}
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    first, last = rows[0], rows[-1]
    span = {"from": first["clients"], "to": last["clients"]}
    return {"exponent": round(b, 3), "ratio": last[key] / first[key], **span}


def measure(args) -> dict:
    passes = [("system resolver", None)]
    if args.res_options:
        passes.append((f"RES_OPTIONS={args.res_options}", args.res_options))
    out = []
    for label, options in passes:
        rows = [run_size(n, args, options) for n in sorted(args.sizes)]
        fits = {key: growth(rows, key) for key in ("joined_s", "barrier_s")}
        out.append({"resolver": label, "rows": rows, "growth": fits})
        for row in rows:
            joined, barrier = (row.get(k, float("nan")) for k in ("joined_s", "barrier_s"))
            print(
                f"store_scale [{label}] {row['clients']:>5} clients: joined {joined:.2f} s, "
                f"barrier {barrier:.2f} s, {row.get('stalled_clients', '?')} stalled",
                flush=True,
            )
    return {"passes": out}


def parse_args(argv=None):
    parser = harness.parser(__doc__, "store_scale.json")
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument("--timeout", type=float, default=120.0, help="per size, seconds")
    parser.add_argument("--stall-s", type=float, default=0.5, help="a join this long stalled")
    second = "a second pass with this RES_OPTIONS ('' for none)"
    parser.add_argument("--res-options", default=QUICK_RES_OPTIONS, help=second)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(one_size(args.child, args.timeout, args.stall_s)))
        return 0
    started = time.perf_counter()
    doc = {
        **harness.head("store_scale", description=DESCRIPTION),
        **measure(args),
        "conditions": {
            "store": "ddpflow.cluster.rendezvous.master_store (TCPStore, libuv, 127.0.0.1)",
            "clients": "threads of one process, one TCPStore client (connection) each, all "
            "released at once; each child process holds one size",
            "barrier": "store.add counter + set/wait of one key, after joining",
            "stall": f"a client whose join took over {args.stall_s} s",
        },
    }
    return harness.write(doc, args.out, wall_since=started, indent=1)


if __name__ == "__main__":
    sys.exit(main())
