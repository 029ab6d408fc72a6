"""Invariants of the plane (docs/design.md §3; the paper's App. C)."""

import threading
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conduit import ExperienceDataPlane, Placement, Schedule
from tests.conftest import make_rows


def on_policy_run(spec, schedule, placement=None, *, n=48, m=4, epochs=2, iters=2, unit=12,
                  seed=5):
    with ExperienceDataPlane(spec=spec, capacity=n, mode="on_policy", num_minibatches=m,
                             num_epochs=epochs, schedule=schedule, placement=placement,
                             seed=seed, timeout=20) as plane:
        out = []
        for it in range(iters):
            for start in range(0, n, unit):
                plane.push(make_rows(spec, unit, start=it * 1000 + start), policy_version=it)
            out.append([mb for mb in plane.minibatches()])
        return out


def test_on_policy_batches_identical_across_schedules_and_placements(small_spec):
    ref = on_policy_run(small_spec, Schedule(0, 1, 0, 0.25))
    for sched in [Schedule(1, 1, 1, 0.25), Schedule(1, 0.25, 0, 0.25), Schedule(0, 0.5, 1, 0.25)]:
        for placement in [None, Placement.sharded(["cpu", "cpu", "cpu"]), Placement.pinned()]:
            got = on_policy_run(small_spec, sched, placement)
            for it_ref, it_got in zip(ref, got):
                for a, b in zip(it_ref, it_got):
                    for k in a:
                        assert torch.equal(a[k], b[k]), (sched, placement, k)


@given(data=st.data())
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_on_policy_exactly_once_under_random_schedules(small_spec, data):
    m = data.draw(st.integers(1, 6), label="M")
    units = data.draw(st.integers(1, 5), label="units")
    unit = data.draw(st.integers(1, 8), label="unit rows")
    n = units * unit
    if n < m:
        m = n
    k = data.draw(st.integers(1, m), label="k")
    sched = Schedule(data.draw(st.sampled_from([0, 1])), k / m,
                     data.draw(st.sampled_from([0, 1])), 1 / m)
    epochs = data.draw(st.integers(1, 3), label="epochs")
    with ExperienceDataPlane(spec=small_spec, capacity=n, mode="on_policy", num_minibatches=m,
                             num_epochs=epochs, schedule=sched, timeout=20) as plane:
        for it in range(2):
            pushed = []
            for u in range(units):
                rows = make_rows(small_spec, unit, start=it * 10_000 + u * unit)
                pushed += rows["id"].tolist()
                plane.push(rows, policy_version=it)
            delivered = [mb["id"] for mb in plane.minibatches()]
            assert plane.policy_version == it + 1
            for e in range(epochs):
                epoch_ids = torch.cat(delivered[e * m:(e + 1) * m]).tolist()
                assert sorted(epoch_ids) == sorted(pushed)


@pytest.mark.parametrize("schedule", [Schedule(0, 1, 0, 1), Schedule(0, 4, 0, 1),
                                      Schedule(1, 1, 1, 1), Schedule(1, 3, 1, 2)],
                         ids=lambda s: s.label())
def test_off_policy_staleness_bound(small_spec, schedule):
    """After every push returns, at most `staleness_bound` pushed units are not sampleable;
    prefetched batches never exceed `prefetch_bound`."""
    with ExperienceDataPlane(spec=small_spec, capacity=10_000, batch_size=8, min_size=8,
                             schedule=schedule, timeout=20) as plane:
        bound = plane.staleness_bound
        for i in range(60):
            plane.push(make_rows(small_spec, 5, start=5 * i))
            st_ = plane.stats()
            assert st_["pushed_units"] - st_["ingested_units"] <= bound
            if len(plane.buffer) >= 8:
                plane.pull()
                assert plane.stats()["staged_batches"] <= plane.prefetch_bound
        plane.flush()
        assert plane.stats()["ingested_units"] == 60
        assert len(plane.buffer) == 300


@pytest.mark.parametrize("schedule", [Schedule(0, 1, 0, 1), Schedule(1, 1, 1, 1),
                                      Schedule(0, 1, 0, 4), Schedule(1, 2, 1, 3)],
                         ids=lambda s: s.label())
def test_priority_update_visible_to_next_sample(small_spec, schedule):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=16, sampler="prioritized",
                             schedule=schedule, timeout=20) as plane:
        plane.buffer.sampler.eps = 1e-12
        plane.push(make_rows(small_spec, 64))
        plane.flush()
        plane.pull()
        pr = torch.zeros(64)
        pr[17] = 1.0
        plane.update_priorities(torch.arange(64), pr)
        for _ in range(3):
            assert set(plane.pull()["id"].tolist()) == {17}


def test_prefetch_may_lag_when_allowed(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=64, batch_size=16, sampler="prioritized",
                             schedule=Schedule(0, 1, 0, 4), max_priority_lag=1) as plane:
        plane.push(make_rows(small_spec, 64))
        plane.pull()
        plane.update_priorities(torch.arange(64), torch.zeros(64))
        plane.pull()  # drawn before the update, but one update of lag is allowed
        assert plane.stats()["discarded_batches"] == 0


def test_off_policy_delivers_rows_that_were_pushed(small_spec):
    with ExperienceDataPlane(spec=small_spec, capacity=100, batch_size=10,
                             schedule=Schedule(1, 2, 1, 2)) as plane:
        for i in range(10):
            plane.push(make_rows(small_spec, 10, start=10 * i))
        plane.flush()
        for _ in range(20):
            b = plane.pull()
            assert b["obs"].shape == (10, 4)
            # content is a function of id, so torn or mixed rows would show
            assert torch.equal(b["obs"][:, 0].long(), b["id"])


def test_concurrent_pushers_and_puller_reconcile(small_spec):
    """Many pushing threads, one pulling thread, thousands of rollouts: counts add up."""
    threads, per_thread, rows = 6, 400, 3
    with ExperienceDataPlane(spec=small_spec, capacity=100_000, batch_size=32, min_size=32,
                             schedule=Schedule(1, 4, 1, 2), timeout=30) as plane:
        errors = []

        def pusher(t):
            try:
                for i in range(per_thread):
                    plane.push(make_rows(small_spec, rows, start=(t * per_thread + i) * rows))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        pulled = []
        done = threading.Event()

        def puller():
            while not done.is_set() or len(pulled) < 200:
                b = plane.pull(timeout=30)
                assert torch.equal(b["obs"][:, 0].long(), b["id"])
                pulled.append(b)
                if len(pulled) >= 200 and done.is_set():
                    break

        ts = [threading.Thread(target=pusher, args=(t,)) for t in range(threads)]
        pt = threading.Thread(target=puller)
        for t in ts:
            t.start()
        pt.start()
        for t in ts:
            t.join()
        done.set()
        pt.join(timeout=60)
        assert not errors and not pt.is_alive()
        plane.flush()
        st_ = plane.stats()
        total = threads * per_thread
        assert st_["pushed_units"] == st_["ingested_units"] == total
        assert st_["pushed_rows"] == st_["ingested_rows"] == total * rows == len(plane.buffer)
        ids = plane.buffer.gather(torch.arange(len(plane.buffer)))["id"]
        assert sorted(ids.tolist()) == list(range(total * rows))  # nothing lost or duplicated
        assert st_["delivered_batches"] >= 200


def test_on_policy_concurrent_actors(small_spec):
    """Several actor threads push one iteration's segments; every row is delivered once."""
    n, actors = 64, 4
    with ExperienceDataPlane(spec=small_spec, capacity=n, mode="on_policy", num_minibatches=4,
                             schedule=Schedule(1, 0.5, 1, 0.25), timeout=20) as plane:
        for it in range(3):
            ts = [threading.Thread(target=plane.push, args=(make_rows(
                small_spec, n // actors, start=it * 1000 + a * 16),),
                kwargs={"policy_version": it}) for a in range(actors)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            ids = torch.cat([mb["id"] for mb in plane.minibatches()]).tolist()
            assert sorted(ids) == list(range(it * 1000, it * 1000 + n))


def test_on_policy_prefetch_depth_is_bounded(small_spec):
    """Overlapped on-policy delivery stages at most two mini-batches of the current iteration."""
    import time
    with ExperienceDataPlane(spec=small_spec, capacity=64, mode="on_policy", num_minibatches=8,
                             schedule=Schedule(1, 1, 1, 0.125), timeout=20) as plane:
        plane.push(make_rows(small_spec, 64), policy_version=0)
        plane.pull()
        time.sleep(0.2)  # give the worker time to run ahead as far as it may
        assert plane.stats()["staged_batches"] <= plane.prefetch_bound == 2
        rest = [plane.pull() for _ in range(7)]
        assert plane.policy_version == 1 and len(rest) == 7


def test_pulls_that_leave_staged_batches_do_not_wake_the_delivery_worker(small_spec):
    """Off-policy, a delivery invocation stages g_del batches and the next runs only once the
    stage is empty: only the pull that empties it wakes the worker, which then refills it."""
    import time
    with ExperienceDataPlane(spec=small_spec, capacity=256, batch_size=8,
                             schedule=Schedule(0, 1, 1, 4), timeout=20) as plane:
        plane.push(make_rows(small_spec, 64))
        deadline = time.monotonic() + 20
        while plane.stats()["staged_batches"] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert plane.stats()["staged_batches"] == 4
        wakes = []
        cond = plane._signals.delivery
        real = cond.notify_all
        cond.notify_all = lambda: (wakes.append(plane.stats()["staged_batches"]), real())[1]
        try:
            for _ in range(3):
                plane.pull()
            assert wakes == [] and plane.stats()["staged_batches"] == 1
            plane.pull()  # empties the stage: the worker is told there is room
            assert len(wakes) == 1
            while plane.stats()["staged_batches"] < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert plane.stats()["staged_batches"] == 4  # refilled after that one wake-up
        finally:
            cond.notify_all = real


def test_on_policy_pulls_wake_the_delivery_worker_once_per_two_mini_batches(small_spec):
    """On-policy with overlapped delivery two mini-batches are staged ahead; a pull wakes the
    worker only when it takes the last staged one, and the worker then stages two again. The
    mini-batches and their order are the sampler's, as without the wake-up rule."""
    import time
    sched = Schedule(1, Fraction(1, 2), 1, Fraction(1, 8))
    rows = make_rows(small_spec, 64)
    with ExperienceDataPlane(spec=small_spec, capacity=64, mode="on_policy",
                             num_minibatches=8, num_epochs=2, schedule=sched, seed=4,
                             timeout=20) as plane:
        plane.push(rows, policy_version=0)
        first = plane.pull()
        deadline = time.monotonic() + 20

        def wait_staged(n):
            while plane.stats()["staged_batches"] < n and time.monotonic() < deadline:
                time.sleep(0.01)
            assert plane.stats()["staged_batches"] == n

        wait_staged(2)
        wakes = []
        cond = plane._signals.delivery
        real = cond.notify_all
        cond.notify_all = lambda: (wakes.append(plane.stats()["staged_batches"]), real())[1]
        got = [first]
        try:
            for k in range(3):
                got.append(plane.pull())  # leaves one staged: no wake-up
                assert wakes == [] and plane.stats()["staged_batches"] == 1, k
                got.append(plane.pull())  # takes the last one: one wake-up, two staged again
                assert len(wakes) == 1
                wakes.clear()
                wait_staged(2)
        finally:
            cond.notify_all = real
        got += [plane.pull() for _ in range(16 - len(got))]
        assert plane.policy_version == 1
    with ExperienceDataPlane(spec=small_spec, capacity=64, mode="on_policy",
                             num_minibatches=8, num_epochs=2, seed=4,
                             schedule=Schedule(0, 1, 0, Fraction(1, 8))) as inline:
        inline.push(rows, policy_version=0)
        want = [inline.pull() for _ in range(16)]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a["id"], b["id"])
