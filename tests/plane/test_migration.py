"""Online migration of the plane (paper §5.3, Alg. 2): data, concurrency, sampler state, specs.

Every test checks behaviour (contents, order, counts), never timings. Sizes are tiny so the
file runs in a few seconds.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from conduit import ExperienceDataPlane, Placement, Schedule
from conduit.errors import ConfigError, SpecError
from conduit.placement import (
    CPU,
    CPU_PINNED,
    DeviceInfo,
    Link,
    PlacementMap,
    Topology,
    migration_steps,
)
from conduit.spec import ExperienceSpec
from tests.conftest import make_rows

CHAIN = [Placement.sharded(["cpu", "cpu", "cpu"]), Placement.pinned(), Placement.pageable()]


def contents(plane: ExperienceDataPlane) -> dict[str, torch.Tensor]:
    """Every filled row of the plane's buffer, in slot order, on CPU."""
    idx = torch.arange(len(plane.buffer), dtype=torch.int64)
    return plane.buffer.store.get(idx, device=torch.device("cpu"))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


# -- byte-for-byte ---------------------------------------------------------------------------


def test_migration_chain_preserves_every_byte_and_the_ring_cursor(small_spec):
    cap = 40
    kw = {"spec": small_spec, "capacity": cap, "batch_size": 8, "seed": 3}
    with ExperienceDataPlane(**kw) as plane, ExperienceDataPlane(**kw) as ref:
        for p in (plane, ref):  # 52 rows into 40 slots: the ring has wrapped
            for start in range(0, 52, 13):
                p.push(make_rows(small_spec, 13, start=start))
        before = contents(plane)
        assert sorted(before["id"].tolist()) == list(range(12, 52))
        for target in CHAIN:
            report = plane.migrate(target, chunk_rows=7)  # chunks straddle the shard bounds
            assert plane.buffer.placement == target
            assert report["rows"] == cap
            assert report["bytes"] == cap * small_spec.bytes_per_sample
            assert sum(report["flows_rows"].values()) == cap
            assert_same(contents(plane), before)
        # the cursor survived: the next writes overwrite the same (oldest) slots
        for p in (plane, ref):
            p.push(make_rows(small_spec, 9, start=1000))
        assert_same(contents(plane), contents(ref))
        # and the sampler's generator too: the next batches are the ones without migration
        for _ in range(3):
            assert_same(plane.pull(), ref.pull())


def test_sharded_report_names_every_shard(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=30, batch_size=4) as plane:
        plane.push(make_rows(small_spec, 30))
        report = plane.migrate(Placement.sharded(["cpu", "cpu"]))
        assert report["flows_rows"] == {"cpu->cpu[0]": 15, "cpu->cpu[1]": 15}
        back = plane.migrate(Placement.pageable())
        assert back["flows_rows"] == {"cpu[0]->cpu": 15, "cpu[1]->cpu": 15}
        assert back["from"]["kind"] == "sharded" and back["to"]["kind"] == "pageable"


def test_widened_spec_zero_pads_old_rows_and_takes_new_width(small_spec):
    wide = ExperienceSpec.of(obs=((6,), torch.float32), id=((), torch.int64),
                             done=((), torch.bool))
    with ExperienceDataPlane(spec=small_spec, capacity=32, batch_size=4) as plane:
        old = make_rows(small_spec, 20)
        plane.push(old)
        report = plane.migrate(Placement.sharded(["cpu", "cpu"]), spec=wide)
        assert plane.spec == wide
        assert report["bytes"] == 20 * wide.bytes_per_sample
        got = contents(plane)
        assert got["obs"].shape == (20, 6)
        assert torch.equal(got["obs"][:, :4], old["obs"])
        assert torch.equal(got["obs"][:, 4:], torch.zeros(20, 2))
        assert torch.equal(got["id"], old["id"]) and torch.equal(got["done"], old["done"])
        with pytest.raises(SpecError) as ei:  # the old width is no longer accepted
            plane.push(make_rows(small_spec, 2, start=100))
        assert ei.value.field == "obs"
        new = make_rows(wide, 6, start=100)
        plane.push(new)
        got = contents(plane)
        assert torch.equal(got["obs"][20:26], new["obs"])
        assert plane.pull()["obs"].shape == (4, 6)
        # widening twice, back on pageable memory: the first rows are padded twice
        wider = ExperienceSpec.of(obs=((9,), torch.float32), id=((), torch.int64),
                                  done=((), torch.bool))
        plane.migrate(Placement.pageable(), spec=wider)
        got = contents(plane)
        assert torch.equal(got["obs"][:20, :4], old["obs"])
        assert torch.equal(got["obs"][20:26, :6], new["obs"])
        assert not got["obs"][:20, 4:].any() and not got["obs"][20:26, 6:].any()


@pytest.mark.parametrize("bad, field", [
    ({"obs": ((4,), torch.float32), "id": ((), torch.int64)}, "done"),          # dropped
    ({"obs": ((4,), torch.float64), "id": ((), torch.int64),
      "done": ((), torch.bool)}, "obs"),                                          # dtype change
    ({"obs": ((3,), torch.float32), "id": ((), torch.int64),
      "done": ((), torch.bool)}, "obs"),                                          # narrowing
    ({"obs": ((4, 2), torch.float32), "id": ((), torch.int64),
      "done": ((), torch.bool)}, "obs"),                                          # rank change
])
def test_bad_spec_change_raises_and_leaves_the_plane_intact(small_spec, bad, field):
    with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4) as plane:
        plane.push(make_rows(small_spec, 10))
        before = contents(plane)
        with pytest.raises(SpecError) as ei:
            plane.migrate(Placement.sharded(["cpu", "cpu"]), spec=ExperienceSpec.of(**bad))
        assert ei.value.field == field
        assert field in str(ei.value)
        assert plane.spec == small_spec and plane.buffer.placement == Placement.pageable()
        assert_same(contents(plane), before)
        plane.push(make_rows(small_spec, 2, start=50))  # still works
        assert len(plane.buffer) == 12


# -- concurrency --------------------------------------------------------------------------------


def test_no_sample_lost_or_duplicated_while_actors_push_and_learner_pulls(small_spec):
    actors, units, unit = 3, 16, 5
    total = actors * units * unit
    plane = ExperienceDataPlane(spec=small_spec, capacity=total + 16, batch_size=16,
                                schedule=Schedule(1, 2, 1, 2), timeout=30, seed=1)
    errors: list[BaseException] = []
    stop = threading.Event()
    pulled: list[int] = []

    migrated = threading.Event()

    def actor(a: int) -> None:
        try:
            for u in range(units):
                if u == units // 2:  # the second half is pushed after a migration started
                    assert migrated.wait(30)
                plane.push(make_rows(small_spec, unit, start=(a * units + u) * unit))
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    def learner() -> None:
        try:
            while not stop.is_set():
                b = plane.pull(timeout=30)
                # no torn row: every delivered field is the function of the row's id
                assert torch.equal(b["obs"], b["id"].to(torch.float32)[:, None].expand(-1, 4))
                assert torch.equal(b["done"], b["id"] % 7 == 6)
                pulled.append(b["id"].shape[0])
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    with plane:
        plane.push(make_rows(small_spec, 16, start=total))  # enough for the first batch
        threads = [threading.Thread(target=actor, args=(a,)) for a in range(actors)]
        threads.append(threading.Thread(target=learner))
        for t in threads:
            t.start()
        seen = []  # rows pushed when each migration started
        while len(seen) < 6 or any(t.is_alive() for t in threads[:-1]):
            seen.append(plane.stats()["pushed_rows"])
            plane.migrate(CHAIN[len(seen) % 3], chunk_rows=16)
            migrated.set()
            assert len(seen) < 500
        for t in threads[:-1]:
            t.join(30)
        plane.flush()
        plane.migrate(Placement.sharded(["cpu", "cpu"]))
        stop.set()
        threads[-1].join(30)
        assert not errors, errors
        ids = contents(plane)["id"]
        # the buffer holds every pushed row exactly once (capacity was never exceeded)
        assert sorted(ids.tolist()) == list(range(total + 16))
        assert plane.stats()["pushed_rows"] == plane.stats()["ingested_rows"] == total + 16
        assert pulled and all(n == 16 for n in pulled)
        assert seen[0] < total + 16  # at least the first migration ran amid pushes
        rows = contents(plane)
        assert torch.equal(rows["obs"], rows["id"].to(torch.float32)[:, None].expand(-1, 4))


def test_on_policy_exactly_once_per_epoch_with_migrations_mid_iteration(small_spec):
    n, m, epochs, iters, unit = 48, 4, 2, 3, 8
    plane = ExperienceDataPlane(spec=small_spec, capacity=n, mode="on_policy",
                                num_minibatches=m, num_epochs=epochs,
                                schedule=Schedule(1, 0.5, 1, 0.25), timeout=30, seed=2)
    delivered: list[list[int]] = [[] for _ in range(iters)]
    errors: list[BaseException] = []

    def actor() -> None:
        try:
            for it in range(iters):
                for s in range(0, n, unit):
                    plane.push(make_rows(small_spec, unit, start=it * 1000 + s),
                               policy_version=it)
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    def learner() -> None:
        try:
            for it in range(iters):
                for mb in plane.minibatches(timeout=30):
                    delivered[it] += mb["id"].tolist()
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    with plane:
        threads = [threading.Thread(target=actor), threading.Thread(target=learner)]
        for t in threads:
            t.start()
        for target in CHAIN * 2:
            plane.migrate(target)
        for t in threads:
            t.join(60)
        assert not errors, errors
    for it in range(iters):
        want = [it * 1000 + i for i in range(n)]
        got = delivered[it]
        assert len(got) == n * epochs
        for e in range(epochs):  # every row exactly once in each epoch
            assert sorted(got[e * n:(e + 1) * n]) == want


# -- sampler state ------------------------------------------------------------------------------


def test_prioritized_state_survives_migration(small_spec):
    kw = {"spec": small_spec, "capacity": 64, "batch_size": 8, "sampler": "prioritized",
          "seed": 11}
    with ExperienceDataPlane(**kw) as plane, ExperienceDataPlane(**kw) as ref:
        for p in (plane, ref):
            p.push(make_rows(small_spec, 50))
            b = p.pull()
            p.update_priorities(b["_index"], torch.arange(8, dtype=torch.float32) * 3 + 0.5)
        idx = torch.arange(64, dtype=torch.int64)
        prios = plane.buffer.sampler.priorities(idx).clone()
        plane.migrate(Placement.sharded(["cpu", "cpu", "cpu", "cpu"]))
        assert torch.equal(plane.buffer.sampler.priorities(idx), prios)
        assert plane.buffer.sampler.max_priority == ref.buffer.sampler.max_priority
        for _ in range(4):  # same draws, weights and rows as a run without migration
            a, r = plane.pull(), ref.pull()
            assert_same(a, r)
            pr = a["id"].to(torch.float32) + 1
            plane.update_priorities(a["_index"], pr)
            ref.update_priorities(r["_index"], pr)
        plane.migrate(Placement.pinned())
        assert torch.equal(plane.buffer.sampler.priorities(idx),
                           ref.buffer.sampler.priorities(idx))


@pytest.mark.parametrize("schedule", [Schedule(0, 1, 0, 0.25), Schedule(1, 1, 1, 0.25)])
def test_fifo_mid_epoch_remaining_minibatches_identical(small_spec, schedule):
    n, m, epochs = 48, 4, 2

    def run(migrate_after: int | None) -> list[dict[str, torch.Tensor]]:
        with ExperienceDataPlane(spec=small_spec, capacity=n, mode="on_policy",
                                 num_minibatches=m, num_epochs=epochs, schedule=schedule,
                                 seed=7, timeout=20) as plane:
            out = []
            for it in range(2):
                for s in range(0, n, 12):
                    plane.push(make_rows(small_spec, 12, start=it * 100 + s),
                               policy_version=it)
                for k in range(m * epochs):
                    if it == 0 and k == migrate_after:
                        plane.migrate(Placement.sharded(["cpu", "cpu", "cpu"]))
                        assert plane.buffer.sampler.remaining == m - migrate_after % m \
                            or schedule.overlap_del
                    out.append(plane.pull())
            return out

    ref = run(None)
    for after in (1, 3, 6):
        got = run(after)
        assert len(got) == len(ref)
        for a, b in zip(ref, got):
            assert_same(a, b)


# -- growth trace driven by the placement map ---------------------------------------------------

C_TRACE = 66  # divisible by 2 and 3: shards of whole, equal rows


def toy_topology() -> Topology:
    """One node, three small 'GPUs' (100 B/row each), pinned host memory for 600 B/row.

    The numbers are chosen so that Alg. 1 walks device -> 2 shards -> 3 shards -> pinned ->
    pageable as the per-sample size grows, with boundaries at x = 101, 201, 301 and 601 B.
    """
    gpus = [f"cuda:{i}" for i in range(3)]
    devs = [DeviceInfo(name=CPU, memory_bytes=C_TRACE * 10_000),
            DeviceInfo(name=CPU_PINNED, memory_bytes=C_TRACE * 600)]
    devs += [DeviceInfo(name=g, memory_bytes=C_TRACE * 100) for g in gpus]
    links = [Link(src=CPU, dst=CPU, bandwidth=5e9), Link(src=CPU, dst=CPU_PINNED, bandwidth=8e9),
             Link(src=CPU_PINNED, dst=CPU_PINNED, bandwidth=5e9)]
    for g in gpus:
        links += [Link(src=CPU, dst=g, bandwidth=12e9), Link(src=CPU_PINNED, dst=g, bandwidth=20e9),
                  Link(src=g, dst=g, bandwidth=1e12)]
        links += [Link(src=g, dst=h, bandwidth=100e9) for h in gpus if h != g]
    return Topology.single_node(devices=devs, links=links, name="toy", source="test:toy")


def cpu_stand_in(p: Placement) -> Placement:
    """What this CPU machine executes for a planned placement: same kind of layout on host."""
    if p.kind == "device":
        return Placement.pageable()
    if p.kind == "sharded":
        return Placement.sharded(["cpu"] * len(p.devices))
    return p


def trace_spec(x: int) -> ExperienceSpec:
    # uint8 observations + an int64 id: x = d + 8 bytes, so every integer x >= 9 is reachable
    return ExperienceSpec.of(obs=((x - 8,), torch.uint8), id=((), torch.int64))


def trace_rows(ids: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
    cols = torch.arange(width, dtype=torch.int64)
    return {"obs": ((ids[:, None] * 31 + cols[None, :]) % 251).to(torch.uint8), "id": ids}


def test_growth_trace_migrates_exactly_at_the_map_boundaries():
    pmap = PlacementMap.build(capacity=C_TRACE, actor_device="cpu", learner_device="cuda:0",
                              topology=toy_topology(), x_min=16, x_max=2000, points=16)
    kinds = [(r.placement.kind, len(r.placement.devices)) for r in pmap.regions]
    assert kinds == [("device", 1), ("sharded", 2), ("sharded", 3), ("pinned", 1),
                     ("pageable", 1)]
    bounds = pmap.boundaries
    assert bounds == (101, 201, 301, 601)
    # adjacent regions map to distinct stand-ins, so a stand-in change is a map change
    stand = [cpu_stand_in(r.placement) for r in pmap.regions]
    assert all(a != b for a, b in itertools.pairwise(stand))
    # the trace grows through every boundary, touching b - 1 and b
    xs = [40, 60, 90]
    for b in bounds:
        xs += [b - 1, b, b + 20]
    xs += [900, 1500]
    expected = migration_steps(pmap, xs)
    assert [s.x for s in expected] == list(bounds)

    x0 = xs[0]
    plane = ExperienceDataPlane(spec=trace_spec(x0), capacity=C_TRACE, batch_size=8,
                                placement=cpu_stand_in(pmap.lookup(x0)), seed=4)
    width_of: dict[int, int] = {}
    next_id = 0
    done: list[tuple[int, float]] = []
    relayouts = 0
    active = pmap.lookup_candidate(x0)
    with plane:
        for k, x in enumerate(xs):
            spec = trace_spec(x)
            target = pmap.lookup_candidate(x)
            if target != active:
                report = plane.migrate(cpu_stand_in(target.placement), spec=spec)
                assert report["rows"] == len(plane.buffer)
                done.append((k, x))
                active = target
            elif spec != plane.spec:
                plane.migrate(plane.buffer.placement, spec=spec)  # widen in place
                relayouts += 1
            assert plane.spec.bytes_per_sample == x
            assert plane.buffer.placement == cpu_stand_in(pmap.lookup(x))
            ids = torch.arange(next_id, next_id + 12, dtype=torch.int64)
            plane.push(trace_rows(ids, x - 8))
            width_of.update(dict.fromkeys(ids.tolist(), x - 8))
            next_id += 12
            plane.pull()
        assert done == [(s.step, s.x) for s in expected]
        assert relayouts == len(xs) - 1 - len(done)
        # every surviving row: its bytes at push time, zero-padded to the final width
        rows = contents(plane)
        final = xs[-1] - 8
        assert sorted(rows["id"].tolist()) == list(range(next_id - C_TRACE, next_id))
        for i, row in zip(rows["id"].tolist(), rows["obs"]):
            w = width_of[i]
            want = trace_rows(torch.tensor([i]), w)["obs"][0]
            assert torch.equal(row[:w], want)
            assert not row[w:final].any()


def host_topology() -> Topology:
    """This machine's two host tiers: pinned memory for up to 300 B/row of a 64-row buffer,
    faster to the learner than pageable memory, which holds everything."""
    devs = [DeviceInfo(name=CPU, memory_bytes=C_TRACE * 10_000),
            DeviceInfo(name=CPU_PINNED, memory_bytes=C_TRACE * 300)]
    links = [Link(src=CPU, dst=CPU, bandwidth=5e9), Link(src=CPU, dst=CPU_PINNED, bandwidth=8e9),
             Link(src=CPU_PINNED, dst=CPU_PINNED, bandwidth=20e9),
             Link(src=CPU_PINNED, dst=CPU, bandwidth=20e9)]
    return Topology.single_node(devices=devs, links=links, name="host", source="test:host")


def test_grow_follows_the_map_and_migrates_by_itself():
    pmap = PlacementMap.build(capacity=C_TRACE, actor_device="cpu", learner_device="cpu",
                              topology=host_topology(), x_min=16, x_max=2000, points=16)
    assert pmap.boundaries == (301,)
    with ExperienceDataPlane(spec=trace_spec(100), capacity=C_TRACE, batch_size=8,
                             placement=pmap, schedule=Schedule(1, 1, 1, 1)) as plane:
        assert plane.buffer.placement == Placement.pinned()
        plane.push(trace_rows(torch.arange(40), 92))
        plane.flush()
        report = plane.grow(spec=trace_spec(200))  # same region: widened in place
        assert not report["migrated"] and plane.buffer.placement == Placement.pinned()
        report = plane.grow(spec=trace_spec(400))  # past the boundary: moves by itself
        assert report["migrated"] and plane.buffer.placement == Placement.pageable()
        assert report["rows"] == 40 and report["plan"]["makespan_s"] > 0
        assert set(report["plan"]["flows_bytes"]) == {"cpu_pinned->cpu"}
        assert report["plan"]["flows_bytes"]["cpu_pinned->cpu"] == 40 * 200
        rows = contents(plane)
        assert rows["id"].tolist() == list(range(40))
        assert torch.equal(rows["obs"][:, :92], trace_rows(torch.arange(40), 92)["obs"])
        assert not rows["obs"][:, 92:].any()
        plane.push(trace_rows(torch.arange(40, 48), 392))
        assert plane.pull()["obs"].shape == (8, 392)
        with pytest.raises(SpecError):
            plane.grow(spec=trace_spec(300))  # narrowing is not a growth


def test_grow_needs_a_map(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=8, batch_size=2) as plane, \
            pytest.raises(ConfigError, match="PlacementMap"):
        plane.grow(spec=small_spec)


@pytest.mark.parametrize("chunk_rows", [-1, 0, 2.5, True, "8"])
def test_migrate_refuses_a_chunk_size_that_is_not_a_positive_integer(small_spec, chunk_rows):
    """A negative chunk copied nothing, yet the new buffer kept the old fill: every row
    became zeros. Now the call is refused and the rows stay as they were."""
    with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4, timeout=5) as plane:
        plane.push(make_rows(small_spec, 10, start=100))
        plane.flush()
        with pytest.raises(ConfigError) as err:
            plane.migrate(Placement.sharded(["cpu", "cpu"]), chunk_rows=chunk_rows)
        assert err.value.field == "chunk_rows"
        assert plane.buffer.placement == Placement.pageable()
        assert plane.buffer.store.get(torch.arange(10))["id"].tolist() == list(range(100, 110))
        plane.migrate(Placement.sharded(["cpu", "cpu"]), chunk_rows=3)
        assert plane.buffer.store.get(torch.arange(10))["id"].tolist() == list(range(100, 110))


def test_migrate_refuses_what_is_not_a_placement(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4, timeout=5) as plane:
        with pytest.raises(ConfigError) as err:
            plane.migrate("pinned")
        assert err.value.field == "placement"


def test_a_placement_map_solved_for_another_capacity_is_refused():
    pmap = PlacementMap.build(capacity=C_TRACE, actor_device="cpu", learner_device="cpu",
                              topology=host_topology(), x_min=16, x_max=2000, points=16)
    with pytest.raises(ConfigError, match="solved for") as err:
        ExperienceDataPlane(spec=trace_spec(100), capacity=C_TRACE * 100, batch_size=8,
                            placement=pmap)
    assert err.value.field == "placement"
