"""GRPO's experience path under failures and bad input: a failed push or ingestion leaves the
path consistent (a retry completes the iteration), arguments are checked before any state
changes, infinite rewards are refused, and every input gets a typed error naming it."""

import math
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

from conduit.errors import ConfigError, OperatorError, PlaneClosedError, SpecError, StateError
from conduit.integrations.grpo import (
    GroupExperiencePath,
    LogProbSource,
    combine_rewards,
    group_advantages,
)
from conduit.scheduling.space import Schedule
from tests.integrations.test_grpo_path import _path as path_of
from tests.integrations.test_grpo_path import _score

G, GROUPS, M = 4, 3, 2
ROWS = G * GROUPS
OVERLAPPED_ING = Schedule(1, Fraction(1, GROUPS), 1, Fraction(1, M))


def _path(**kw):
    return path_of(**{"num_epochs": 1, **kw})  # the other tests' path, for one epoch


def _groups():
    gen = torch.Generator().manual_seed(0)
    out = []
    for g in range(GROUPS):
        lens = torch.randint(1, 9, (G,), generator=gen).tolist()
        out.append(([[1 + g] * (2 + g)] * G, [[10 + g * G + i] * n for i, n in enumerate(lens)]))
    return out


ORDER = torch.randperm(ROWS, generator=torch.Generator().manual_seed(1))
WIDTH = 4


def _clean_batches():
    with _path() as path:
        path.begin_iteration(ORDER, prompt_width=WIDTH)
        for prompts, comps in _groups():
            path.push_group(prompt_ids=prompts, completion_ids=comps)
        return [path.pull() for _ in range(M)], path.advantages.clone()


def _same(batches, want):
    assert len(batches) == len(want)
    for a, b in zip(batches, want):
        assert a.keys() == b.keys()
        assert [k for k in a if not torch.equal(a[k], b[k])] == []


def _flaky(fail_on):
    calls = []

    def score(payload, prompt_ids, completion_ids):
        calls.append(len(completion_ids))
        if len(calls) in fail_on:
            raise RuntimeError("reward server hiccup")
        return _score(payload, prompt_ids, completion_ids)
    return score, calls


# -- a failed push or ingestion ---------------------------------------------------------------


def test_a_scorer_that_raises_loses_its_group_and_a_retry_completes_the_iteration():
    want, want_adv = _clean_batches()
    score, _ = _flaky({2})  # the second group's first scoring fails
    with _path(score=score) as path:
        path.begin_iteration(ORDER, prompt_width=WIDTH)
        groups = _groups()
        path.push_group(prompt_ids=groups[0][0], completion_ids=groups[0][1])
        with pytest.raises(OperatorError, match="hiccup"):
            path.push_group(prompt_ids=groups[1][0], completion_ids=groups[1][1])
        assert path.pushed_groups == 1  # the failed group is not counted
        assert path.recover() is None  # inline: nothing latched
        for prompts, comps in groups[1:]:  # push it again, and the rest
            path.push_group(prompt_ids=prompts, completion_ids=comps)
        _same([path.pull() for _ in range(M)], want)
        assert torch.equal(path.advantages, want_adv)
        path.begin_iteration(ORDER, prompt_width=WIDTH)  # the next iteration begins
        assert path.iteration == 1


def test_a_failed_ingestion_on_the_worker_loses_the_groups_from_it_on():
    want, _ = _clean_batches()
    score, _ = _flaky({2})
    with _path(score=score, schedule=OVERLAPPED_ING) as path:
        path.begin_iteration(ORDER, prompt_width=WIDTH)
        groups = _groups()
        for prompts, comps in groups:
            try:
                path.push_group(prompt_ids=prompts, completion_ids=comps)
            except OperatorError:  # the worker failed before this push: it reports it
                break
        else:
            with pytest.raises(OperatorError, match="hiccup"):
                path.flush()
        assert isinstance(path.recover(), OperatorError)  # the latched error, now cleared
        ingested = path.pushed_groups
        assert ingested < GROUPS  # the failed group and those after it are lost
        assert path.completion_tokens() == sum(len(c) for _, cs in groups[:ingested]
                                               for c in cs)
        for prompts, comps in groups[ingested:]:
            path.push_group(prompt_ids=prompts, completion_ids=comps)
        path.flush()
        _same([path.pull() for _ in range(M)], want)


def test_recover_runs_out_the_withdrawn_pushes_a_slow_worker_still_holds():
    """With a slow scorer the worker may take a push withdrawn with the failed one just as the
    learner recovers: it failed after recover() had returned, latched a new error, and the
    documented retry raised again (then close() reported lost rows). The race is timing
    bound, so it is run many times; each run must complete the iteration."""
    want, _ = _clean_batches()
    for _ in range(25):
        flaky, _ = _flaky({1})

        def score(*args, flaky=flaky):
            time.sleep(0.02)  # a reward model's latency
            return flaky(*args)

        with _path(score=score, schedule=OVERLAPPED_ING, timeout=10) as path:
            path.begin_iteration(ORDER, prompt_width=WIDTH)
            groups = _groups()
            for prompts, comps in groups:
                try:
                    path.push_group(prompt_ids=prompts, completion_ids=comps)
                except OperatorError:
                    break
            with pytest.raises(OperatorError, match="hiccup"):
                path.flush()
            path.recover()
            for prompts, comps in groups[path.pushed_groups:]:
                path.push_group(prompt_ids=prompts, completion_ids=comps)
            path.flush()
            _same([path.pull() for _ in range(M)], want)


def test_begin_iteration_after_close_says_the_path_is_closed():
    path = _path()
    path.close()
    with pytest.raises(PlaneClosedError):
        path.begin_iteration(ORDER, prompt_width=WIDTH)


def test_an_iteration_left_without_groups_can_be_begun_again():
    want, _ = _clean_batches()
    with _path() as path:
        groups = _groups()
        path.begin_iteration(torch.arange(ROWS), prompt_width=1)  # too narrow for the prompts
        with pytest.raises(SpecError, match="prompt_width"):
            path.push_group(prompt_ids=groups[0][0], completion_ids=groups[0][1])
        path.begin_iteration(ORDER, prompt_width=WIDTH)  # restarts it
        assert path.iteration == 0
        for prompts, comps in groups:
            path.push_group(prompt_ids=prompts, completion_ids=comps)
        _same([path.pull() for _ in range(M)], want)


def test_an_iteration_whose_only_push_failed_can_be_begun_again():
    want, _ = _clean_batches()
    score, _ = _flaky({1})
    with _path(score=score) as path:
        groups = _groups()
        path.begin_iteration(torch.arange(ROWS), prompt_width=WIDTH)
        with pytest.raises(OperatorError, match="hiccup"):
            path.push_group(prompt_ids=groups[0][0], completion_ids=groups[0][1])
        path.begin_iteration(ORDER, prompt_width=WIDTH)
        assert path.iteration == 0
        for prompts, comps in groups:
            path.push_group(prompt_ids=prompts, completion_ids=comps)
        _same([path.pull() for _ in range(M)], want)


def test_an_iteration_holding_groups_is_not_begun_again():
    with _path() as path:
        path.begin_iteration(ORDER, prompt_width=WIDTH)
        prompts, comps = _groups()[0]
        path.push_group(prompt_ids=prompts, completion_ids=comps)
        with pytest.raises(StateError, match="still has mini-batches"):
            path.begin_iteration(ORDER, prompt_width=WIDTH)
        assert path.pushed_groups == 1


# -- arguments checked before anything changes -------------------------------------------------


def _state(path):
    return (path.iteration, path._sampler._orders.get(path.iteration), path.pushed_groups,
            len(path.ragged), path._delivery.prompt_width)


@pytest.mark.parametrize("width", [None, "4", math.nan, 4.0, 0, 7, True])
def test_a_bad_prompt_width_is_refused_before_anything_changes(width):
    with _path() as path:
        path.begin_iteration(ORDER, prompt_width=WIDTH)
        prompts, comps = _groups()[0]
        path.push_group(prompt_ids=prompts, completion_ids=comps)
        before = _state(path)
        with pytest.raises(ConfigError) as err:
            path.begin_iteration(torch.arange(ROWS), prompt_width=width)
        assert err.value.field == "prompt_width"
        assert _state(path)[0] == before[0] and torch.equal(_state(path)[1], before[1])
        assert _state(path)[2:] == before[2:]
    with _path() as path:  # and a fresh path stays before its first iteration
        with pytest.raises(ConfigError):
            path.begin_iteration(ORDER, prompt_width=width)
        assert path.iteration == -1
        path.begin_iteration(ORDER, prompt_width=WIDTH)
        for prompts, comps in _groups():
            path.push_group(prompt_ids=prompts, completion_ids=comps)
        assert [int(path.pull()["row"].numel()) for _ in range(M)] == [ROWS // M] * M


@pytest.mark.parametrize("order", [
    torch.arange(ROWS) + 0.7, torch.arange(ROWS, dtype=torch.float64),
    torch.arange(ROWS).view(GROUPS, G), "abc", None, [0.9, *range(1, ROWS)],
    torch.ones(ROWS, dtype=torch.bool), np.arange(ROWS, dtype=np.float32)])
def test_an_order_that_is_not_integer_row_indices_is_refused(order):
    with _path() as path:
        with pytest.raises(SpecError) as err:
            path.begin_iteration(order, prompt_width=WIDTH)
        assert err.value.field == "order"
        assert path.iteration == -1


def test_integer_orders_of_any_kind_are_taken():
    for order in (ORDER.tolist(), ORDER.numpy().astype(np.int32), ORDER.to(torch.int32)):
        with _path() as path:
            path.begin_iteration(order, prompt_width=WIDTH)
            assert torch.equal(path._sampler._orders[0], ORDER)


# -- infinite rewards ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["group", "none"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_infinite_rewards_are_refused(scale, bad):
    with pytest.raises(SpecError, match="infinite") as err:
        group_advantages(torch.tensor([1.0, bad, 3.0, 4.0]), 4, scale=scale)
    assert err.value.field == "rewards"
    big = torch.full((5000,), 1.0)  # the torch path of the check
    big[4321] = bad
    with pytest.raises(SpecError, match="4321"):
        group_advantages(big, 4, scale=scale)
    with pytest.raises(SpecError, match="infinite") as err:
        combine_rewards(torch.tensor([[1.0, bad], [2.0, math.nan]]), torch.tensor([1.0, 0.0]))
    assert err.value.field == "rewards"
    # NaN stays an unscorable completion
    adv = group_advantages(torch.tensor([1.0, math.nan, 3.0, 3.4e38]), 4, scale=scale)
    assert adv[1] == 0.0 and bool(torch.isfinite(adv).all())


def test_a_scorer_returning_inf_fails_ingestion_with_a_typed_error():
    calls = []

    def score(payload, prompt_ids, completion_ids):
        calls.append(1)
        r = _score(payload, prompt_ids, completion_ids)
        if len(calls) == 1:
            r[2] = math.inf
        return r

    want, _ = _clean_batches()
    with _path(score=score) as path:
        path.begin_iteration(ORDER, prompt_width=WIDTH)
        groups = _groups()
        with pytest.raises(OperatorError) as err:
            path.push_group(prompt_ids=groups[0][0], completion_ids=groups[0][1])
        assert isinstance(err.value.__cause__, SpecError)
        assert err.value.__cause__.field == "rewards"
        assert "groups from 0" in str(err.value.__cause__)
        for prompts, comps in groups:  # the group was lost: push it again
            path.push_group(prompt_ids=prompts, completion_ids=comps)
        _same([path.pull() for _ in range(M)], want)


# -- typed errors naming the input --------------------------------------------------------------


@pytest.mark.parametrize(("kw", "field"), [
    ({"pad_token_id": None}, "pad_token_id"), ({"pad_token_id": "x"}, "pad_token_id"),
    ({"pad_token_id": 1 << 63}, "pad_token_id"), ({"pad_token_id": True}, "pad_token_id"),
    ({"pad_token_id": 1.0}, "pad_token_id"),
    ({"max_prompt_length": 0}, "max_prompt_length"),
    ({"max_completion_length": 2.5}, "max_completion_length"),
    ({"group_size": True}, "group_size"), ({"groups": 2.0}, "groups"),
    ({"score": None}, "score"),
    ({"schedule": "overlapped"}, "schedule"), ({"schedule": 1}, "schedule"),
    ({"logprobs": None}, "logprobs"), ({"logprobs": [lambda *a: 0]}, "logprobs[0]"),
    ({"logprobs": [LogProbSource("x", None)]}, "logprobs[0].fn"),
    ({"logprobs": [LogProbSource("x", _score, skip_first=-1)]}, "logprobs[0].skip_first"),
    ({"logprobs": [LogProbSource("x", _score, skip_first=1.5)]}, "logprobs[0].skip_first"),
    ({"logprobs": [LogProbSource("x", _score), LogProbSource("x", _score)]},
     "logprobs[1].key"),
    ({"logprobs": [LogProbSource("advantages", _score)]}, "logprobs[0].key"),
    ({"learner_device": "nodev"}, "learner_device")])
def test_bad_constructor_arguments_are_named(kw, field):
    with pytest.raises(ConfigError) as err:
        _path(**kw)
    assert err.value.field == field


@pytest.mark.parametrize(("rewards", "group_size", "err", "field"), [
    ([1.0, 2.0], 2, SpecError, "rewards"), (np.array([1.0, 2.0]), 2, SpecError, "rewards"),
    (torch.tensor([1, 2]), 2, SpecError, "rewards"),
    (torch.tensor([True, False]), 2, SpecError, "rewards"),
    (torch.tensor([1.0, 2.0]), True, ConfigError, "group_size"),
    (torch.tensor([1.0, 2.0]), 2.0, ConfigError, "group_size")])
def test_group_advantages_inputs_are_checked(rewards, group_size, err, field):
    with pytest.raises(err) as e:
        group_advantages(rewards, group_size)
    assert e.value.field == field


@pytest.mark.parametrize(("per_func", "weights", "field"), [
    ([[1.0, 2.0]], torch.ones(2), "rewards"),
    (torch.ones(2, 2, dtype=torch.int64), torch.ones(2), "rewards"),
    (torch.ones(2, 4), torch.ones(2, 2), "weights"),
    (torch.ones(2, 2), [1.0, 1.0], "weights"),
    (torch.ones(2, 2), torch.tensor([1.0, math.nan]), "weights"),
    (torch.ones(2, 2), torch.tensor([True, True]), "weights"),
    (torch.ones(2, 3), torch.ones(2), "rewards")])
def test_combine_rewards_inputs_are_checked(per_func, weights, field):
    with pytest.raises(SpecError) as err:
        combine_rewards(per_func, weights)
    assert err.value.field == field


def test_integer_weights_are_taken():
    got = combine_rewards(torch.tensor([[1.0, 2.0]]), torch.tensor([1, 2]))
    assert got.tolist() == [5.0]


# -- old log-probs skipped per iteration --------------------------------------------------------


def test_skip_first_may_differ_from_one_iteration_to_the_next():
    skips = {0: 2, 1: 1, 2: 0}
    seen = []

    def skip_first(iteration):
        seen.append(iteration)
        return skips[iteration]

    src = LogProbSource("old_per_token_logps", lambda p, pm, c, cm: c.float(),
                        skip_first=skip_first)
    with _path(logprobs=[src]) as path:
        for it in range(3):
            path.begin_iteration(ORDER, prompt_width=WIDTH)
            for prompts, comps in _groups():
                path.push_group(prompt_ids=prompts, completion_ids=comps)
            carried = ["old_per_token_logps" in path.pull() for _ in range(M)]
            assert carried == [k >= skips[it] for k in range(M)], it
    assert seen == [0, 1, 2]  # once per iteration, as it begins


def test_a_bad_skip_count_is_refused_before_anything_changes():
    src = LogProbSource("old_per_token_logps", lambda p, pm, c, cm: c.float(),
                        skip_first=lambda iteration: -1)
    with _path(logprobs=[src]) as path:
        with pytest.raises(ConfigError) as err:
            path.begin_iteration(ORDER, prompt_width=WIDTH)
        assert err.value.field == "logprobs[0].skip_first"
        assert path.iteration == -1


@pytest.mark.parametrize("returned", [None, [None] * G, "abcd", object(),
                                      torch.tensor([1 + 5j] * G),
                                      [complex(1, 5)] * G])
def test_a_scorer_returning_no_real_numbers_is_named(returned):
    with _path(score=lambda *a: returned) as path:
        path.begin_iteration(ORDER, prompt_width=WIDTH)
        prompts, comps = _groups()[0]
        with pytest.raises(OperatorError) as err:
            path.push_group(prompt_ids=prompts, completion_ids=comps)
        cause = err.value.__cause__
        assert isinstance(cause, SpecError) and cause.field == "rewards"
        assert f"shape ({G},)" in str(cause) and "NaN for an unscorable" in str(cause)
        assert path.pushed_groups == 0


@pytest.mark.parametrize("fn", [lambda *a: None, lambda p, pm, c, cm: [0.0] * c.shape[0],
                                lambda p, pm, c, cm: c, lambda p, pm, c, cm: c[:, :1].float()])
def test_a_log_prob_source_returning_no_per_token_tensor_is_named(fn):
    src = LogProbSource("old_per_token_logps", fn)
    with _path(logprobs=[src]) as path:
        path.begin_iteration(ORDER, prompt_width=WIDTH)
        for prompts, comps in _groups():
            path.push_group(prompt_ids=prompts, completion_ids=comps)
        with pytest.raises(OperatorError) as err:
            path.pull()
        cause = err.value.__cause__
        assert isinstance(cause, SpecError) and cause.field == "old_per_token_logps"
        assert "shaped as completion_ids" in str(cause)


@pytest.mark.parametrize(("kw", "field"), [
    ({"prompt_ids": None}, "prompt_ids"), ({"prompt_ids": 5}, "prompt_ids"),
    ({"completion_ids": None}, "completion_ids"), ({"completion_ids": 5}, "completion_ids")])
def test_push_arguments_that_are_not_sequences_are_named(kw, field):
    with _path() as path:
        path.begin_iteration(ORDER, prompt_width=WIDTH)
        prompts, comps = _groups()[0]
        with pytest.raises(SpecError) as err:
            path.push_group(**{"prompt_ids": prompts, "completion_ids": comps, **kw})
        assert err.value.field == field
        assert path.pushed_groups == 0


@pytest.mark.parametrize("prompts", [
    [[7], [8]] * (G // 2) + [[9]] * G,  # two prompts' completions interleaved in a group
    [[1, 2]] * G + [[3]] * (G - 1) + [[4]],  # groups of two lengths, one token off
    [[1, 2]] * G + [[3, 4]] * (G - 1) + [[3, 5]],  # one length throughout, one token off
    [[1, 2]] * G + [[3, 4]] * (G - 1) + [[3]]])  # one prompt shorter
def test_a_group_must_repeat_one_prompt(prompts):
    comps = [[10 + i] for i in range(len(prompts))]
    with _path() as path:
        path.begin_iteration(ORDER, prompt_width=WIDTH)
        with pytest.raises(SpecError) as err:
            path.push_groups(prompt_ids=prompts, completion_ids=comps)
        assert err.value.field == "prompt_ids" and "share one prompt" in str(err.value)
        assert path.pushed_groups == 0
        good = [[1, 2]] * G + [[3]] * G  # whole groups of several lengths are let through
        path.push_groups(prompt_ids=good, completion_ids=comps)
        assert path.pushed_groups == 2


def test_a_push_before_begin_iteration_or_after_close_is_a_state_error():
    prompts, comps = _groups()[0]
    path = _path()
    with pytest.raises(StateError) as err:
        path.push_group(prompt_ids=prompts, completion_ids=comps)
    assert err.value.key == "begin_iteration" and "call begin_iteration" in str(err.value)
    path.begin_iteration(ORDER, prompt_width=WIDTH)
    path.close()
    with pytest.raises(PlaneClosedError):
        path.push_group(prompt_ids=prompts, completion_ids=comps)


def test_a_push_from_the_scorer_is_refused_instead_of_deadlocking() -> None:
    """The scorer runs inside ingestion, here on a flushing thread while a generator thread
    is inside its own push: a push from the scorer is refused (StateError) rather than waiting
    for the push lock, whose holder waits for that ingestion to end."""
    import threading

    g = 2
    generator_may_push = threading.Event()

    def score(payload, prompts, comps):  # type: ignore[no-untyped-def]
        if payload == "first":
            generator_may_push.set()
            time.sleep(0.3)  # the generator is now inside push_group
            path.push_group(prompt_ids=[[9, 9]] * g, completion_ids=[[3], [4]], payload="x")
        return torch.ones(len(comps))

    path = GroupExperiencePath(group_size=g, groups=4, num_minibatches=2, num_epochs=1,
                               max_prompt_length=4, max_completion_length=4, pad_token_id=0,
                               score=score, timeout=5,
                               schedule=Schedule(0, Fraction(1, 2), 1, Fraction(1, 2)))
    got: dict[str, BaseException | None] = {}

    def run(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            fn()
            got[name] = None
        except BaseException as exc:
            got[name] = exc

    flusher = threading.Thread(target=run, args=("flush", path.flush), daemon=True)
    generator = threading.Thread(target=run, args=("push", lambda: (
        generator_may_push.wait(5),
        path.push_group(prompt_ids=[[2, 2]] * g, completion_ids=[[5], [6]], payload="a"))),
        daemon=True)
    try:
        path.begin_iteration(torch.arange(4 * g), prompt_width=4)
        path.push_group(prompt_ids=[[1, 1]] * g, completion_ids=[[1], [2]], payload="first")
        flusher.start()
        generator.start()
        flusher.join(10)
        generator.join(10)
        assert not flusher.is_alive() and not generator.is_alive(), "deadlocked"
        assert isinstance(got["flush"], OperatorError)
        assert isinstance(got["flush"].__cause__, StateError)
        assert "inside ingestion" in str(got["flush"].__cause__)
    finally:
        if not (flusher.is_alive() or generator.is_alive()):  # a deadlock would hang these
            path.recover()
            path.close()


def test_a_group_after_one_that_failed_unseen_names_that_failure():
    """The next push ran the earlier group's invocation (queued while a save held the
    operators on another thread), whose scorer failed; that failure is not the push's, so its
    own group, which follows the lost one, fails naming it (not "ingested out of order")."""
    import threading

    score, _ = _flaky({2})  # the second scoring call fails
    path = _path(score=score, groups=GROUPS + 1)  # group 2 is not the iteration's last
    groups = [*_groups(), ([[9] * 2] * G, [[40 + i] * 3 for i in range(G)])]
    try:
        path.begin_iteration(torch.arange(G * (GROUPS + 1)), prompt_width=WIDTH)
        path.push_group(prompt_ids=groups[0][0], completion_ids=groups[0][1])

        def push_1() -> None:
            path.push_group(prompt_ids=groups[1][0], completion_ids=groups[1][1])
        with path.plane.frozen(reads=True, flush=False):  # group 1 waits in the queue
            t = threading.Thread(target=push_1)
            t.start()
            t.join(10)
        with pytest.raises(OperatorError) as raised:
            path.push_group(prompt_ids=groups[2][0], completion_ids=groups[2][1])
        cause = raised.value.__cause__
        assert isinstance(cause, StateError) and "push the groups again from group 1" in str(cause)
        assert isinstance(cause.__cause__, RuntimeError)  # the scorer's failure
        assert path.pushed_groups == 1
        path.recover()  # group 1's push returned on another thread: close() would report it
        for g in range(1, GROUPS + 1):
            path.push_group(prompt_ids=groups[g][0], completion_ids=groups[g][1])
        assert len([path.pull() for _ in range(M)]) == M
    finally:
        path.close()
