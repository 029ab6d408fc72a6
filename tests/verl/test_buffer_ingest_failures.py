"""GRPOBuffer after its ingestion operator fails: the step holds exactly the groups the plane
stored, the plane is usable again, the caller is told which groups to put again, and once
they are put the step's mini-batches are those of a run without the failure. Also: a
``minibatches()`` before any put waits, ``meta_info`` must not change within a step, and a
reward on the ``meta`` device is refused by name."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import threading  # noqa: E402
from collections import deque  # noqa: E402
from fractions import Fraction  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from verl import DataProto  # noqa: E402

from conduit import ConfigError, EmptyBufferError, OperatorError, Schedule, SpecError  # noqa: E402
from conduit.integrations.verl import GRPOBuffer, LostGroupsError  # noqa: E402
from tests.verl.conftest import make_step  # noqa: E402

N, GROUPS = 2, 4  # 8 rows a step, 4 mini-batches of 2
Q = Fraction(1, 4)
SCHEDULES = {
    "inline-whole-step": None,  # one ingestion invocation over the step's 4 puts
    "inline-per-put": Schedule(0, Q, 0, Q),
    "overlapped-ingestion": Schedule(1, Q, 0, Q),
    "overlapped-both": Schedule(1, Q, 1, Q),
}


def _buffer(schedule):
    return GRPOBuffer(group_size=N, groups_per_step=GROUPS, mini_batch_size=N, epochs=2,
                      shuffle=True, seed=7, placement=None, schedule=schedule, timeout=10)


def _groups(seed=0, first_uid=0):
    step = make_step(groups=GROUPS, group_size=N, seed=seed, first_uid=first_uid)
    return {f"p{first_uid + g}": step.slice(g * N, (g + 1) * N) for g in range(GROUPS)}


def _fail_on(buf, calls, exc=MemoryError):
    """Make the buffer's ingestion raise ``exc`` on its advantage calls numbered ``calls``."""
    original, seen = buf._with_advantages, [0]

    def flaky(unit):
        seen[0] += 1
        if seen[0] in calls:
            raise exc("injected ingestion failure")
        return original(unit)

    buf._with_advantages = flaky
    return seen


def _put_all(buf, groups, todo, errors) -> None:
    """Put the groups ``todo`` names, in order, putting again (first) those a
    LostGroupsError names; the errors are appended to ``errors``."""
    todo = deque(todo)
    while todo:
        uid = todo.popleft()
        try:
            buf.put(groups[uid])
        except LostGroupsError as e:
            errors.append(e)
            todo = deque([*e.uids, *todo])


def _fill_and_deliver(buf, groups):
    """Put every group, putting again those a LostGroupsError names, then the step's
    mini-batches; returns them and every error met."""
    errors = []
    todo = list(groups)
    while True:
        _put_all(buf, groups, todo, errors)
        try:
            return buf.minibatches(), errors
        except LostGroupsError as e:
            errors.append(e)
            todo = list(e.uids)


def _reference(schedule, seeds):
    with _buffer(schedule) as buf:
        return [_fill_and_deliver(buf, _groups(s, 10 * s))[0] for s in seeds]


def _assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert list(a.non_tensor_batch["uid"]) == list(b.non_tensor_batch["uid"])
        assert [e["turn"] for e in a.non_tensor_batch["extra_info"]] == \
               [e["turn"] for e in b.non_tensor_batch["extra_info"]]
        assert set(a.batch.keys()) == set(b.batch.keys())
        for k in b.batch.keys():  # noqa: SIM118 - a TensorDict iterates rows
            assert torch.equal(a.batch[k], b.batch[k]), k


@pytest.mark.parametrize("fail_at", [1, 2, 4], ids=["first", "middle", "last"])
@pytest.mark.parametrize("schedule", list(SCHEDULES.values()), ids=list(SCHEDULES))
def test_the_groups_named_again_give_the_step_of_a_run_without_the_failure(schedule, fail_at):
    want = _reference(schedule, seeds=(0, 1))
    with _buffer(schedule) as buf:
        seen = _fail_on(buf, {fail_at})
        first, errors = _fill_and_deliver(buf, _groups(0, 0))
        assert seen[0] > fail_at  # the failure happened, and the groups were ingested again
        assert errors and all(e.uids for e in errors)
        assert isinstance(errors[0], OperatorError)
        assert isinstance(errors[0].__cause__, MemoryError)
        _assert_same(first, want[0])
        second, errors = _fill_and_deliver(buf, _groups(1, 10))  # the plane is usable
        assert not errors
        _assert_same(second, want[1])
        assert buf.plane.failed is None


@pytest.mark.parametrize("fail_at", [1, 2, 4], ids=["first", "middle", "last"])
def test_inline_whole_step_every_group_of_the_failed_invocation_is_named(fail_at):
    with _buffer(None) as buf:
        _fail_on(buf, {fail_at})
        groups = _groups()
        for uid in ["p0", "p1", "p2"]:
            buf.put(groups[uid])  # queued: the step's last put runs the invocation
        with pytest.raises(LostGroupsError) as err:
            buf.put(groups["p3"])
        # The rows written before the failure were taken back: every group is put again.
        assert err.value.uids == ["p0", "p1", "p2", "p3"]
        assert (err.value.lost_units, err.value.lost_rows) == (4, 8)
        with pytest.raises(EmptyBufferError):
            buf.minibatches(timeout=0.2)
        for uid in err.value.uids:  # not refused as "already put"
            buf.put(groups[uid])
        assert len(buf.minibatches()) == 2 * GROUPS


@pytest.mark.parametrize("fail_at", [1, 2, 4], ids=["first", "middle", "last"])
def test_inline_per_put_only_the_failed_put_is_named(fail_at):
    with _buffer(SCHEDULES["inline-per-put"]) as buf:
        _fail_on(buf, {fail_at})
        groups = _groups()
        for i, uid in enumerate(groups, start=1):
            if i == fail_at:
                with pytest.raises(LostGroupsError) as err:
                    buf.put(groups[uid])
                assert err.value.uids == [uid]
                buf.put(groups[uid])
            else:
                buf.put(groups[uid])
        assert len(buf.minibatches()) == 2 * GROUPS


def test_rows_the_failed_invocation_stored_stay_and_their_groups_are_not_named(monkeypatch):
    want = _reference(None, seeds=(0,))[0]
    with _buffer(None) as buf:
        _fail_on(buf, {3})
        groups = _groups()
        for uid in ["p0", "p1", "p2"]:
            buf.put(groups[uid])

        def refuse(n):
            raise ConfigError("n", "rows cannot be taken back here")

        monkeypatch.setattr(buf.plane.buffer, "drop_newest", refuse)
        with pytest.raises(LostGroupsError) as err:
            buf.put(groups["p3"])
        assert err.value.uids == ["p2", "p3"]  # p0 and p1 were written and stay
        assert buf.plane.stats()["size"] == 2 * N
        with pytest.raises(SpecError, match="already put"):
            buf.put(groups["p0"])
        for uid in err.value.uids:
            buf.put(groups[uid])
        _assert_same(buf.minibatches(), want)


@pytest.mark.parametrize("schedule", [None, SCHEDULES["overlapped-ingestion"]],
                         ids=["inline", "overlapped"])
def test_minibatches_that_meets_the_failure_names_the_groups(schedule):
    want = _reference(schedule, seeds=(0,))[0]
    with _buffer(schedule) as buf:
        groups = _groups()
        go = threading.Event()
        original, seen = buf._with_advantages, [0]

        def gated(unit):  # ingests nothing before every put has returned; then fails once
            go.wait(10)
            seen[0] += 1
            if seen[0] == 2:
                raise MemoryError("injected ingestion failure")
            return original(unit)

        buf._with_advantages = gated
        puts = ["p0", "p1", "p2"] if schedule is None else list(groups)
        for uid in puts:  # inline: the learner's wait ingests the three queued puts
            buf.put(groups[uid])
        go.set()
        with pytest.raises(LostGroupsError) as err:
            buf.minibatches(timeout=5)
        assert err.value.uids and set(err.value.uids) <= set(puts)
        assert buf.plane.failed is None
        for uid in [*err.value.uids, *(u for u in groups if u not in puts)]:
            buf.put(groups[uid])
        _assert_same(buf.minibatches(), want)


def test_a_failure_settled_by_the_putting_thread_while_the_learner_waits(monkeypatch):
    """The learner waits in minibatches() on the step whose groups a put on another thread
    loses (inline, so the learner's pull sees no failure); the groups put again complete that
    same step, and the learner gets it whole."""
    want = _reference(None, seeds=(0,))[0]
    with _buffer(None) as buf:
        groups = _groups()
        ingesting, go = threading.Event(), threading.Event()
        original, seen = buf._with_advantages, [0]

        def gated(unit):
            seen[0] += 1
            if seen[0] == 1:  # the step's invocation, run by the last put
                ingesting.set()
                go.wait(10)
                raise MemoryError("injected ingestion failure")
            return original(unit)

        buf._with_advantages = gated
        errors = []

        putter = threading.Thread(target=_put_all, args=(buf, groups, list(groups), errors))
        putter.start()
        try:
            assert ingesting.wait(10)
            pull = buf.plane.pull

            def pull_then_fail(**kw):  # the learner holds the step: now the put fails
                go.set()
                return pull(**kw)

            monkeypatch.setattr(buf.plane, "pull", pull_then_fail)
            got = buf.minibatches(timeout=10)
        finally:
            go.set()
            putter.join()
        assert [e.uids for e in errors] == [["p0", "p1", "p2", "p3"]]
        _assert_same(got, want)


def test_an_interrupted_ingestion_raises_the_interrupt_naming_the_groups():
    want = _reference(None, seeds=(0,))[0]
    with _buffer(None) as buf:
        _fail_on(buf, {2}, exc=KeyboardInterrupt)
        groups = _groups()
        for uid in ["p0", "p1", "p2"]:
            buf.put(groups[uid])
        with pytest.raises(KeyboardInterrupt) as err:
            buf.put(groups["p3"])
        assert any("['p0', 'p1', 'p2', 'p3']" in note for note in err.value.__notes__)
        for uid in groups:
            buf.put(groups[uid])
        _assert_same(buf.minibatches(), want)


def test_minibatches_before_the_first_put_waits_for_it():
    with _buffer(None) as buf:
        with pytest.raises(EmptyBufferError):
            buf.minibatches(timeout=0.1)
        groups = _groups()

        def put_all():
            for g in groups.values():
                buf.put(g)

        later = threading.Timer(0.2, put_all)
        later.start()
        try:
            mbs = buf.minibatches(timeout=10)
        finally:
            later.join()
        assert len(mbs) == 2 * GROUPS
        with pytest.raises(ConfigError) as err:
            GRPOBuffer(group_size=N, groups_per_step=GROUPS,
                       mini_batch_size=N).minibatches(timeout=-1)
        assert err.value.field == "timeout"


def test_a_later_put_with_another_meta_info_is_refused():
    with _buffer(None) as buf:
        groups = _groups()
        buf.put(groups["p0"])
        other = groups["p1"]
        other.meta_info["temperature"] = 0.5
        with pytest.raises(SpecError, match="'temperature'") as err:
            buf.put(other)
        assert err.value.field == "meta_info"
        other.meta_info["temperature"] = 1.0
        for uid in ["p1", "p2", "p3"]:
            buf.put(groups[uid])
        assert all(mb.meta_info == {"temperature": 1.0} for mb in buf.minibatches())


def test_a_reward_on_the_meta_device_is_refused_by_name():
    with _buffer(None) as buf:
        group = _groups()["p0"]
        group.batch["token_level_rewards"] = torch.empty(N, 6, device="meta")
        with pytest.raises(SpecError) as err:
            buf.put(group)
        assert err.value.field == "token_level_rewards"


def test_the_puts_meta_info_is_merged_as_dataproto_concat_merges_it():
    """A step's puts may carry other keys and their own metrics (one rollout worker's each):
    every mini-batch carries what DataProto.concat of the puts gives."""
    with _buffer(None) as buf:
        groups = _groups()
        puts = [groups[uid] for uid in ["p0", "p1", "p2", "p3"]]
        for k, group in enumerate(puts):  # (the groups were split from one DataProto)
            group.meta_info = {**group.meta_info, "metrics": {"gen_s": float(k)}}
        puts[2].meta_info["global_steps"] = 7
        for group in puts:
            buf.put(group)
        want = DataProto.concat(puts).meta_info
        assert want["metrics"] == {"gen_s": [0.0, 1.0, 2.0, 3.0]} and want["global_steps"] == 7
        assert all(mb.meta_info == want for mb in buf.minibatches())
