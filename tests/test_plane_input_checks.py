"""The plane's constructor refuses a bad seed, and a sampler that needs a field its spec
lacks, with a typed error naming the argument."""

import numpy as np
import pytest
import torch

from conduit import ConfigError
from conduit.plane import ExperienceDataPlane
from conduit.plane.config import PlaneConfig
from conduit.spec import ExperienceSpec
from conduit.storage import SequenceSampler

SPEC = ExperienceSpec.of(id=((), torch.int64), terminated=((), torch.bool))


def test_plane_refuses_a_sequence_sampler_without_its_boundary_field():
    with pytest.raises(ConfigError) as err:
        ExperienceDataPlane(spec=SPEC, capacity=8, batch_size=2, timeout=1,
                            sampler=SequenceSampler(length=2))  # boundary_key="done"
    assert err.value.field == "boundary_key"


@pytest.mark.parametrize("seed", [-1, "x", True, 1.5, None])
def test_plane_needs_a_non_negative_integer_seed(seed):
    with pytest.raises(ConfigError) as err:
        ExperienceDataPlane(spec=SPEC, capacity=8, batch_size=2, timeout=1, seed=seed)
    assert err.value.field == "seed"
    with pytest.raises(ConfigError) as err:
        PlaneConfig(spec=SPEC, capacity=8, batch_size=2, seed=seed)
    assert err.value.field == "seed"


def test_plane_takes_a_numpy_seed():
    config = PlaneConfig(spec=SPEC, capacity=8, batch_size=2, seed=np.int64(3))
    assert config.seed == 3 and type(config.seed) is int
    rows = {"id": torch.arange(8), "terminated": torch.zeros(8, dtype=torch.bool)}
    with ExperienceDataPlane(spec=SPEC, capacity=8, batch_size=4, timeout=5,
                             seed=np.int64(3)) as a, \
            ExperienceDataPlane(spec=SPEC, capacity=8, batch_size=4, timeout=5, seed=3) as b:
        a.push(rows)
        b.push(rows)
        assert a.pull()["id"].tolist() == b.pull()["id"].tolist()


@pytest.mark.parametrize(("field", "value"), [
    ("capacity", True), ("batch_size", 2.0), ("num_epochs", "1"), ("g_max", 0),
    ("min_size", True), ("min_size", 9), ("max_priority_lag", -1), ("max_priority_lag", False),
    ("timeout", True), ("timeout", float("nan"))])
def test_plane_config_refuses_bools_and_out_of_range_values(field, value):
    with pytest.raises(ConfigError) as err:
        PlaneConfig(spec=SPEC, **{"capacity": 8, "batch_size": 2, field: value})
    assert err.value.field == field


def test_plane_config_keeps_numpy_integers_as_python_ints():
    config = PlaneConfig(spec=SPEC, capacity=np.int64(8), batch_size=np.int32(2),
                         min_size=np.int64(4), max_priority_lag=np.int64(1))
    for name, want in (("capacity", 8), ("batch_size", 2), ("min_size", 4),
                       ("max_priority_lag", 1)):
        assert type(getattr(config, name)) is int and getattr(config, name) == want
    with ExperienceDataPlane(spec=SPEC, capacity=np.int64(8), batch_size=np.int64(2),
                             timeout=5) as plane:
        plane.push({"id": torch.arange(4), "terminated": torch.zeros(4, dtype=torch.bool)})
        plane.flush()
        assert plane.pull()["id"].shape == (2,)
