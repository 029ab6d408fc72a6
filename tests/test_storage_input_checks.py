"""Bad input to the storage layer is refused by the call that brings it, with a typed error
naming the argument, and a refused state changes nothing."""

import warnings

import numpy as np
import pytest
import torch

from conduit import ConfigError, PlacementError, PriorityError, StateError
from conduit.spec import ExperienceSpec
from conduit.storage import (
    ExperienceBuffer,
    FifoSampler,
    Placement,
    PrioritizedSampler,
    SequenceSampler,
    UniformSampler,
)
from tests.conftest import make_rows

# -- SequenceSampler.boundary_key --------------------------------------------------------------


def test_sequence_sampler_without_its_boundary_field_is_refused_by_the_buffer():
    spec = ExperienceSpec.of(id=((), torch.int64), terminated=((), torch.bool))  # no "done"
    with pytest.raises(ConfigError, match="boundary_key") as err:
        ExperienceBuffer(spec=spec, capacity=8, sampler=SequenceSampler(length=2))
    assert err.value.field == "boundary_key"
    with pytest.raises(ConfigError) as err:
        ExperienceBuffer(spec=spec, capacity=8, sampler=SequenceSampler(length=2, boundary_key=3))
    assert err.value.field == "boundary_key"
    # Naming a field the spec has is accepted, and the buffer works.
    buf = ExperienceBuffer(spec=spec, capacity=8,
                           sampler=SequenceSampler(length=2, boundary_key="terminated"))
    buf.extend({"id": torch.arange(4), "terminated": torch.zeros(4, dtype=torch.bool)})
    assert buf.sample(3)["id"].shape == (3, 2)


# -- a refused load_state_dict changes nothing -------------------------------------------------


def _prioritized_buffer(spec):
    buf = ExperienceBuffer(spec=spec, capacity=16, sampler=PrioritizedSampler(seed=1))
    buf.extend(make_rows(spec, 16))
    return buf


def _uniform_buffer(spec):
    # Without replacement the draws come from the NumPy generator that a load restores first.
    buf = ExperienceBuffer(spec=spec, capacity=16,
                           sampler=UniformSampler(replacement=False, seed=1))
    buf.extend(make_rows(spec, 16))
    return buf


def _nan_leaf(state):
    state["sampler"]["tree"]["leaves"][3] = float("nan")


def _bad_draws(state):
    state["sampler"]["draws"] = torch.zeros(3, dtype=torch.uint8)


@pytest.mark.parametrize(("make", "corrupt"), [(_prioritized_buffer, _nan_leaf),
                                               (_uniform_buffer, _bad_draws)],
                         ids=["prioritized", "uniform"])
def test_refused_sampler_state_leaves_the_generator_untouched(small_spec, make, corrupt):
    untouched, refused, other = make(small_spec), make(small_spec), make(small_spec)
    other.sample(8)
    other.sample(8)  # its generator is elsewhere
    state = other.state_dict()
    corrupt(state)
    with pytest.raises(StateError):
        refused.load_state_dict(state)
    assert refused.sampler.state_dict()["rng"] == untouched.sampler.state_dict()["rng"]
    for _ in range(3):
        assert torch.equal(refused.sample(8)["_index"], untouched.sample(8)["_index"])


class _HalfLoadingSampler(UniformSampler):
    """Loads its generator, then refuses: a sampler that does not check before it changes."""

    def load_state_dict(self, state):
        super().load_state_dict(state)
        raise StateError("sampler.extra", "refused after loading the generator")


def test_buffer_puts_back_a_sampler_that_refuses_part_way(small_spec):
    def make():
        buf = ExperienceBuffer(spec=small_spec, capacity=16,
                               sampler=_HalfLoadingSampler(replacement=False, seed=1))
        buf.extend(make_rows(small_spec, 16))
        return buf
    untouched, refused, other = make(), make(), make()
    other.sample(8)
    with pytest.raises(StateError, match="extra"):
        refused.load_state_dict(other.state_dict())
    assert refused.sampler.state_dict()["rng"] == untouched.sampler.state_dict()["rng"]
    assert torch.equal(refused.sample(8)["_index"], untouched.sample(8)["_index"])


# -- PrioritizedSampler's exponents ------------------------------------------------------------


@pytest.mark.parametrize("name", ["alpha", "beta", "eps"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), True, "1"])
def test_prioritized_sampler_needs_finite_exponents(name, value):
    with pytest.raises(ConfigError) as err:
        PrioritizedSampler(**{name: value})
    assert err.value.field == name


def test_prioritized_sampler_refuses_exponents_that_leave_float_range():
    with pytest.raises(ConfigError, match="lower alpha or raise eps") as err:
        PrioritizedSampler(alpha=60, eps=1e-6)  # eps ** alpha = 1e-360 underflows to 0
    assert err.value.field == "alpha"
    with pytest.raises(ConfigError, match="lower alpha") as err:
        PrioritizedSampler(alpha=2000, eps=1.0)  # (1 + eps) ** alpha overflows
    assert err.value.field == "alpha"
    PrioritizedSampler(alpha=50, eps=1e-6)  # 1e-300 is still a float: accepted


def test_prioritized_sampler_with_a_small_beta_takes_priorities(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=8, sampler=PrioritizedSampler(beta=1e-3))
    buf.extend(make_rows(small_spec, 8))
    batch = buf.sample(4)
    assert buf.update_priorities(batch["_index"], torch.full((4,), 2.0)) == 4
    assert torch.isfinite(buf.sample(4)["_weight"]).all()


# -- priorities that are not real numbers ------------------------------------------------------


def test_complex_priorities_are_refused(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=8, sampler=PrioritizedSampler())
    buf.extend(make_rows(small_spec, 8))
    before = buf.sampler.priorities(torch.arange(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ComplexWarning either
        with pytest.raises(PriorityError, match="priorities"):
            buf.update_priorities(torch.tensor([0, 1]), torch.tensor([1 + 1j, 2 + 0j]))
    assert torch.equal(buf.sampler.priorities(torch.arange(8)), before)


@pytest.mark.parametrize("priorities", [[None, 1.0], ["a", "b"], np.array([1j, 2j])],
                         ids=["None", "text", "complex"])
def test_sampler_refuses_priorities_that_are_not_real_numbers(priorities):
    sampler = PrioritizedSampler()
    sampler.bind(8)
    with pytest.raises(PriorityError, match="priorities"):
        sampler.update_priorities(torch.tensor([0, 1]), priorities)


@pytest.mark.parametrize(("indices", "priorities", "field"), [
    (None, [1.0], "indices"), ("ab", [1.0, 2.0], "indices"), ([[0], [1, 2]], [1.0], "indices"),
    ([0, 1], None, "priorities"), ([0, 1], ["a", "b"], "priorities"),
    ([0, 1], object(), "priorities")],
    ids=["None-indices", "text-indices", "ragged-indices", "None", "text", "object"])
def test_buffer_refuses_priority_updates_that_are_not_numbers(small_spec, indices, priorities,
                                                              field):
    buf = ExperienceBuffer(spec=small_spec, capacity=8, sampler=PrioritizedSampler())
    buf.extend(make_rows(small_spec, 8))
    buf.sample(4)
    before = buf.sampler.priorities(torch.arange(8))
    with pytest.raises(PriorityError, match=f"^{field}: must be a tensor"):
        buf.update_priorities(indices, priorities)
    assert torch.equal(buf.sampler.priorities(torch.arange(8)), before)
    # The buffer goes on taking updates.
    assert buf.update_priorities([0, 1], [3.0, 4.0]) == 2


# -- ExperienceBuffer.sample(batch_size) -------------------------------------------------------


@pytest.mark.parametrize("batch_size", [True, 2.5, "3", None, 0, -1, np.int64(0), 2**31])
@pytest.mark.parametrize("rows", [0, 4])
def test_sample_needs_a_positive_integer_batch_size(small_spec, batch_size, rows):
    buf = ExperienceBuffer(spec=small_spec, capacity=8)
    if rows:
        buf.extend(make_rows(small_spec, rows))
    with pytest.raises(ConfigError) as err:
        buf.sample(batch_size)
    assert err.value.field == "batch_size"


@pytest.mark.parametrize("batch_size", [True, 2.5, "3", None, 0, -1])
def test_draw_needs_a_positive_integer_batch_size(small_spec, batch_size):
    buf = ExperienceBuffer(spec=small_spec, capacity=8)
    buf.extend(make_rows(small_spec, 4))
    with pytest.raises(ConfigError) as err:
        buf.draw(batch_size)
    assert err.value.field == "batch_size"
    assert buf.draw(np.int64(3)).indices.shape == (3,)


def test_sample_takes_numpy_integers(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=8)
    buf.extend(make_rows(small_spec, 4))
    assert buf.sample(np.int64(3))["id"].shape == (3,)


# -- ExperienceBuffer(threads=) ----------------------------------------------------------------


@pytest.mark.parametrize("threads", [0, -1, 2.5, True, "2", None])
def test_buffer_needs_a_positive_integer_thread_count(small_spec, threads):
    with pytest.raises(ConfigError) as err:
        ExperienceBuffer(spec=small_spec, capacity=8, threads=threads)
    assert err.value.field == "threads"


def test_buffer_takes_a_numpy_thread_count(small_spec):
    buf = ExperienceBuffer(spec=small_spec, capacity=8, threads=np.int64(2))
    assert buf.threads == 2 and type(buf.threads) is int
    buf.extend(make_rows(small_spec, 4))
    assert buf.sample(2)["id"].shape == (2,)


# -- sampler seeds -----------------------------------------------------------------------------


@pytest.mark.parametrize("make", [UniformSampler, PrioritizedSampler, FifoSampler,
                                  lambda **kw: SequenceSampler(length=2, **kw)],
                         ids=["uniform", "prioritized", "fifo", "sequence"])
@pytest.mark.parametrize("seed", [-1, 1.5, True, "1", None])
def test_samplers_need_a_non_negative_integer_seed(make, seed):
    with pytest.raises(ConfigError) as err:
        make(seed=seed)
    assert err.value.field == "seed"


def test_sampler_takes_a_numpy_seed(small_spec):
    def ids(seed):
        buf = ExperienceBuffer(spec=small_spec, capacity=16, sampler=UniformSampler(seed=seed))
        buf.extend(make_rows(small_spec, 16))
        return buf.sample(8)["id"]
    assert UniformSampler(seed=np.int64(3)).config() == {"seed": 3, "replacement": True}
    assert torch.equal(ids(np.int64(3)), ids(3))


# -- Placement.sharded(shares=) ----------------------------------------------------------------


@pytest.mark.parametrize("shares", [(float("nan"), float("nan")), (float("inf"), float("-inf")),
                                    (0.0, 1.0), (-0.5, 1.5), (True, False), ("a", "b")])
def test_sharded_shares_must_be_finite_positive_and_sum_to_one(shares):
    with pytest.raises(PlacementError, match=r"placement\.shares"):
        Placement.sharded(["cpu", "cpu"], shares=shares)


def test_sharded_shares_that_fit_are_kept(small_spec):
    p = Placement.sharded(["cpu", "cpu"], shares=(np.float64(0.25), 0.75))
    assert p.shares == (0.25, 0.75)
    buf = ExperienceBuffer(spec=small_spec, capacity=8, placement=p)
    buf.extend(make_rows(small_spec, 8))
    assert set(buf.sample(8)["id"].tolist()) <= set(range(8))


# -- sampler sizes and flags -------------------------------------------------------------------


@pytest.mark.parametrize(("make", "field"), [
    (lambda: FifoSampler(num_minibatches=True), "num_minibatches"),
    (lambda: FifoSampler(num_minibatches=2.0), "num_minibatches"),
    (lambda: FifoSampler(shuffle="no"), "shuffle"),
    (lambda: FifoSampler(first_within="1"), "first_within"),
    (lambda: FifoSampler(first_within=True), "first_within"),
    (lambda: FifoSampler.leading(units=True, num_minibatches=2), "units"),
    (lambda: SequenceSampler(length=True), "length"),
    (lambda: SequenceSampler(length=0), "length")])
def test_samplers_refuse_bools_and_text_for_sizes_and_flags(make, field):
    with pytest.raises(ConfigError) as err:
        make()
    assert err.value.field == field


def test_samplers_take_numpy_sizes(small_spec):
    fifo = FifoSampler(num_minibatches=np.int64(2))
    seq = SequenceSampler(length=np.int64(2))
    assert type(fifo.num_minibatches) is int and type(seq.length) is int
    buf = ExperienceBuffer(spec=small_spec, capacity=8, sampler=seq)
    buf.extend(make_rows(small_spec, 8))
    assert buf.sample(3)["id"].shape == (3, 2)
