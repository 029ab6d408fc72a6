"""``conduit plan``: print the placement and schedule Conduit would choose, without training.

Placement comes from Alg. 1 over the topology (a preset, a JSON file, or this machine); the
schedule from the iteration-latency model (Eq. 2) over the feasible space of the RL
configuration. The operator costs the model needs come from one of:

* ``--profile``: a short warm-up of the synthetic workload (:mod:`conduit.plane.synthetic`) on
  this machine: real operators on a real plane, :func:`~conduit.plane.profile_plane`;
* otherwise an estimate from the placement's transfer model: one invocation at granularity
  ``g`` costs ``overhead + g·rows·T(p)`` for the ingestion (actor -> buffer) and delivery
  (buffer -> learner) legs of the chosen placement.

``--t-rollout-ms`` / ``--t-update-ms`` give the compute times measured in the real job; they
override the warm-up's synthetic ones. Without them and without ``--profile``, 10 ms each is
assumed (and said so).

Example:
    conduit plan --topology a100-8 --dim 5000 --capacity 1000000 --batch-size 512 \\
        --t-rollout-ms 12 --t-update-ms 20
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace
from fractions import Fraction
from typing import Any, Literal

import torch

from conduit.cli_args import arg, check_reachable, command_parser, parse_command, usage_error
from conduit.errors import ConfigError
from conduit.placement import (
    DeliveryTerm,
    PlacementDecision,
    Topology,
    delivery_terms,
    plan_placement,
    preset,
    preset_names,
)
from conduit.placement.transfer import check_endpoint
from conduit.plane import ExperienceDataPlane, profile_plane
from conduit.plane.config import PlaneConfig
from conduit.plane.synthetic import Workload, fill, make_step, register_ops, synthetic_spec
from conduit.report import write_json
from conduit.scheduling import Plan, Profile, ScheduleSpace, choose
from conduit.storage import Placement

#: Compute time assumed when neither measured times nor ``--profile`` are given.
ASSUMED_COMPUTE_MS = 10.0

#: Largest ``--g-max``: the schedule search enumerates about ``4·g_max²`` schedules, which
#: takes seconds at 64 and minutes past a few hundred.
MAX_G_FLAG = 64


@dataclass(frozen=True)
class PlanArgs:
    """Arguments of ``conduit plan``."""

    mode: Literal["off_policy", "on_policy"] = arg("off_policy", "RL mode")
    dim: int = arg(1000, "transition dimension (float32 obs and next_obs of this size)", min=1)
    bytes_per_sample: int | None = arg(None, "bytes per buffer sample (overrides --dim)", min=1)
    capacity: int = arg(1_000_000, "buffer capacity in rows (on-policy: rows per iteration)", min=1)
    batch_size: int = arg(512, "off-policy training batch size", min=1)
    rollout_rows: int | None = arg(None, "rows per rollout unit (default: --batch-size)")
    minibatches: int = arg(8, "on-policy mini-batches per epoch (M)", min=1)
    g_max: int = arg(8, "off-policy granularity cap (bounds staleness and staging memory; "
                        f"the schedule search grows with its square, so at most {MAX_G_FLAG})",
                     min=1, max=MAX_G_FLAG)
    topology: str = arg("", "preset name (" + ", ".join(preset_names()) + "), a JSON file, "
                            "'ray' or 'ray:ADDRESS' (every node of a running Ray cluster); "
                            "empty: detect this machine")
    learner_device: str = arg("", "learner endpoint (default: first accelerator, else cpu)")
    actor_device: str = arg("cpu", "actor endpoint")
    t_rollout_ms: float | None = arg(None, "measured rollout time per iteration (ms)", min=0,
                                     finite=True)
    t_update_ms: float | None = arg(None, "measured update time per iteration (ms)", min=0,
                                    finite=True)
    profile: bool = arg(False, "measure operator costs with a short synthetic warm-up here")
    op_overhead_us: float = arg(100.0, "per-invocation operator overhead for the estimate (us)",
                                min=0, finite=True)
    sync_us: float = arg(50.0, "sync cost of an overlapped operator for the estimate (us)",
                         min=0, finite=True)
    top_k: int = arg(5, "schedule candidates to show", min=1)
    json_out: str = arg("", "also write the decision as JSON to this path", output="file")


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """What ``conduit plan`` decided.

    Attributes:
        placement: The placement decision (Alg. 1).
        schedule: The schedule plan (Eq. 2 argmin).
        profile_source: ``"profiled"`` or ``"estimated"``, plus notes on assumed values.
        notes: Caveats printed with the result.
    """

    placement: PlacementDecision
    schedule: Plan
    profile_source: str
    notes: tuple[str, ...] = ()
    cross_node: tuple[DeliveryTerm, ...] = ()
    inter_node_bandwidth: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly description."""
        return {"placement": self.placement.to_dict(), "schedule": self.schedule.to_dict(),
                "profile_source": self.profile_source, "notes": list(self.notes),
                "cross_node": [asdict(t) for t in self.cross_node]}


def explain_cross_node(terms: tuple[DeliveryTerm, ...], *, inter_node_bandwidth: float,
                       x: float) -> str:
    """Why a multi-node placement costs what it does: where the rows are, which share a
    learner reads locally and which over the network, and what each adds per sample."""
    local = sum(t.share for t in terms if t.local)
    remote = [t for t in terms if not t.local]
    total = sum(t.seconds for t in terms)
    nodes = len({t.endpoint.split("/")[0] for t in terms})
    net = inter_node_bandwidth / 1e9
    lines = [f"cross-node balance: the buffer is spread over {nodes} nodes; actors write to "
             f"their own node's part, so ingestion stays node-local.",
             f"a learner's sampled row is local with probability {local:.3f} and remote with "
             f"{1 - local:.3f} (the local/remote mixture); the network ({net:.1f} GB/s "
             f"between nodes) bounds every remote term.",
             f"  {'endpoint':<24} {'rows':>7} {'where':>7} {'GB/s':>8} {'per sample':>11} "
             f"{'of deliver':>10}"]
    for t in terms:
        lines.append(f"  {t.endpoint:<24} {t.share:>7.3f} {'local' if t.local else 'remote':>7} "
                     f"{t.bandwidth / 1e9:>8.1f} {t.seconds * 1e6:>9.3f}us "
                     f"{t.seconds / total:>10.1%}")
    if remote:
        share = sum(t.seconds for t in remote) / total
        lines.append(f"remote reads are {share:.0%} of the delivery leg for {x:,.0f} "
                     f"B/sample; delivery prefetch hides them behind the update when the "
                     f"schedule overlaps.")
    return "\n".join(lines)


def load_topology(name: str) -> Topology:
    """A preset by name, a topology JSON file by path, ``ray`` or ``ray:ADDRESS`` for every
    node of a running Ray cluster (inter-node bandwidth measured), or this machine when
    ``name`` is empty.

    Raises:
        ConfigError: ``name`` is neither a preset, an existing file nor a reachable cluster
            (field ``topology``).
    """
    if not name:
        return Topology.detect(cluster=False)
    if name == "ray" or name.startswith("ray:"):
        return _cluster_topology(name.partition(":")[2] or "auto")
    if name in preset_names():
        return preset(name)
    if os.path.exists(name):
        return Topology.load(name)
    raise ConfigError("topology", f"{name!r} is neither a preset ({', '.join(preset_names())}) "
                                  "nor an existing JSON file")


def _cluster_topology(address: str) -> Topology:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("topology", f"'ray' needs Ray: pip install 'conduit-rl[ray]' ({exc})"
                          ) from exc
    if ray.is_initialized():  # already attached (an embedding program)
        return Topology.detect(cluster=True)
    check_reachable("topology", address)
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError("topology", f"no Ray cluster at {address!r}: {exc}") from exc
    try:
        return Topology.detect(cluster=True)
    finally:
        ray.shutdown()


def _default_learner(topology: Topology) -> str:
    node = topology.nodes[0]
    if node.accelerators:
        return topology.qualify(node.name, node.accelerators[0])
    return "cpu"


def _bytes_per_sample(args: PlanArgs) -> int:
    if args.bytes_per_sample is not None:
        if args.bytes_per_sample < 1:
            raise ConfigError("bytes_per_sample", f"must be >= 1, got {args.bytes_per_sample}")
        return args.bytes_per_sample
    if args.dim < 1:
        raise ConfigError("dim", f"must be >= 1, got {args.dim}")
    return synthetic_spec(args.dim).bytes_per_sample


def _space(args: PlanArgs) -> ScheduleSpace:
    """The feasible schedule space of ``args``: the one a plane of this configuration
    searches (:meth:`~conduit.plane.config.PlaneConfig.schedule_space`; on-policy, a
    ``--rollout-rows`` unit's share of the iteration included).

    Raises:
        ConfigError: The space refuses ``--g-max``, ``--minibatches`` or ``--rollout-rows``
            (field ``g_max``, ``minibatches`` or ``rollout_rows``).
    """
    config = _config(args)
    try:
        return config.schedule_space()
    except ConfigError as exc:
        field = {"g_max_ing": "g_max", "g_max_del": "g_max",
                 "num_minibatches": "minibatches"}.get(exc.field, exc.field)
        raise ConfigError(field, exc.reason) from exc


def estimated_profile(args: PlanArgs, decision: PlacementDecision, space: ScheduleSpace,
                      *, t_rollout: float, t_update: float) -> Profile:
    """Operator costs from the transfer model of the chosen placement (no measurement).

    One invocation at granularity ``g`` moves ``g`` rollout units (off-policy, ``rollout_rows``
    rows each; on-policy ``g`` of the iteration's ``capacity`` rows) or ``g`` training batches;
    it costs ``op_overhead + rows·T_leg`` with ``T_leg`` the per-sample ingest or deliver leg.
    """
    ev = decision.chosen_evaluation
    over = args.op_overhead_us * 1e-6
    if args.mode == "on_policy":
        rows_ing = rows_del = float(args.capacity)
    else:
        rows_ing = float(args.rollout_rows or args.batch_size)
        rows_del = float(args.batch_size)
    t_ing = {g: over + float(g) * rows_ing * ev.ingest_s for g in space.g_ing}
    t_del = {g: over + float(g) * rows_del * ev.deliver_s for g in space.g_del}
    sync = args.sync_us * 1e-6
    return Profile(t_rollout=t_rollout, t_update=t_update, t_ing=t_ing, t_del=t_del,
                   t_sync_ing=sync, t_sync_del=sync)


def measured_profile(args: PlanArgs, decision: PlacementDecision, space: ScheduleSpace,
                     x: int) -> tuple[Profile, list[str]]:
    """Profile the synthetic workload on this machine (a bounded warm-up).

    The buffer is built for the chosen placement when this machine has its devices, otherwise
    in pageable memory; its capacity is capped so the warm-up stays small.

    Returns:
        The profile and notes about what was substituted.
    """
    notes: list[str] = []
    dim = args.dim if args.bytes_per_sample is None else max(1, (x - 17) // 8)
    spec = synthetic_spec(dim)
    placement = decision.placement
    if not all(_available_here(d) for d in placement.devices):
        notes.append(f"profiled on this machine in pageable memory: it lacks "
                     f"{placement.label()}")
        placement = Placement.pageable()
    learner = decision.learner_device.split("/")[-1]
    if not _available_here(learner):
        notes.append(f"profiled with the learner on cpu: this machine lacks {learner}")
        learner = "cpu"
    budget_rows = max(64, (256 << 20) // max(1, spec.bytes_per_sample))
    work = Workload(dim, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if args.mode == "on_policy":
            rows = min(args.capacity, budget_rows, 4096)
            rows -= rows % args.minibatches
            rows = max(rows, args.minibatches)
            units = min(4, rows)
            plane = ExperienceDataPlane(spec=spec, capacity=rows, mode="on_policy",
                                        num_minibatches=args.minibatches, placement=placement,
                                        learner_device=learner)
            step = make_step(work, rollout_rows=rows // units, on_policy=True,
                             onpolicy_units=units)
            if rows != args.capacity:
                notes.append(f"warm-up used {rows} rows per iteration, not {args.capacity}")
        else:
            batch = min(args.batch_size, budget_rows // (2 * args.g_max) or 1)
            cap = min(args.capacity, budget_rows)
            batch = min(batch, cap)
            if batch != args.batch_size:
                notes.append(f"warm-up used batch size {batch}, not {args.batch_size}")
            plane = ExperienceDataPlane(spec=spec, capacity=cap, batch_size=batch,
                                        g_max=args.g_max, placement=placement,
                                        learner_device=learner)
            step = make_step(work, rollout_rows=args.rollout_rows or batch)
        register_ops(plane, on_policy=args.mode == "on_policy")
        with plane:
            if args.mode == "off_policy":
                fill(plane, work, rollout_rows=args.rollout_rows or batch, units=4)
            measure_g = [g for g in space.g_ing if g.denominator > 1 or _pow2(g)]
            prof = profile_plane(plane, step, space=space, iterations_per_g=2,
                                 granularities=measure_g)
    finally:
        torch.set_num_threads(before)
    return prof, notes


def _pow2(g: Fraction) -> bool:
    n = int(g)
    return n >= 1 and n & (n - 1) == 0


def _available_here(device: str) -> bool:
    dev = torch.device(device)
    if dev.type == "cpu":
        return True
    if dev.type == "cuda":
        return torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
    return False


def _config(args: PlanArgs) -> PlaneConfig:
    """The configuration of the plane ``args`` describe, so that no plan is made for one a
    plane would refuse.

    Raises:
        ConfigError: As :class:`~conduit.plane.config.PlaneConfig` raises it, naming the
            flag (``--minibatches`` for ``num_minibatches``); or, off-policy, a
            ``--rollout-rows`` outside ``[1, --capacity]``.
    """
    on = args.mode == "on_policy"
    rollout = args.rollout_rows
    if not on and rollout is not None and not 1 <= rollout <= args.capacity:
        raise ConfigError("rollout_rows", f"must be an integer in [1, capacity="
                                          f"{args.capacity}], got {rollout!r}")
    try:
        return PlaneConfig(spec=synthetic_spec(1), capacity=args.capacity, mode=args.mode,
                           batch_size=1 if on else args.batch_size,
                           num_minibatches=args.minibatches if on else 1,
                           rollout_rows=rollout if on else None, g_max=args.g_max)
    except ConfigError as exc:
        field = "minibatches" if exc.field == "num_minibatches" else exc.field
        raise ConfigError(field, exc.reason) from exc


def check_args(args: PlanArgs) -> None:
    """What :func:`plan` would refuse, found before any work: the RL configuration, the
    schedule space, the topology (a preset, an existing file, or a Ray address something
    answers at; nothing is started) and, on a topology known without a cluster, the
    ``--actor-device`` and ``--learner-device`` endpoints.

    Raises:
        ConfigError: Naming the flag's field.
    """
    _space(args)
    name = args.topology
    if name == "ray" or name.startswith("ray:"):
        check_reachable("topology", name.partition(":")[2] or "auto")
        return  # the endpoints are known once the cluster is (main reports them)
    topology = load_topology(name)
    check_endpoint(topology, args.actor_device, "actor_device")
    if args.learner_device:
        check_endpoint(topology, args.learner_device, "learner_device")


def plan(args: PlanArgs) -> PlanResult:
    """Decide placement and schedule for ``args`` (no printing).

    Raises:
        ConfigError: Bad arguments.
        CapacityError: No placement fits the buffer.
    """
    space = _space(args)
    topology = load_topology(args.topology)
    learner = args.learner_device or _default_learner(topology)
    x = _bytes_per_sample(args)
    rows = args.capacity
    decision = plan_placement(capacity=rows, actor_device=args.actor_device,
                              learner_device=learner, topology=topology, spec_bytes=x)
    notes: list[str] = []
    given = {"t_rollout": None if args.t_rollout_ms is None else args.t_rollout_ms * 1e-3,
             "t_update": None if args.t_update_ms is None else args.t_update_ms * 1e-3}
    if args.profile:
        prof, notes = measured_profile(args, decision, space, x)
        if args.topology:
            notes.append("operator costs were measured on this machine, not on the topology "
                         "being planned for")
        prof = replace(prof, **{k: v for k, v in given.items() if v is not None})
        source = "profiled (synthetic warm-up on this machine)"
    else:
        missing = [k for k, v in given.items() if v is None]
        if missing:
            notes.append(f"assumed {ASSUMED_COMPUTE_MS:g} ms for "
                         f"{' and '.join(m[2:] for m in missing)}; pass --t-rollout-ms/"
                         f"--t-update-ms or --profile")
        t = {k: (ASSUMED_COMPUTE_MS * 1e-3 if v is None else v) for k, v in given.items()}
        prof = estimated_profile(args, decision, space, **t)
        source = "estimated from the transfer model"
    terms = (delivery_terms(decision.chosen, x=x, learner_device=learner, topology=topology)
             if topology.is_multi_node else ())
    return PlanResult(placement=decision, schedule=choose(prof, space, top_k=args.top_k),
                      profile_source=source, notes=tuple(notes), cross_node=terms,
                      inter_node_bandwidth=topology.inter_node_bandwidth)


def render(result: PlanResult) -> str:
    """The text ``conduit plan`` prints."""
    lines = ["== placement (Alg. 1) ==", result.placement.explain(), ""]
    if result.cross_node:
        lines += ["== across nodes (§5.1 mixture, §5.2 cross-node balance) ==",
                  explain_cross_node(result.cross_node,
                                     inter_node_bandwidth=result.inter_node_bandwidth,
                                     x=result.placement.x), ""]
    lines += [f"== schedule (Eq. 2; operator costs {result.profile_source}) ==",
             result.schedule.explain(), "",
             f"chosen placement: {result.placement.chosen.label()}",
             f"chosen schedule:  {result.schedule.schedule.label()}"]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``conduit plan``.

    A bad flag value is a usage error naming the flag (exit status 2).

    Raises:
        ConfigError: ``--json-out`` cannot be written.
        CapacityError: No placement fits the buffer.
    """
    p = command_parser("conduit plan", __doc__, PlanArgs)
    args = parse_command(p, PlanArgs, argv, check=check_args)
    try:
        result = plan(args)
    except ConfigError as exc:  # one only the cluster could tell (--topology ray)
        if exc.field not in {f.name for f in fields(PlanArgs)}:
            raise
        usage_error(p, exc.field, exc.reason)
    print(render(result))
    if args.json_out:
        path = write_json(args.json_out, result.to_dict(), field="json_out")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
