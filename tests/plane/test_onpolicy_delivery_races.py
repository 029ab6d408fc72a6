"""On-policy, overlapped ingestion and delivery: the ingestion worker stages an early-assembled
mini-batch while the delivery worker may draw the next one. An iteration's delivery
invocations still run one at a time, in the layout's order, so the learner gets the same
mini-batches in the same order under every schedule, and a failed invocation's mini-batch is
owed and delivered after ``recover()``.

The interleaving is forced, not hoped for: the ingestion operator writes one row per buffer
write, on a seed whose second mini-batch is complete before its first, so that both are
ready at the moment the first completes; the delivery operator holds the first mini-batch
until another invocation starts (or a deadline passes)."""

import threading

import pytest
import torch

from conduit import EmptyBufferError, ExperienceDataPlane, OperatorError, Schedule
from conduit.spec import ExperienceSpec

CAP, M = 24, 4
SPEC = ExperienceSpec.of(r=((), torch.int64))
HOLD_S = 2.0  # how long the first mini-batch's invocation waits for another to start


def _layout(seed):
    with ExperienceDataPlane(spec=SPEC, capacity=CAP, mode="on_policy", num_minibatches=M,
                             seed=seed, timeout=5) as p:
        return [t.clone() for t in p.buffer.sampler.layout(CAP, iteration=0, epoch=0)]


def _seed_second_before_first():
    """A seed whose second mini-batch's rows all land before the first's last row."""
    for seed in range(100):
        parts = _layout(seed)
        if int(parts[1].max()) < int(parts[0].max()) < CAP - 1:
            return seed, parts
    raise AssertionError("no seed found")  # pragma: no cover


def _plane(seed, *, fail_first):
    """A plane whose first mini-batch's delivery waits for another invocation to start (at
    most HOLD_S), then raises once if ``fail_first``. Returns the plane and the most
    invocations seen running at once."""
    parts = _layout(seed)
    p = ExperienceDataPlane(spec=SPEC, capacity=CAP, mode="on_policy", num_minibatches=M,
                            schedule=Schedule(1, 1, 1, 0.25), seed=seed, timeout=10)
    lock, started = threading.Lock(), threading.Event()
    state = {"running": 0, "most": 0, "held": False}

    @p.register_ingestion()
    def one_row_per_write(actor_in, out):
        rows = actor_in.read()
        for k in range(rows["r"].shape[0]):
            out.write({"r": rows["r"][k:k + 1]})

    @p.register_delivery()
    def deliver(exp_in, learn_out):
        batch = exp_in.read()
        with lock:
            state["running"] += 1
            state["most"] = max(state["most"], state["running"])
            first = not state["held"] and torch.equal(batch["_index"], parts[0])
            state["held"] |= first
            if not first:
                started.set()
        try:
            if first:
                started.wait(HOLD_S)
                if fail_first:
                    raise ValueError("transient delivery failure")
            learn_out.write(batch)
        finally:
            with lock:
                state["running"] -= 1

    return p, state


@pytest.fixture(scope="module")
def seed_and_parts():
    return _seed_second_before_first()


def test_a_failed_early_minibatch_is_delivered_after_recover(seed_and_parts):
    seed, _ = seed_and_parts
    p, state = _plane(seed, fail_first=True)
    try:
        p.push({"r": torch.arange(CAP)}, policy_version=0)
        got, failures = [], 0
        while len(got) < M:
            try:
                got.append(p.pull(timeout=3)["r"].tolist())
            except OperatorError:
                failures += 1
                p.recover()
            except EmptyBufferError as exc:
                pytest.fail(f"a mini-batch was lost (delivered {got}): {exc}")
        assert failures == 1
        assert sorted(r for b in got for r in b) == list(range(CAP))  # each row once an epoch
        assert p.policy_version == 1  # the iteration ended
        assert state["most"] == 1
    finally:
        p.close()


def test_minibatch_order_does_not_depend_on_which_invocation_finishes_first(seed_and_parts):
    seed, parts = seed_and_parts
    with ExperienceDataPlane(spec=SPEC, capacity=CAP, mode="on_policy", num_minibatches=M,
                             schedule=Schedule.inline(num_minibatches=M), seed=seed,
                             timeout=10) as ref_plane:
        ref_plane.push({"r": torch.arange(CAP)}, policy_version=0)
        ref = [b["r"].tolist() for b in ref_plane.minibatches(timeout=5)]
    p, state = _plane(seed, fail_first=False)
    try:
        p.push({"r": torch.arange(CAP)}, policy_version=0)
        batches = list(p.minibatches(timeout=5))
        assert [b["r"].tolist() for b in batches] == ref
        assert [b["_index"].tolist() for b in batches] == [t.tolist() for t in parts]
        assert state["most"] == 1
        assert p.counters["early_batches"] >= 1  # the race's setting: assembled early
    finally:
        p.close()
