"""Placement: where experience lives (docs/design.md §4).

Decisions are pure functions over plain data; storage executes them.

* :mod:`~conduit.placement.endpoints`: memory endpoint names (``"cpu"``, ``"cpu_pinned"``,
  ``"cuda:0"``).
* :mod:`~conduit.placement.topology`: devices, free memory and the bandwidth table
  (:class:`Topology`, detected, loaded from JSON, or a preset).
* :mod:`~conduit.placement.presets`: the paper's 8x A100 node and the MI250X fabric of Fig. 4.
* :mod:`~conduit.placement.bandwidth`: the bandwidth profiler and its per-machine cache.
* :mod:`~conduit.placement.transfer`: the transfer model ``T(p)`` and capacity check of Eq. 1.
* :mod:`~conduit.placement.planner`: the candidate set and Alg. 1 (:func:`plan_placement`).
* :mod:`~conduit.placement.migration`: the placement map and Eq. 3 transfer plans (App. D).

Example:
    >>> from conduit.placement import plan_placement, preset
    >>> d = plan_placement(spec_bytes=8 * 5000, capacity=10**6, actor_device="cpu",
    ...                    learner_device="cuda:0", topology=preset("a100-8"))
    >>> d.placement.label()
    'device[cuda:0]'
"""

from conduit.placement.bandwidth import (
    BandwidthProfile,
    BandwidthSample,
    format_table,
    load_cached_profile,
    profile_bandwidth,
    run_profile_cli,
)
from conduit.placement.endpoints import CPU, CPU_PINNED
from conduit.placement.migration import (
    MigrationStep,
    PlacementMap,
    PlacementRegion,
    TransferPlan,
    migration_steps,
    rows_per_device,
    rows_per_endpoint,
    solve_transfer_plan,
    transfer_plan,
    volumes_for,
)
from conduit.placement.planner import (
    PLACEMENT_KINDS,
    CandidateEvaluation,
    PlacementDecision,
    candidate_set,
    greedy_accelerator_order,
    plan_placement,
    scan,
)
from conduit.placement.presets import a100_8, mi250x_8, preset, preset_names
from conduit.placement.topology import DeviceInfo, Link, NodeTopology, Topology
from conduit.placement.transfer import (
    Candidate,
    CapacityCheck,
    DeliveryTerm,
    TransferEstimate,
    check_capacity,
    delivery_terms,
    endpoint_shares,
    placement_memory,
    transfer_estimate,
    transfer_time,
)

__all__ = [
    "CPU",
    "CPU_PINNED",
    "PLACEMENT_KINDS",
    "BandwidthProfile",
    "BandwidthSample",
    "Candidate",
    "CandidateEvaluation",
    "CapacityCheck",
    "DeliveryTerm",
    "DeviceInfo",
    "Link",
    "MigrationStep",
    "NodeTopology",
    "PlacementDecision",
    "PlacementMap",
    "PlacementRegion",
    "Topology",
    "TransferEstimate",
    "TransferPlan",
    "a100_8",
    "candidate_set",
    "check_capacity",
    "delivery_terms",
    "endpoint_shares",
    "format_table",
    "greedy_accelerator_order",
    "load_cached_profile",
    "mi250x_8",
    "migration_steps",
    "placement_memory",
    "plan_placement",
    "preset",
    "preset_names",
    "profile_bandwidth",
    "rows_per_device",
    "rows_per_endpoint",
    "run_profile_cli",
    "scan",
    "solve_transfer_plan",
    "transfer_estimate",
    "transfer_plan",
    "transfer_time",
    "volumes_for",
]
