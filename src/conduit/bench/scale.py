"""``conduit bench scale``: the Ray-sharded plane with 1, 2 and 4 shards on separate Ray nodes,
side by side in one run, and a model-based projection to 8-128 nodes.

For each shard count ``S`` a :class:`~conduit.distributed.RayExperienceDataPlane` runs with one
shard on each of ``S`` nodes (replication ``min(2, S)``). Rounds alternate the shard counts,
and every figure is the median over rounds:

1. **insert**: rows/s of pushes, each from "an actor" on a shard's node to that node's shard
   (round robin over the ``S`` nodes), acknowledged after the replica copy;
2. **sample**: rows/s of off-policy pulls across the shards (delivery prefetch on);
3. **hidden by prefetch**: a learner loop with a fixed update time, once with delivery
   prefetch and once without; the share of the remote delivery wait that prefetch hides is
   ``1 - wait(prefetch) / wait(no prefetch)``;
4. **recovery**: ``ray.kill`` of one shard with the buffer filled, then the time until the
   re-created shard answers with its rows restored from its replica (``S >= 2``).

The inter-node bandwidth is the one the placement profiler measures between Ray nodes
(:func:`conduit.placement.cluster.inter_node_bandwidth`: an object made on one node and fetched
by an actor on each other node, the slowest pair). The projection then takes the placement cost
model (:func:`conduit.placement.transfer.transfer_estimate`) over a topology of ``N`` copies of
this machine joined by that bandwidth: a learner on one node samples from every node's shard, so a
share ``(N-1)/N`` of its rows comes over the network, and each batch also pays the measured
fixed cost of its remote calls. It is labelled a projection: here every
"node" is a process on one machine, so the measured figures show correctness and overhead, not
real scaling.

Starting the local cluster (``ray.cluster_utils.Cluster``) turns on Ray's token authentication
the way a local ``ray.init()`` does; ``--address`` attaches to an existing cluster instead.

The JSON is rewritten with ``"partial": true`` after every shard count's round and every shard
count's recovery, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from conduit.bench.common import PartialJSON, apply_quick, parse_quick, progress
from conduit.cli_args import arg, check_reachable, command_parser
from conduit.placement import Topology
from conduit.placement.cluster import inter_node_bandwidth
from conduit.placement.topology import NodeTopology
from conduit.placement.transfer import Candidate, transfer_estimate
from conduit.report import pyplot, save_figure, table, write_json
from conduit.spec import ExperienceSpec
from conduit.storage import Placement

PROJECTED_NODES = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class ScaleBenchArgs:
    """Arguments of ``conduit bench scale``."""

    shards: tuple[int, ...] = arg((1, 2, 4), "shard counts compared, one shard per Ray node", min=1)
    dim: int = arg(256, "observation dimension (a row holds obs and next_obs: 2 x dim float32)",
                   min=1)
    rollout_rows: int = arg(256, "rows per pushed rollout", min=1)
    batch_size: int = arg(256, "training batch size", min=1)
    fill_rows: int = arg(20_000, "rows in the buffer before sampling and the shard kill", min=1)
    pushes: int = arg(40, "pushes timed per round", min=1)
    pulls: int = arg(40, "pulls timed per round", min=1)
    update_ms: float = arg(20.0, "the learner's update time in the prefetch loop (a sleep)",
                           min=0, finite=True)
    rounds: int = arg(3, "rounds; each alternates every shard count (medians are reported)", min=1)
    node_cpus: int = arg(1, "CPUs per local Ray node", min=1)
    address: str = arg("", "an existing Ray cluster with enough nodes (default: start a "
                            "local one with max(--shards) nodes)")
    out: str = arg("runs/bench/scale", "output directory for JSON and PNG", output="dir")
    quick: bool = arg(False, "shard counts 1 and 2, small sizes, one round: a smoke run "
                             "(flags given explicitly win)")

    def effective(self, given: Collection[str] | None = None) -> ScaleBenchArgs:
        """The arguments after ``--quick``: :data:`QUICK` for the flags not given (see
        :func:`~conduit.bench.common.apply_quick`)."""
        return apply_quick(self, QUICK, given)


#: What ``--quick`` gives the flags left at their defaults.
QUICK = {"shards": (1, 2), "dim": 16, "rollout_rows": 64, "batch_size": 64, "fill_rows": 1024,
         "pushes": 6, "pulls": 6, "update_ms": 5.0, "rounds": 1}


def _spec(dim: int) -> ExperienceSpec:
    return ExperienceSpec.of(obs=((dim,), torch.float32), next_obs=((dim,), torch.float32),
                             action=((), torch.int64), reward=((), torch.float32))


def _rollout(spec: ExperienceSpec, rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn((rows, *fs.shape), generator=g).to(fs.dtype)
                   if fs.dtype.is_floating_point else
                   torch.randint(0, 4, (rows, *fs.shape), generator=g, dtype=fs.dtype))
            for name, fs in spec.fields.items()}


# -- the cluster -------------------------------------------------------------------------------


class LocalCluster:
    """``nodes`` Ray nodes on this machine, the driver attached (token authentication on, as a
    local ``ray.init()`` starts it), or an existing cluster at ``address``.

    Raises:
        ConfigError: Nothing answers at ``address`` (field ``address``).
    """

    def __init__(self, *, nodes: int, cpus: int, address: str) -> None:
        import ray
        self.ray, self.cluster = ray, None
        if address:
            check_reachable("address", address)
            ray.init(address=address, log_to_driver=False)
            self.address = address
            return
        from ray._private.authentication.authentication_token_setup import (
            enable_token_auth_by_default,
            ensure_token_if_auth_enabled,
        )
        from ray.cluster_utils import Cluster
        enable_token_auth_by_default()
        ensure_token_if_auth_enabled(None, create_token_if_missing=True)
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus})
        for _ in range(nodes - 1):
            self.cluster.add_node(num_cpus=cpus)
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address
        ray.init(address=self.address, log_to_driver=False)

    def close(self) -> None:
        self.ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()


# -- measurements -------------------------------------------------------------------------------


def measure_round(plane: Any, spec: ExperienceSpec, a: ScaleBenchArgs, seed: int
                  ) -> dict[str, float]:
    """One round of insert, sample and prefetch figures on one plane."""
    nodes = plane.nodes
    units = [_rollout(spec, a.rollout_rows, seed + i) for i in range(4)]
    t0 = time.perf_counter()
    for i in range(a.pushes):
        plane.push(units[i % 4], node=nodes[i % len(nodes)])
    insert = a.pushes * a.rollout_rows / (time.perf_counter() - t0)
    plane.pull()  # a batch in flight
    t0 = time.perf_counter()
    for _ in range(a.pulls):
        plane.pull()
    sample = a.pulls * a.batch_size / (time.perf_counter() - t0)
    waits = {}
    for prefetch in (False, True):
        plane.prefetch = prefetch
        port = plane.learner_port
        port._next = None  # start each mode from an empty pipeline
        plane.pull()
        before = port.remote_wait_s
        for _ in range(a.pulls):
            plane.pull()
            time.sleep(a.update_ms / 1e3)  # the learner's update
        waits[prefetch] = (port.remote_wait_s - before) / a.pulls
    plane.prefetch = True
    hidden = 1.0 - waits[True] / waits[False] if waits[False] > 0 else 0.0
    return {"insert_rows_s": insert, "sample_rows_s": sample, "wait_ms_no_prefetch":
            waits[False] * 1e3, "wait_ms_prefetch": waits[True] * 1e3, "hidden": hidden}


def measure_recovery(plane: Any) -> dict[str, float]:
    """Kill shard 0's actor and time its restore (detection, re-creation, row copy)."""
    import ray  # the plane's Ray, connected (the [ray] extra)

    actor = plane._shards.actors[0]
    ray.kill(actor, no_restart=True)
    while True:  # the kill is asynchronous: wait until Ray reports the actor dead
        try:
            ray.get(actor.ping.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            break
    t0 = time.perf_counter()
    [rec] = plane.heal()
    return {"recovery_s": time.perf_counter() - t0, "restored_rows": rec.restored_rows,
            "lost_rows": rec.lost_rows}


def projection(*, row_bytes: int, bandwidth: float, replication: int, batch_size: int,
               per_batch_s: float = 0.0, nodes: tuple[int, ...] = PROJECTED_NODES
               ) -> list[dict[str, float]]:
    """Per-sample delivery and replication time on ``N`` copies of this machine joined by
    ``bandwidth``, from the placement cost model (a projection, not a measurement). Rows are
    spread evenly and each is on ``replication`` nodes; a learner reads the rows whose copy is
    on its node locally (a share ``r / N``) and the rest remotely, each at the model's per-row
    cost for a local and for a remote node. A learner's batch costs ``per_batch_s`` (the
    measured fixed cost of a draw's remote calls) plus ``batch_size`` rows at that mixture."""
    base = Topology.detect().nodes[0]
    out = []
    for n in nodes:
        topo = Topology(nodes=tuple(NodeTopology(name=f"node{i}", devices=base.devices,
                                                 links=base.links) for i in range(n)),
                        inter_node_bandwidth=bandwidth, source="projection")

        def deliver_s(names: tuple[str, ...], topo: Topology = topo) -> float:
            cand = Candidate(placement=Placement.pageable(), nodes=names)
            return transfer_estimate(cand, x=row_bytes, actor_device="cpu",
                                     learner_device="node0/cpu", topology=topo).deliver_s

        local_s = deliver_s(("node0",))
        remote_s = deliver_s(("node1",)) if n > 1 else local_s
        local_share = min(1.0, replication / n)
        per_row = local_share * local_s + (1 - local_share) * remote_s
        ingest = transfer_estimate(Candidate(placement=Placement.pageable(),
                                             nodes=tuple(nd.name for nd in topo.nodes)),
                                   x=row_bytes, actor_device="cpu",
                                   learner_device="node0/cpu", topology=topo).ingest_s
        replicate = (replication - 1) * row_bytes / bandwidth
        learner = batch_size / (per_batch_s + batch_size * per_row)
        out.append({"nodes": n, "remote_share": 1 - local_share,
                    "deliver_us_per_row": per_row * 1e6,
                    "ingest_us_per_row": (ingest + replicate) * 1e6,
                    "learner_rows_s": learner,
                    "all_learners_rows_s": n * learner})
    return out


def run(a: ScaleBenchArgs) -> dict[str, Any]:
    """Run the benchmark; returns what it writes to JSON.

    Args:
        a: The arguments to run with, ``--quick`` already applied
            (:meth:`ScaleBenchArgs.effective`).
    """
    from conduit.distributed import RayExperienceDataPlane, ShardResources

    spec = _spec(a.dim)
    out = Path(a.out)
    rounds: dict[int, list[dict[str, float]]] = {s: [] for s in a.shards}
    rows: dict[int, dict[str, float]] = {}

    def measured() -> dict[str, Any]:
        """The JSON payload of what is measured so far."""
        return {"args": asdict(a), "measured": {str(s): m for s, m in rows.items()},
                "rounds": {str(s): v for s, v in rounds.items()}}

    progress(f"starting {max(a.shards)} Ray nodes")
    with PartialJSON(out / "scale.json") as partial:
        cluster = LocalCluster(nodes=max(a.shards), cpus=a.node_cpus, address=a.address)
        try:
            planes = {}
            for s in a.shards:
                progress(f"{s} shard(s): starting")
                planes[s] = RayExperienceDataPlane(
                    spec=spec, capacity=a.fill_rows * 2, batch_size=a.batch_size,
                    num_shards=s, replication=min(2, s), address=cluster.address,
                    min_size=a.batch_size, shard_resources=ShardResources(num_cpus=0.1),
                    timeout=120.0)
            for r in range(a.rounds):
                for s in a.shards:  # side by side: every round visits every shard count
                    progress(f"round {r + 1}/{a.rounds}: {s} shard(s)")
                    rounds[s].append(measure_round(planes[s], spec, a, seed=100 * r))
                    partial.write(measured())
            for s in a.shards:
                fill = _rollout(spec, a.rollout_rows, 7)
                while len(planes[s]) < a.fill_rows:
                    planes[s].push(fill, node=planes[s].nodes[len(planes[s]) % s])
                med = {k: statistics.median(m[k] for m in rounds[s]) for k in rounds[s][0]}
                if s >= 2:
                    progress(f"{s} shards: killing shard 0 with {len(planes[s])} rows")
                    med.update(measure_recovery(planes[s]))
                rows[s] = med
                partial.write(measured())
            live = list(dict.fromkeys(planes[max(a.shards)].nodes))
            progress(f"measuring the inter-node bandwidth between {len(live)} Ray nodes")
            bandwidth = inter_node_bandwidth(live, probe_bytes=8 << 20 if a.quick else 64 << 20) \
                if len(live) > 1 else float("nan")
            for p in planes.values():
                p.close()
        finally:
            cluster.close()
    row_bytes = spec.bytes_per_sample
    top = rows[max(a.shards)]
    per_batch_s = max(0.0, top["wait_ms_no_prefetch"] / 1e3
                      - a.batch_size * row_bytes / bandwidth) if bandwidth == bandwidth else 0.0
    proj = projection(row_bytes=row_bytes, bandwidth=bandwidth, replication=2,
                      batch_size=a.batch_size, per_batch_s=per_batch_s) \
        if bandwidth == bandwidth else []
    base = rows[a.shards[0]]

    def ratio(m: dict[str, float], key: str) -> str:
        return f"{m[key] / base[key]:.2f}"
    print(table(["shards", "insert rows/s", "x", "sample rows/s", "x", "wait no-prefetch ms",
                 "wait prefetch ms", "hidden", "recovery s", "lost"],
                [[s, f"{m['insert_rows_s']:,.0f}", ratio(m, "insert_rows_s"),
                  f"{m['sample_rows_s']:,.0f}", ratio(m, "sample_rows_s"),
                  f"{m['wait_ms_no_prefetch']:.2f}", f"{m['wait_ms_prefetch']:.2f}",
                  f"{100 * m['hidden']:.0f} %",
                  f"{m['recovery_s']:.2f}" if "recovery_s" in m else "-",
                  int(m["lost_rows"]) if "lost_rows" in m else "-"] for s, m in rows.items()]))
    print(f"inter-node bandwidth (measured between Ray nodes on this machine): "
          f"{bandwidth / 1e9:.2f} GB/s; row {row_bytes} B; fixed cost per batch draw "
          f"{per_batch_s * 1e3:.2f} ms")
    if proj:
        print("PROJECTION (placement cost model, not measured):")
        print(table(["nodes", "remote share", "deliver us/row", "ingest+replica us/row",
                     "one learner rows/s", "N learners rows/s"],
                    [[p["nodes"], f"{p['remote_share']:.3f}", f"{p['deliver_us_per_row']:.3f}",
                      f"{p['ingest_us_per_row']:.3f}", f"{p['learner_rows_s']:,.0f}",
                      f"{p['all_learners_rows_s']:,.0f}"] for p in proj]))
    result = {"args": asdict(a), "measured": {str(s): m for s, m in rows.items()},
              "rounds": {str(s): v for s, v in rounds.items()},
              "inter_node_bandwidth": bandwidth,
              "inter_node_bandwidth_probe": "conduit.placement.cluster.inter_node_bandwidth",
              "row_bytes": row_bytes,
              "per_batch_s": per_batch_s,
              "projection": proj, "note": "all Ray nodes share one machine: measured figures "
                                          "show correctness and overhead, not real scaling; "
                                          "the projection is a model"}
    path = write_json(out / "scale.json", result, with_machine=True)
    _plot(rows, proj, out)
    progress(f"wrote {path}")
    return result


def _plot(rows: dict[int, dict[str, float]], proj: list[dict[str, float]], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    shards = list(rows)
    left.plot(shards, [rows[s]["insert_rows_s"] for s in shards], "o-", label="insert")
    left.plot(shards, [rows[s]["sample_rows_s"] for s in shards], "s-", label="sample")
    left.set(xlabel="shards (Ray nodes on one machine)", ylabel="rows/s", xticks=shards,
             title="measured")
    left.legend()
    if proj:
        right.plot([p["nodes"] for p in proj], [p["all_learners_rows_s"] for p in proj], "o--")
        right.set(xscale="log", yscale="log", xlabel="nodes (one learner each)",
                  ylabel="rows/s, all learners", title="PROJECTION (cost model)")
    fig.tight_layout()
    save_figure(fig, out / "scale.png")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``conduit bench scale``."""
    p = command_parser("conduit bench scale", __doc__, ScaleBenchArgs)
    run(parse_quick(p, ScaleBenchArgs, argv, ScaleBenchArgs.effective,
                    check=lambda a: check_reachable("address", a.address)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
