"""GRPO's experience path on an on-policy plane, without any trainer library."""

import math
import threading
import time
from fractions import Fraction

import pytest
import torch

from conduit.errors import ConfigError, OperatorError, SpecError, StateError
from conduit.integrations.grpo import (
    GroupExperiencePath,
    LogProbSource,
    combine_rewards,
    group_advantages,
)
from conduit.scheduling.space import Schedule

G, GROUPS, M = 4, 3, 2


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    adv = group_advantages(r, 4)
    g0 = torch.tensor([1.0, 2.0, 3.0, 6.0])
    want0 = (g0 - g0.mean()) / (g0.std() + 1e-4)  # Bessel-corrected std, as TRL and verl
    assert torch.allclose(adv[:4], want0, atol=1e-6, rtol=0)
    assert adv[4:].tolist() == [0.0] * 4  # a constant group carries no signal
    assert torch.equal(group_advantages(r, 4, scale="none")[:4], g0 - g0.mean())


def test_nan_rewards_are_left_out_and_get_zero_advantage():
    r = torch.tensor([1.0, float("nan"), 3.0, 5.0])
    adv = group_advantages(r, 4)
    kept = torch.tensor([1.0, 3.0, 5.0])
    assert adv[1] == 0.0
    assert torch.allclose(adv[[0, 2, 3]], (kept - 3.0) / (kept.std() + 1e-4), atol=1e-6)
    per_func = torch.tensor([[1.0, float("nan")], [float("nan"), float("nan")]])
    combined = combine_rewards(per_func, torch.tensor([2.0, 1.0]))
    assert combined[0] == 2.0 and math.isnan(combined[1])


@pytest.mark.parametrize(("rewards", "size", "err"), [
    (torch.ones(6), 4, SpecError), (torch.ones(2, 2), 2, SpecError), (torch.ones(0), 2, SpecError),
    (torch.ones(4), 0, ConfigError)])
def test_groups_that_do_not_split_are_refused(rewards, size, err):
    with pytest.raises(err):
        group_advantages(rewards, size)


def _score(payload, prompt_ids, completion_ids):
    return torch.tensor([float(len(c)) for c in completion_ids])


def _path(**kw):
    args = dict(group_size=G, groups=GROUPS, num_minibatches=M, num_epochs=2,
                max_prompt_length=6, max_completion_length=8, pad_token_id=0, score=_score,
                timeout=20)
    return GroupExperiencePath(**{**args, **kw})


def _groups(it):
    gen = torch.Generator().manual_seed(it)
    out = []
    for g in range(GROUPS):
        plen = 2 + g
        prompts = [[1 + g] * plen] * G
        lens = torch.randint(1, 9, (G,), generator=gen).tolist()
        out.append((prompts, [[10 + g * G + i] * n for i, n in enumerate(lens)]))
    return out


def _run(path, iters=2):
    got = []
    for it in range(iters):
        order = torch.randperm(G * GROUPS, generator=torch.Generator().manual_seed(it))
        groups = _groups(it)
        path.begin_iteration(order, prompt_width=max(len(p[0]) for p, _ in groups))
        for prompts, comps in groups:
            path.push_group(prompt_ids=prompts, completion_ids=comps)
        got.append((order, groups, [path.pull() for _ in range(M * 2)]))
    return got


@pytest.mark.parametrize("schedule", [None, Schedule.inline(num_minibatches=M)])
def test_minibatches_follow_the_order_and_pad_to_their_longest(schedule):
    with _path(schedule=schedule) as path:
        for order, groups, batches in _run(path):
            comps = [c for _, cs in groups for c in cs]
            prompts = [p for ps, _ in groups for p in ps]
            parts = torch.tensor_split(order, M)
            for k, mb in enumerate(batches):
                rows = parts[k % M]  # every epoch repeats the iteration's order
                assert torch.equal(mb["row"], rows)
                longest = max(len(comps[r]) for r in rows.tolist())
                assert mb["completion_ids"].shape == (len(rows), longest)
                for i, r in enumerate(rows.tolist()):
                    n = len(comps[r])
                    assert mb["completion_ids"][i, :n].tolist() == comps[r]
                    assert mb["completion_mask"][i].tolist() == [1] * n + [0] * (longest - n)
                    p = prompts[r]
                    width = mb["prompt_ids"].shape[1]
                    assert mb["prompt_ids"][i, width - len(p):].tolist() == p
                    assert mb["prompt_mask"][i].tolist() == [0] * (width - len(p)) + [1] * len(p)
                rewards = torch.tensor([float(len(c)) for c in comps])
                assert torch.equal(mb["advantages"], group_advantages(rewards, G)[rows])


def test_schedules_deliver_the_same_minibatches():
    with _path() as a, _path(schedule=Schedule.inline(num_minibatches=M)) as b:
        for (_, _, xs), (_, _, ys) in zip(_run(a), _run(b)):
            for x, y in zip(xs, ys):
                assert x.keys() == y.keys()
                assert all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize(("group_size", "groups", "m"), [(3, 2, 3), (3, 4, 6), (5, 2, 5)])
def test_default_schedule_fits_groups_that_straddle_minibatches(group_size, groups, m):
    """A group need not end on a mini-batch boundary (TRL: num_generations=3,
    per_device_train_batch_size=2, steps_per_generation=3): the default schedule is still
    feasible and delivers the iteration's rows in order, each once per epoch."""
    rows = group_size * groups
    with _path(group_size=group_size, groups=groups, num_minibatches=m, num_epochs=1) as path:
        assert path.plane.schedule.g_ing <= Fraction(group_size, rows)
        for it in range(2):
            order = torch.randperm(rows, generator=torch.Generator().manual_seed(it))
            path.begin_iteration(order, prompt_width=2)
            comps = [[7 + r] * (1 + (r + it) % 5) for r in range(rows)]
            for g in range(groups):
                path.push_group(prompt_ids=[[1, 2]] * group_size,
                                completion_ids=comps[g * group_size:(g + 1) * group_size])
            got = [path.pull() for _ in range(m)]
            assert torch.equal(torch.cat([mb["row"] for mb in got]), order)
            for mb in got:
                for i, r in enumerate(mb["row"].tolist()):
                    assert mb["completion_ids"][i, :len(comps[r])].tolist() == comps[r]


@pytest.mark.parametrize("epochs", [1, 2])
def test_logprob_sources_run_in_delivery_except_the_skipped_first(epochs):
    seen = []

    def logps(pids, pmask, cids, cmask):
        seen.append(cids.shape[0])
        return cids.to(torch.float32) * 0.5

    src = LogProbSource("old_per_token_logps", logps, skip_first=1)
    with _path(num_epochs=epochs, logprobs=[src]) as path:
        groups = _groups(0)
        path.begin_iteration(torch.arange(G * GROUPS), prompt_width=4)
        for prompts, comps in groups:
            path.push_group(prompt_ids=prompts, completion_ids=comps)
        batches = [path.pull() for _ in range(M * epochs)]
    # A single epoch's first mini-batch is trained under the generating policy: skipped.
    # With more epochs every mini-batch needs them.
    skipped = 1 if epochs == 1 else 0
    assert all("old_per_token_logps" not in mb for mb in batches[:skipped])
    for mb in batches[skipped:]:
        assert torch.equal(mb["old_per_token_logps"], mb["completion_ids"].float() * 0.5)
    assert len(seen) == M * epochs - skipped


def _gated(seen, **kw):
    def logps(pids, pmask, cids, cmask):
        seen.append(threading.current_thread().name)
        return cids.to(torch.float32) * 0.5

    src = LogProbSource("old_per_token_logps", logps, skip_first=1)
    return _path(**{"num_epochs": 1, "logprobs": [src], "gate_prefetch": 30.0, **kw})


def _push_iteration(path, it=0):
    groups = _groups(it)
    order = torch.randperm(G * GROUPS, generator=torch.Generator().manual_seed(it))
    path.begin_iteration(order, prompt_width=max(len(p[0]) for p, _ in groups))
    for prompts, comps in groups:
        path.push_group(prompt_ids=prompts, completion_ids=comps)


def test_gated_prefetch_starts_only_once_the_update_begins():
    seen = []
    with _gated(seen) as path:
        _push_iteration(path)
        first = path.pull()  # assembled by the learner's own pull: needs no log-probs
        time.sleep(0.3)  # the learner's own work between pull and update
        assert seen == [] and "old_per_token_logps" not in first
        path.update_started()
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == ["conduit-delivery"]  # prefetched on the worker during the update
        second = path.pull()
        assert torch.equal(second["old_per_token_logps"], second["completion_ids"].float() * 0.5)


def test_gated_pulls_without_update_started_get_the_same_minibatches():
    seen = []
    with _gated(seen) as gated, _gated([], gate_prefetch=0.0) as plain:
        for it in range(2):
            _push_iteration(gated, it)
            _push_iteration(plain, it)
            for _ in range(M):  # no update_started: a pull that finds nothing lets it go
                x, y = gated.pull(), plain.pull()
                assert x.keys() == y.keys()
                assert all(torch.equal(x[k], y[k]) for k in x)
        assert len(seen) == 2 * (M - 1)


def test_a_gated_delivery_waits_no_longer_than_the_gate(tmp_path):
    seen = []
    with _gated(seen, gate_prefetch=0.2) as path:
        _push_iteration(path)
        path.pull()
        # The learner saves between pull and update: the worker holding the next mini-batch
        # goes on after the gate's bound, so the save's quiesce does not wait for an update.
        info = path.plane.save(tmp_path / "mid.ckpt")
        assert info.path.exists() and info.nbytes > 0
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == ["conduit-delivery"]  # no update_started was ever called
        assert all("old_per_token_logps" in path.pull() for _ in range(M - 1))


def test_close_lets_a_gated_delivery_go():
    seen = []
    path = _gated(seen)
    _push_iteration(path)
    path.pull()
    time.sleep(0.1)  # the worker holds the next mini-batch and waits for update_started
    t0 = time.monotonic()
    path.close()
    assert time.monotonic() - t0 < 10
    assert path.plane.closed


def test_groups_pushed_together_are_scored_once_and_delivered_as_if_pushed_one_by_one():
    calls = []

    def score(payload, prompt_ids, completion_ids):
        calls.append(len(completion_ids))
        return _score(payload, prompt_ids, completion_ids)

    with _path() as one, _path(score=score) as together:
        want = _run(one)
        for it in range(2):
            order = torch.randperm(G * GROUPS, generator=torch.Generator().manual_seed(it))
            groups = _groups(it)
            together.begin_iteration(order, prompt_width=max(len(p[0]) for p, _ in groups))
            together.push_groups(prompt_ids=[p for ps, _ in groups for p in ps],
                                 completion_ids=[c for _, cs in groups for c in cs])
            got = [together.pull() for _ in range(M * 2)]
            for a, b in zip(want[it][2], got):
                assert a.keys() == b.keys()
                assert all(torch.equal(a[k], b[k]) for k in a)
        assert calls == [G * GROUPS, G * GROUPS]  # one scorer call per push


def test_bad_groups_get_typed_errors():
    with _path() as path:
        path.begin_iteration(torch.arange(G * GROUPS), prompt_width=4)
        with pytest.raises(SpecError, match="multiple of group_size=4") as err:
            path.push_group(prompt_ids=[[1]] * 3, completion_ids=[[2]] * 3)
        assert err.value.field == "completion_ids"
        with pytest.raises(SpecError, match="3 prompts for 4 completions") as err:
            path.push_group(prompt_ids=[[1]] * 3, completion_ids=[[2]] * G)
        assert err.value.field == "prompt_ids"
        with pytest.raises(SpecError, match="dtype") as err:
            path.push_group(prompt_ids=[[1]] * G, completion_ids=[[2.5]] * G)
        assert err.value.field == "completion_ids"
        with pytest.raises(SpecError, match="length 0") as err:
            path.push_group(prompt_ids=[[1]] * G, completion_ids=[[2], [], [2], [2]])
        assert err.value.field == "completion_ids"
        with pytest.raises(SpecError, match=r"length 9.*raise max_length"):
            path.push_group(prompt_ids=[[1]] * G, completion_ids=[[2] * 9] * G)
        with pytest.raises(SpecError, match="prompt_width"):
            path.push_group(prompt_ids=[[1] * 5] * G, completion_ids=[[2]] * G)
        with pytest.raises(SpecError, match="permutation"):
            path.begin_iteration(torch.zeros(G * GROUPS, dtype=torch.int64), prompt_width=4)
        for _ in range(GROUPS):
            path.push_group(prompt_ids=[[1]] * G, completion_ids=[[2]] * G)
        with pytest.raises(SpecError, match="holds 3 groups"):
            path.push_group(prompt_ids=[[1]] * G, completion_ids=[[2]] * G)
        with pytest.raises(StateError, match="still has mini-batches"):
            path.begin_iteration(torch.arange(G * GROUPS), prompt_width=4)


def test_a_scorer_of_the_wrong_shape_fails_ingestion():
    with _path(score=lambda payload, p, c: torch.zeros(G + 1)) as path:
        path.begin_iteration(torch.arange(G * GROUPS), prompt_width=4)
        with pytest.raises(OperatorError, match="scorer returned shape"):
            path.push_group(prompt_ids=[[1]] * G, completion_ids=[[2]] * G)
        path.plane.recover()  # the failed group is lost; closing is clean


def test_tokens_out_of_step_with_the_buffer_fail_ingestion():
    with _path() as path:
        path.begin_iteration(torch.arange(G * GROUPS), prompt_width=4)
        path.ragged.extend({"prompt_ids": [[1]], "completion_ids": [[2]]})  # a stray row
        with pytest.raises(OperatorError, match="out of order"):
            path.push_group(prompt_ids=[[1]] * G, completion_ids=[[2]] * G)
        path.plane.recover()


@pytest.mark.parametrize("pad", ["minibatch", "iteration"])
def test_iteration_padding_waits_for_the_iterations_longest_completion(pad):
    """The first mini-batch's rows land before the last group; padded to the iteration, it
    must still be as wide as the longest completion of the whole iteration."""
    groups = [([[1, 2]] * G, [[10 + g * G + i] * (1 + i % 2) for i in range(G)])
              for g in range(GROUPS - 1)]
    groups.append(([[3, 4]] * G, [[50 + i] * 8 for i in range(G)]))
    first_rows = G * GROUPS // M  # the first mini-batch: rows 0..5, in the first two groups
    assert first_rows <= G * (GROUPS - 1)
    with _path(pad_completions_to=pad, num_epochs=1) as path:
        path.begin_iteration(torch.arange(G * GROUPS), prompt_width=2)
        for prompts, comps in groups[:-1]:
            path.push_group(prompt_ids=prompts, completion_ids=comps)
        got = []
        puller = threading.Thread(target=lambda: got.append(path.pull()))
        puller.start()
        puller.join(0.5)
        waited = puller.is_alive()
        path.push_group(prompt_ids=groups[-1][0], completion_ids=groups[-1][1])
        puller.join(20)
        assert got, "the first mini-batch never came"
        rest = path.pull()
        width = got[0]["completion_ids"].shape[1]
        if pad == "iteration":
            assert waited  # nothing is delivered before the iteration's last row landed
            assert width == rest["completion_ids"].shape[1] == 8
            assert path.plane.counters["early_batches"] == 0
        else:  # each mini-batch is padded to its own longest; the first may come early
            assert width == 2 and rest["completion_ids"].shape[1] == 8
        assert got[0]["row"].tolist() == list(range(first_rows))


@pytest.mark.parametrize(("kw", "field"), [
    ({"num_minibatches": 5}, "num_minibatches"), ({"scale_rewards": "batch"}, "scale_rewards"),
    ({"group_size": 0}, "group_size"), ({"pad_completions_to": "max"}, "pad_completions_to"),
    ({"gate_prefetch": -1.0}, "gate_prefetch"), ({"gate_prefetch": True}, "gate_prefetch"),
    ({"gate_prefetch": math.nan}, "gate_prefetch")])
def test_bad_configuration(kw, field):
    with pytest.raises(ConfigError) as err:
        _path(**kw)
    assert err.value.field == field


def test_concurrent_pushes_ingest_every_row_once_in_row_order():
    """Generator threads pushing one group each: a push's rows are reserved and queued as one
    step, so the plane ingests the pushes in row order. Each plane.push is delayed by a
    random few milliseconds, so that without that a later push would often be queued first
    (and fail as ingested out of order, losing the groups after it)."""
    import random

    groups, g = 16, 2
    for trial in range(3):
        path = _path(group_size=g, groups=groups, num_minibatches=2, num_epochs=1,
                     max_prompt_length=2, max_completion_length=2, timeout=20,
                     score=lambda pl, p, c: torch.tensor([float(x[0]) for x in c]))
        push, rng = path.plane.push, random.Random(trial)
        delays = [rng.uniform(0, 0.004) for _ in range(groups)]

        def slow_push(*a, delays=delays, push=push, **k):
            time.sleep(delays.pop())
            return push(*a, **k)

        path.plane.push = slow_push
        errors = []
        with path:
            path.begin_iteration(torch.randperm(path.rows), prompt_width=1)

            def one(i, path=path, errors=errors):
                try:
                    path.push_group(prompt_ids=[[i + 1]] * g,
                                    completion_ids=[[i * 10 + c] for c in range(g)])
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(groups)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            assert path.pushed_groups == groups
            batches = [path.pull() for _ in range(2)]
            rows = torch.cat([b["row"] for b in batches])
            assert sorted(rows.tolist()) == list(range(path.rows))  # each row once
            for b in batches:  # each completion next to its own prompt
                prompt, comp = b["prompt_ids"][:, -1], b["completion_ids"][:, 0]
                assert torch.equal(comp // 10, prompt - 1)
            assert not torch.isnan(path.rewards).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nan", [False, True])
def test_low_precision_rewards_keep_their_dtype_and_trl_values(dtype, nan):
    # TRL's nanstd applies the Bessel correction in place, so the variance keeps the rewards'
    # dtype; the same steps, written out here
    rewards = torch.tensor([0.3, 1.7, 2.2, 0.9, 5.0, 4.1, 4.4, 3.3], dtype=dtype)
    if nan:
        rewards[1] = float("nan")
    grouped = rewards.view(-1, 4)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    variance = torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True)
    count = torch.sum(~torch.isnan(grouped), dim=1, keepdim=True)
    variance *= count / (count - 1)
    want = torch.nan_to_num(((grouped - mean) / (torch.sqrt(variance) + 1e-4)).reshape(-1),
                            nan=0.0)
    got = group_advantages(rewards, group_size=4)
    assert got.dtype == dtype
    assert torch.equal(got, want)
