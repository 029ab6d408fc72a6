"""Reverb side of ``conduit bench peers``; runs inside ``.venv-reverb``, not in Conduit's venv.

DeepMind Reverb 0.14.0 pins TensorFlow 2.15, numpy<2 and protobuf<5, which conflict with Ray,
so the harness runs this script as a subprocess with the Reverb virtualenv's Python. It
imports nothing from Conduit (the Reverb venv has no torch): only the standard library, numpy,
TensorFlow and Reverb.

Usage (the harness does this; the config is JSON on stdin)::

    .venv-reverb/bin/python reverb_worker.py --mode inproc < config.json > result.json

``--mode inproc`` hosts the ``reverb.Server`` in this process; ``--mode grpc`` starts it in a
child process (this script with ``--serve``) and talks to it over gRPC at 127.0.0.1. Reverb's
server binds every interface (``[::]:port``); the clients here only connect over 127.0.0.1.

Result (stdout, one JSON object)::

    {"versions": {...}, "rows": [{"peer": ..., "description": ..., "dim": ...,
      "capacity": ..., "metrics": {name: {"times_s": [...], "rows_per_op": n}
                                  | {"status": "skipped", "reason": ...}}, "notes": [...]}]}

Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FIELDS = ("obs", "action", "reward", "done")


def _log(msg: str) -> None:
    print(f"[reverb] {msg}", file=sys.stderr, flush=True)


def _signature(tf: Any, dim: int) -> dict[str, Any]:
    return {"obs": tf.TensorSpec([dim], tf.float32), "action": tf.TensorSpec([], tf.int64),
            "reward": tf.TensorSpec([], tf.float32), "done": tf.TensorSpec([], tf.bool)}


def build_tables(dim: int, capacity: int, epoch_rows: int, alpha: float) -> list[Any]:
    """The three tables: uniform replay, prioritized replay, consume-once on-policy."""
    import reverb
    import tensorflow as tf

    sig = _signature(tf, dim)
    return [
        reverb.Table(name="uniform", sampler=reverb.selectors.Uniform(),
                     remover=reverb.selectors.Fifo(), max_size=capacity,
                     rate_limiter=reverb.rate_limiters.MinSize(1), signature=sig),
        reverb.Table(name="prioritized", sampler=reverb.selectors.Prioritized(alpha),
                     remover=reverb.selectors.Fifo(), max_size=capacity,
                     rate_limiter=reverb.rate_limiters.MinSize(1), signature=sig),
        # Uniform sampling with max_times_sampled=1: each row comes out once, in random order.
        reverb.Table(name="onpolicy", sampler=reverb.selectors.Uniform(),
                     remover=reverb.selectors.Fifo(), max_size=epoch_rows, max_times_sampled=1,
                     rate_limiter=reverb.rate_limiters.MinSize(1), signature=sig),
    ]


def make_chunk(np: Any, rows: int, dim: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    done = np.zeros(rows, dtype=bool)
    done[-1] = True
    return {"obs": rng.standard_normal((rows, dim), dtype=np.float32),
            "action": rng.integers(0, 16, size=rows, dtype=np.int64),
            "reward": rng.standard_normal(rows, dtype=np.float32), "done": done}


MAX_IN_FLIGHT_ITEMS = 16
"""Items a writer may leave unconfirmed; Reverb asks writers to flush regularly (as Acme's
adders do after each item) or it warns of memory growth."""


def insert_chunk(writer: Any, table: str, chunk: dict[str, Any]) -> None:
    """One item per row, the way a Reverb actor writes transitions."""
    obs, act, rew, done = chunk["obs"], chunk["action"], chunk["reward"], chunk["done"]
    for i in range(len(obs)):
        writer.append({"obs": obs[i], "action": act[i], "reward": rew[i], "done": done[i]})
        writer.create_item(table, priority=1.0,
                           trajectory={k: writer.history[k][-1] for k in FIELDS})
        writer.flush(block_until_num_items=MAX_IN_FLIGHT_ITEMS)
    writer.flush()


def stack(np: Any, samples: list[Any]) -> dict[str, Any]:
    """A list of single-step ``ReplaySample``s into one batch of arrays."""
    return {k: np.stack([s.data[k] for s in samples]) for k in FIELDS}


def client_sample(np: Any, client: Any, table: str, n: int) -> tuple[dict[str, Any], list[int]]:
    samples = list(client.sample(table, num_samples=n, emit_timesteps=False,
                                 unpack_as_table_signature=True))
    return stack(np, samples), [s.info.key for s in samples]


# The same loop as conduit.timing.repeat_times: this worker runs in .venv-reverb, where
# Conduit is not installed.
def _timed(fn: Any, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _skip(reason: str) -> dict[str, str]:
    return {"status": "skipped", "reason": reason}


def run_workload(cfg: dict[str, Any], w: dict[str, Any], address: str,
                 mode: str) -> list[dict[str, Any]]:
    """All metrics for one workload against the server at ``address``."""
    import numpy as np
    import reverb

    dim, cap, batch = w["dim"], w["capacity"], w["batch"]
    warm, reps = cfg["warmup"], cfg["repeats"]
    seed = w.get("seed", 0)
    rng = np.random.default_rng(seed)
    client = reverb.Client(address)
    big = make_chunk(np, 1024, dim, seed)
    small = {k: v[:64] for k, v in big.items()}
    m: dict[str, Any] = {}
    md: dict[str, Any] = {}

    with client.trajectory_writer(num_keep_alive_refs=1) as writer:
        _log(f"{mode} d={dim}: filling {cap} rows (chunks of 1024)")
        times = []
        for start in range(0, cap, 1024):
            n = min(1024, cap - start)
            t0 = time.perf_counter()
            insert_chunk(writer, "uniform", {k: v[:n] for k, v in big.items()})
            if n == 1024:
                times.append(time.perf_counter() - t0)
        m["insert_1024"] = {"times_s": times[min(warm, len(times) - 1):], "rows_per_op": 1024}
        n64 = cfg.get("insert_64_repeats", reps)
        m["insert_64"] = {"times_s": _timed(lambda: insert_chunk(writer, "uniform", small),
                                            warm, n64), "rows_per_op": 64}

    _log(f"{mode} d={dim}: uniform sampling, client.sample({batch})")
    m["sample_uniform"] = {"times_s": _timed(lambda: client_sample(np, client, "uniform", batch),
                                             warm, reps), "rows_per_op": batch}
    _log(f"{mode} d={dim}: uniform sampling, TrajectoryDataset.batch({batch})")
    ds = reverb.TrajectoryDataset.from_table_signature(
        address, "uniform", max_in_flight_samples_per_worker=2 * batch).batch(batch)
    uniform_it = iter(ds)
    md["sample_uniform"] = {"times_s": _timed(lambda: next(uniform_it), warm, reps),
                            "rows_per_op": batch}
    uniform_it = ds = None  # close the dataset's sample streams before the next phase

    client.reset("uniform")  # free its rows before the prioritized table fills
    _log(f"{mode} d={dim}: prioritized, filling {cap} rows")
    with client.trajectory_writer(num_keep_alive_refs=1) as writer:
        for start in range(0, cap, 1024):
            insert_chunk(writer, "prioritized",
                         {k: v[:min(1024, cap - start)] for k, v in big.items()})

    # Priorities drawn before timing, cycled (as conduit.bench.peers.adapter.priorities).
    pool = [(rng.random(batch) + 1e-3).tolist() for _ in range(64)]
    turn = [0]

    def next_priorities() -> list[float]:
        turn[0] += 1
        return pool[turn[0] % len(pool)]

    def per_client() -> None:
        _, keys = client_sample(np, client, "prioritized", batch)
        client.mutate_priorities("prioritized", updates=dict(zip(keys, next_priorities())))

    m["sample_per_update"] = {"times_s": _timed(per_client, warm, reps), "rows_per_op": batch}
    ds = reverb.TrajectoryDataset.from_table_signature(
        address, "prioritized", max_in_flight_samples_per_worker=2 * batch).batch(batch)
    per_it = iter(ds)

    def per_dataset() -> None:
        sample = next(per_it)
        keys = sample.info.key.numpy().tolist()
        client.mutate_priorities("prioritized", updates=dict(zip(keys, next_priorities())))

    md["sample_per_update"] = {"times_s": _timed(per_dataset, warm, reps), "rows_per_op": batch}
    per_it = ds = None
    client.reset("prioritized")

    _log(f"{mode} d={dim}: on-policy epochs ({w['epoch_rows']} rows, "
         f"{w['minibatches']} mini-batches)")
    mb = w["epoch_rows"] // w["minibatches"]
    epoch_times = []
    with client.trajectory_writer(num_keep_alive_refs=1) as writer:
        for rep in range(warm + cfg.get("epoch_repeats", reps)):
            for start in range(0, w["epoch_rows"], 1024):
                n = min(1024, w["epoch_rows"] - start)
                insert_chunk(writer, "onpolicy", {k: v[:n] for k, v in big.items()})
            t0 = time.perf_counter()
            rows = 0
            for _ in range(w["minibatches"]):
                rows += len(client_sample(np, client, "onpolicy", mb)[1])
            if rep >= warm:
                epoch_times.append(time.perf_counter() - t0)
            if rows != w["epoch_rows"]:
                raise RuntimeError(f"on-policy epoch delivered {rows} rows, "
                                   f"expected {w['epoch_rows']}")
    m["onpolicy_epoch"] = {"times_s": epoch_times, "rows_per_op": w["epoch_rows"]}
    same = f"same writer and table as reverb-{mode}"
    md["insert_64"] = md["insert_1024"] = _skip(same)
    md["onpolicy_epoch"] = _skip("a consume-once epoch must stop exactly at the rollout's end; "
                                 "measured with client.sample on the reverb-" + mode + " row")
    where = "in the same process" if mode == "inproc" else "in another process"
    base = {"dim": dim, "capacity": cap, "batch": batch}
    return [
        {**base, "peer": f"reverb-{mode}", "metrics": m,
         "description": f"reverb.Server {where}, Client('127.0.0.1:port'); TrajectoryWriter "
                        f"inserts (one item per row), Client.sample / mutate_priorities",
         "notes": ["client.sample is documented by Reverb as not for training; "
                   "the dataset row is its training path"]
         + (["in-process: Reverb's sampler reads the table directly, without gRPC"]
            if mode == "inproc" else [])},
        {**base, "peer": f"reverb-{mode}-dataset", "metrics": md,
         "description": f"reverb.TrajectoryDataset.batch({batch}) from a server {where}",
         "notes": ["the dataset samples ahead in background threads: the latency is "
                   "what the consumer waits",
                   "prioritized: samples prefetched before a priority update do not see it"]},
    ]


def serve(cfg: dict[str, Any]) -> None:
    """Child process of ``--mode grpc``: host the tables until stdin closes."""
    import reverb

    w = cfg["workloads"][cfg["serve_index"]]
    server = reverb.Server(build_tables(w["dim"], w["capacity"], w["epoch_rows"],
                                        cfg["alpha"]))
    print(json.dumps({"port": server.port}), flush=True)
    sys.stdin.read()
    server.stop()


@contextlib.contextmanager
def server_for(cfg: dict[str, Any], index: int, mode: str) -> Any:
    """Yield the address of a server hosting workload ``index``'s tables."""
    w = cfg["workloads"][index]
    if mode == "inproc":
        import reverb

        server = reverb.Server(build_tables(w["dim"], w["capacity"], w["epoch_rows"],
                                            cfg["alpha"]))
        try:
            yield f"127.0.0.1:{server.port}"
        finally:
            server.stop()
        return
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(json.dumps({**cfg, "serve_index": index}) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the Reverb server process exited with {child.wait()}")
        yield f"127.0.0.1:{json.loads(line)['port']}"
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main(argv: list[str] | None = None) -> int:
    """Run the Reverb measurements described by the JSON config on stdin."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("inproc", "grpc"), default="inproc",
                   help="server in this process, or in a child process over gRPC")
    p.add_argument("--serve", action="store_true",
                   help="internal: host the tables of the config on stdin (gRPC mode)")
    p.add_argument("--probe", action="store_true",
                   help="print the Reverb and TensorFlow versions as JSON and exit")
    args = p.parse_args(argv)
    if args.serve:
        cfg = json.loads(sys.stdin.readline())  # one line; stdin then stays open until done
        serve(cfg)
        return 0

    from importlib import metadata

    import numpy as np
    import tensorflow as tf

    versions = {"dm-reverb": metadata.version("dm-reverb"), "tensorflow": tf.__version__,
                "numpy": np.__version__, "python": sys.version.split()[0]}
    if args.probe:
        print(json.dumps({"versions": versions}))
        return 0
    cfg = json.load(sys.stdin)
    rows: list[dict[str, Any]] = []
    for i, w in enumerate(cfg["workloads"]):
        try:
            with server_for(cfg, i, args.mode) as address:
                rows.extend(run_workload(cfg, w, address, args.mode))
        except Exception as exc:  # report, never crash the harness
            rows.append({"peer": f"reverb-{args.mode}", "dim": w["dim"],
                         "capacity": w["capacity"], "batch": w["batch"], "status": "unavailable",
                         "reason": f"{type(exc).__name__}: {exc}"})
    print(json.dumps({"versions": versions, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
