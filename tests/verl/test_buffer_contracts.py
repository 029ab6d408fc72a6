"""GRPOBuffer's argument, input and lifecycle contracts: each bad value gets a typed error
from the call that brought it, and the buffer keeps working after a refused put."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import threading  # noqa: E402
import time  # noqa: E402
from fractions import Fraction  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from verl import DataProto  # noqa: E402

from conduit import (  # noqa: E402
    ConfigError,
    EmptyBufferError,
    PlaneClosedError,
    Schedule,
    SpecError,
)
from conduit._checks import check_device  # noqa: E402
from conduit.integrations.verl import GRPOBuffer  # noqa: E402
from conduit.integrations.verl.advantages import (  # noqa: E402
    group_scores,
    group_statistics,
    grpo_group_advantage,
)
from conduit.integrations.verl.order import VerlOrderSampler  # noqa: E402
from tests.verl.conftest import make_step  # noqa: E402


def _buffer(**kw):
    args = {"group_size": 2, "groups_per_step": 2, "mini_batch_size": 2, "placement": None,
            "timeout": 3, **kw}
    return GRPOBuffer(**args)


def _with_rewards(rewards, dtype=torch.float32):
    step = make_step(groups=1, group_size=2)
    r = torch.zeros_like(step.batch["token_level_rewards"], dtype=dtype)
    r[:, 0] = torch.tensor(rewards, dtype=dtype)
    step.batch["token_level_rewards"] = r
    return step


def test_a_non_tensor_entry_changing_shape_is_refused_and_the_buffer_goes_on():
    with _buffer() as buf:
        buf.put(make_step(groups=1, group_size=2, first_uid=0))
        odd = make_step(groups=1, group_size=2, first_uid=1)
        odd.non_tensor_batch["data_source"] = np.array([["digits", "x"]] * 2, dtype=object)
        with pytest.raises(SpecError, match="'data_source'") as err:
            buf.put(odd)
        assert err.value.field == "non_tensor_batch"
        buf.put(make_step(groups=1, group_size=2, first_uid=1))
        mbs = buf.minibatches()
        assert len(mbs) == 2
        assert mbs[1].non_tensor_batch["uid"].tolist() == ["p1", "p1"]


@pytest.mark.parametrize("seed", [2**64, 2**70])
def test_a_seed_beyond_torch_generators_range_is_refused_at_construction(seed):
    with pytest.raises(ConfigError, match="2\\*\\*64") as err:
        _buffer(shuffle=True, seed=seed)
    assert err.value.field == "seed"
    with pytest.raises(ConfigError) as err:
        VerlOrderSampler(num_minibatches=2, shuffle=True, seed=seed)
    assert err.value.field == "seed"


def test_the_largest_seed_is_delivered():
    with _buffer(shuffle=True, seed=2**64 - 1) as buf:
        buf.put(make_step(groups=2, group_size=2))
        assert len(buf.minibatches()) == 2


def test_an_epsilon_that_is_zero_in_float32_is_refused():
    with pytest.raises(ConfigError, match=r"rounds to 0 in torch\.float32") as err:
        _buffer(epsilon=1e-320)
    assert err.value.field == "epsilon"


def test_an_epsilon_that_is_zero_in_the_rewards_dtype_is_refused_at_put():
    with _buffer(groups_per_step=1, epsilon=1e-8) as buf:
        with pytest.raises(ConfigError, match="float16") as err:
            buf.put(_with_rewards((1.0, 1.0), dtype=torch.float16))
        assert err.value.field == "epsilon"
        buf.put(_with_rewards((1.0, 1.0)))  # float32: 1e-8 is fine
        assert torch.isfinite(buf.minibatches()[0].batch["advantages"]).all()


@pytest.mark.parametrize(("rewards", "dtype"), [((3e38, 2e38), torch.float32),
                                                ((60000.0, -60000.0), torch.float16)],
                         ids=["float32-mean", "float16-std"])
def test_scores_whose_statistics_overflow_are_refused(rewards, dtype):
    with _buffer(groups_per_step=1) as buf:
        with pytest.raises(SpecError, match="overflows") as err:
            buf.put(_with_rewards(rewards, dtype=dtype))
        assert err.value.field == "token_level_rewards"
        buf.put(_with_rewards((1.0, 2.0)))
        assert torch.isfinite(buf.minibatches()[0].batch["advantages"]).all()


@pytest.mark.parametrize(("kw", "field"), [
    ({"placement": "bogus"}, "placement"),
    ({"learner_device": "bogus"}, "learner_device"),
    ({"learner_device": 1.5}, "learner_device"),
    ({"schedule": Schedule(0, Fraction(1, 2), 1, Fraction(1, 2))}, "schedule"),
    ({"schedule": "fast"}, "schedule"),
])
def test_plane_arguments_are_checked_at_construction(kw, field):
    with pytest.raises(ConfigError) as err:
        GRPOBuffer(group_size=2, groups_per_step=4, mini_batch_size=2, **kw)
    assert err.value.field == field


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_learner_device_without_cuda_is_refused_at_construction():
    with pytest.raises(ConfigError) as err:
        GRPOBuffer(group_size=2, groups_per_step=4, mini_batch_size=2, learner_device="cuda")
    assert err.value.field == "learner_device"


def test_non_tensor_entries_are_copied_at_put():
    with _buffer(groups_per_step=1) as buf:
        step = make_step(groups=1, group_size=2)
        buf.put(step)
        step.non_tensor_batch["data_source"][:] = "MUTATED"
        mb = buf.minibatches()[0]
        assert mb.non_tensor_batch["data_source"].tolist() == ["digits", "digits"]


def test_minibatches_waits_for_the_next_steps_first_put():
    with _buffer(timeout=5) as buf:
        buf.put(make_step(groups=2, group_size=2, first_uid=0))
        assert len(buf.minibatches()) == 2
        later = threading.Timer(
            0.2, lambda: buf.put(make_step(groups=2, group_size=2, first_uid=10)))
        later.start()
        try:
            mbs = buf.minibatches(timeout=5)
        finally:
            later.join()
        assert [u for mb in mbs for u in mb.non_tensor_batch["uid"]] == ["p10"] * 2 + ["p11"] * 2


def test_minibatches_before_any_put_waits_within_its_timeout():
    with _buffer() as buf, pytest.raises(EmptyBufferError, match="had no groups"):
        buf.minibatches(timeout=0.2)


@pytest.mark.parametrize("put_first", [False, True], ids=["closed-unused", "closed-after-put"])
def test_put_after_close_raises(put_first):
    buf = _buffer()
    if put_first:
        buf.put(make_step(groups=2, group_size=2))
        buf.minibatches()
    buf.close()
    with pytest.raises(PlaneClosedError):
        buf.put(make_step(groups=2, group_size=2, first_uid=5))
    assert put_first or buf.plane is None


def test_an_unhashable_uid_is_refused():
    with _buffer(groups_per_step=1) as buf:
        step = make_step(groups=1, group_size=2)
        uid = np.empty(2, dtype=object)
        uid[0], uid[1] = ["x"], ["x"]
        step.non_tensor_batch["uid"] = uid
        with pytest.raises(SpecError, match="not hashable") as err:
            buf.put(step)
        assert err.value.field == "uid"
        buf.put(make_step(groups=1, group_size=2))
        assert len(buf.minibatches()) == 1


def _overflow_case(gen, dtype, n, k):
    """``k`` groups of ``n`` scores in ``dtype`` (equal, nearly equal, spread, near the
    dtype's largest value, alternating signs near it, or small integers), rows shuffled
    across groups."""
    fmax = torch.finfo(dtype).max
    top = np.log10(fmax)
    scores = []
    for kind in gen.integers(6, size=k):
        sign = gen.choice([-1, 1], size=n)
        if kind == 0:
            scores += [sign[0] * 10 ** gen.uniform(-3, top)] * n
        elif kind == 1:
            scores += list(10 ** gen.uniform(-3, top) * (1 + gen.uniform(-1e-3, 1e-3, size=n)))
        elif kind == 2:
            scores += list(sign * 10 ** gen.uniform(-3, top, size=n))
        elif kind == 3:
            scores += list(sign * fmax * gen.uniform(0.05, 1, size=n))
        elif kind == 4:
            scores += list(np.resize([1, -1], n) * fmax * gen.uniform(0.5, 1, size=n))
        else:
            scores += list(gen.integers(0, 3, size=n).astype(float))
    perm = gen.permutation(n * k)
    s = torch.tensor(scores, dtype=torch.float64).clamp(-fmax, fmax).to(dtype)[perm]
    uid = np.array([f"g{i // n}" for i in range(n * k)], dtype=object)[perm]
    rewards = torch.zeros(n * k, 2, dtype=dtype)
    rewards[:, 0] = s
    return DataProto.from_dict(
        tensors={"token_level_rewards": rewards,
                 "response_mask": torch.ones(n * k, 2, dtype=torch.int64)},
        non_tensors={"uid": uid})


def _first_overflowing_group(step, epsilon, norm_by_std):
    """The first group (in order of appearance) whose statistics or advantages, computed
    one group at a time as ingestion does, are not finite."""
    scores = group_scores(step.batch["token_level_rewards"])
    uid = step.non_tensor_batch["uid"].tolist()
    for u in dict.fromkeys(uid):
        group = scores[[i for i, x in enumerate(uid) if x == u]]
        mean, std = group_statistics(group)
        adv = grpo_group_advantage(group, epsilon=epsilon, norm_by_std=norm_by_std)
        if not (torch.isfinite(mean) and torch.isfinite(adv).all()
                and (torch.isfinite(std) or not norm_by_std)):
            return u
    return None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(("epsilon", "norm_by_std"), [(1e-6, True), ("tiny", True),
                                                      (1e-6, False)],
                         ids=["grpo", "grpo-tiny-epsilon", "dr-grpo"])
def test_put_refuses_exactly_the_groups_whose_advantages_overflow(dtype, epsilon, norm_by_std):
    epsilon = {torch.float16: 1e-7, torch.bfloat16: 1e-39}.get(dtype, 1e-44) \
        if epsilon == "tiny" else epsilon
    gen = np.random.default_rng(7)
    refused = accepted = 0
    for n in (1, 2, 3, 5):
        for _ in range(4):
            step = _overflow_case(gen, dtype, n, k=4)
            if not torch.isfinite(group_scores(step.batch["token_level_rewards"])).all():
                continue
            want = _first_overflowing_group(step, epsilon, norm_by_std)
            with _buffer(group_size=n, groups_per_step=4, mini_batch_size=n, epsilon=epsilon,
                         norm_adv_by_std_in_grpo=norm_by_std) as buf:
                if want is None:
                    buf.put(step)
                    for mb in buf.minibatches():
                        assert torch.isfinite(mb.batch["advantages"]).all()
                    accepted += 1
                else:
                    with pytest.raises(SpecError, match=f"group '{want}': .* overflows"):
                        buf.put(step)
                    refused += 1
    assert refused and accepted


def test_minibatches_waits_one_timeout_for_the_first_put_and_the_first_minibatch():
    with _buffer(timeout=60) as buf:  # two groups a step: the one put never fills it
        buf.put(make_step(groups=2, group_size=2, first_uid=0))
        buf.minibatches()
        half = threading.Timer(1.6, lambda: buf.put(make_step(groups=1, group_size=2,
                                                              first_uid=10)))
        half.start()
        t = time.monotonic()
        try:
            with pytest.raises(EmptyBufferError):
                buf.minibatches(timeout=2)
        finally:
            half.join()
        assert time.monotonic() - t < 3.0  # not 2 s for the put and 2 s more for the batch
        buf.put(make_step(groups=1, group_size=2, first_uid=11))
        mbs = buf.minibatches(timeout=5)  # resumes: the whole step
        assert [u for mb in mbs for u in mb.non_tensor_batch["uid"]] == ["p10"] * 2 + ["p11"] * 2


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta", torch.device("meta"),
                                    "cuda:7", 0, 1.5, None],
                         ids=["cpu", "cpu-device", "meta", "meta-device", "cuda7", "int", "float",
                              "none"])
def test_learner_device_is_taken_or_refused_as_the_plane_does(device):
    """Checked at construction by the plane's own device check, so a device the plane would
    refuse at the first put is refused at once."""
    try:
        check_device("learner_device", device)
    except ConfigError as plane_err:
        with pytest.raises(ConfigError) as err:
            _buffer(learner_device=device)
        assert err.value.field == "learner_device" and str(err.value) == str(plane_err)
    else:
        with _buffer(learner_device=device) as buf:
            buf.put(make_step(groups=2, group_size=2))
            assert len(buf.minibatches()) == 2
