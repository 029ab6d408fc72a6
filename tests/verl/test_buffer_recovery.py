"""GRPOBuffer keeps every row, and stays usable, when puts and pulls overlap, when a pull
times out, and when a put is refused."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import threading  # noqa: E402
import time  # noqa: E402
from fractions import Fraction  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402

from conduit import EmptyBufferError, Schedule, SpecError  # noqa: E402
from conduit.integrations.verl import GRPOBuffer  # noqa: E402
from tests.verl.conftest import make_step  # noqa: E402

N, GROUPS = 4, 2
# Each mini-batch is assembled as soon as its rows are ingested: delivery overlaps the puts.
EARLY = Schedule(0, Fraction(1, 2), 1, Fraction(1, 2))


def _expected(step):
    """verl's own step: advantages over the whole batch, split into mini-batches of N."""
    adv, ret = compute_grpo_outcome_advantage(
        token_level_rewards=step.batch["token_level_rewards"],
        response_mask=step.batch["response_mask"], index=step.non_tensor_batch["uid"])
    step.batch["advantages"], step.batch["returns"] = adv, ret
    return step.split(N)


def _assert_step(got, step):
    want = _expected(step)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert list(a.non_tensor_batch["uid"]) == list(b.non_tensor_batch["uid"])
        assert [e["turn"] for e in a.non_tensor_batch["extra_info"]] == \
               [e["turn"] for e in b.non_tensor_batch["extra_info"]]
        for k in b.batch.keys():  # noqa: SIM118 - a TensorDict iterates rows
            assert torch.equal(a.batch[k], b.batch[k]), k


def _wait_until(condition, what):
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


def test_minibatches_while_the_rest_of_the_step_is_still_put():
    with GRPOBuffer(group_size=N, groups_per_step=GROUPS, mini_batch_size=N, placement=None,
                    schedule=EARLY, timeout=5) as buf:
        for s in range(2):  # a second step too: the first left nothing behind
            step = make_step(groups=GROUPS, group_size=N, seed=s, first_uid=10 * s)
            buf.put(step.slice(0, N))
            delivered = buf.plane.counters["delivered_batches"]

            def rest(step=step, delivered=delivered):
                # The learner has its first mini-batch (rows of the first group only) before
                # the second group is put.
                _wait_until(lambda: buf.plane.counters["delivered_batches"] > delivered,
                            "the first mini-batch")
                buf.put(step.slice(N, 2 * N))

            rollout = threading.Thread(target=rest)
            rollout.start()
            try:
                got = buf.minibatches()
            finally:
                rollout.join()
            _assert_step(got, step)


def test_a_minibatches_call_that_timed_out_loses_nothing():
    with GRPOBuffer(group_size=N, groups_per_step=GROUPS, mini_batch_size=N, placement=None,
                    schedule=EARLY, timeout=5) as buf:
        step = make_step(groups=GROUPS, group_size=N)
        buf.put(step.slice(0, N))  # half the step: its first mini-batch is ready, not the second
        with pytest.raises(EmptyBufferError):
            buf.minibatches(timeout=0.2)
        buf.put(step.slice(N, 2 * N))
        _assert_step(buf.minibatches(), step)  # the first mini-batch too
        nxt = make_step(groups=GROUPS, group_size=N, seed=5, first_uid=10)
        buf.put(nxt)
        _assert_step(buf.minibatches(), nxt)  # the next step is its own, not shifted


def _integer_rewards(batch):
    batch["token_level_rewards"] = batch["token_level_rewards"].long()


def _reserved_name(batch):
    batch["_private"] = batch["prompts"].clone()


@pytest.mark.parametrize(("spoil", "match", "field"), [
    (_integer_rewards, "floating-point", "token_level_rewards"),
    (_reserved_name, "reserved", "_private")], ids=["integer-rewards", "reserved-name"])
def test_a_bad_group_is_refused_by_the_put_that_brings_it(spoil, match, field):
    with GRPOBuffer(group_size=3, groups_per_step=2, mini_batch_size=3, timeout=5) as buf:
        step = make_step(groups=2, group_size=3)
        bad = step.slice(0, 3)
        spoil(bad.batch)
        with pytest.raises(SpecError, match=match) as err:
            buf.put(bad)
        assert err.value.field == field
        # Nothing of it was kept: the group can be put again, and the step is delivered.
        buf.put(step.slice(0, 3))
        buf.put(step.slice(3, 6))
        assert len(buf.minibatches()) == 2


def test_a_put_whose_push_fails_is_taken_back():
    with GRPOBuffer(group_size=3, groups_per_step=2, mini_batch_size=3, timeout=5) as buf:
        step = make_step(groups=2, group_size=3)
        buf.put(step.slice(0, 3))
        other = step.slice(3, 6)
        other.batch["token_level_rewards"] = other.batch["token_level_rewards"].double()
        with pytest.raises(SpecError) as err:  # the plane refuses a dtype the step lacks
            buf.put(other)
        assert err.value.field == "token_level_rewards"
        buf.put(step.slice(3, 6))  # not "already put": the refused put left no trace
        got = buf.minibatches()
        assert [list(m.non_tensor_batch["uid"]) for m in got] == [["p0"] * 3, ["p1"] * 3]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_rewards_are_refused(value):
    with GRPOBuffer(group_size=3, groups_per_step=1, mini_batch_size=3, timeout=5) as buf:
        step = make_step(groups=1, group_size=3)
        clean = step.batch["token_level_rewards"].clone()
        step.batch["token_level_rewards"][1, 0] = value
        with pytest.raises(SpecError, match=r"response 1 \(group 'p0'\).*must be finite") as err:
            buf.put(step)
        assert err.value.field == "token_level_rewards"
        step.batch["token_level_rewards"] = clean
        buf.put(step)
        (mb,) = buf.minibatches()
        assert bool(torch.isfinite(mb.batch["advantages"]).all())


def test_a_buffer_dropped_without_close_is_collected_with_its_plane_and_threads():
    """Defect: the plane's ingestion operator was the buffer's bound method, so the plane's
    workers kept the buffer, its plane and themselves alive after the buffer was dropped
    without close() (10 buffers: 10 planes and their threads, for good)."""
    import gc
    import weakref

    before = threading.active_count()

    def dropped():
        buf = GRPOBuffer(group_size=N, groups_per_step=GROUPS, mini_batch_size=N,
                         placement=None, timeout=5, schedule=Schedule(1, 1, 1, Fraction(1, 2)))
        buf.put(make_step(groups=GROUPS, group_size=N))
        assert len(list(buf.minibatches())) == 2
        return weakref.ref(buf)

    refs = [dropped() for _ in range(3)]
    gc.collect()
    assert all(r() is None for r in refs)
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert threading.active_count() <= before
