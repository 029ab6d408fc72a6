"""States and checkpoints that described other rows than the plane loading them, and file
names the temporary file of a save could not hold. Each test names the defect it guards."""

from __future__ import annotations

import pytest
import torch

from conduit import ExperienceDataPlane, ExperienceSpec, SpecError, StateError
from conduit.storage import SequenceSampler
from tests.conftest import make_rows

WIDE = ExperienceSpec.of(obs=((4,), torch.float32), id=((), torch.int64),
                         reward=((), torch.float32))
NARROW = ExperienceSpec.of(obs=((4,), torch.float32), id=((), torch.int64))


def test_a_state_with_a_field_the_plane_lacks_is_refused_not_dropped():
    """Defect: load_state_dict of a state holding a column this plane's spec lacks loaded
    the other columns and dropped that one without a word."""
    with ExperienceDataPlane(spec=WIDE, capacity=16, batch_size=4, seed=1) as a:
        a.push(make_rows(WIDE, 10))
        state = a.state_dict()
    with ExperienceDataPlane(spec=NARROW, capacity=16, batch_size=4, seed=1) as b:
        with pytest.raises(SpecError) as err:
            b.load_state_dict(state)
        assert err.value.field == "reward"
        assert len(b.buffer) == 0  # nothing loaded
    with ExperienceDataPlane(spec=WIDE, capacity=16, batch_size=4, seed=1) as c:
        c.load_state_dict(state)
        assert len(c.buffer) == 10


SEQ = ExperienceSpec.of(obs=((4,), torch.float32), id=((), torch.int64),
                        done=((), torch.bool))


def _sequence_state(rows: int) -> dict:
    with ExperienceDataPlane(spec=SEQ, capacity=48, batch_size=16, seed=3,
                             sampler=SequenceSampler(length=3)) as a:
        data = make_rows(SEQ, rows, start=100)
        data["done"][:] = False
        a.push(data)
        return a.state_dict()


@pytest.mark.parametrize(("key", "value"), [("size", 48), ("size", 0), ("cursor", 5)])
def test_a_sequence_sampler_state_that_is_not_the_writers_is_refused(key, value):
    """Defect: a SequenceSampler state whose fill level or write head differed from the
    writer's loaded: slices then started in slots holding no row (zeros delivered as data)
    or the first pull failed."""
    state = _sequence_state(30)
    state["buffer"]["sampler"][key] = value
    with ExperienceDataPlane(spec=SEQ, capacity=48, batch_size=16, seed=3,
                             sampler=SequenceSampler(length=3)) as b:
        with pytest.raises(StateError) as err:
            b.load_state_dict(state)
        assert err.value.key == f"sampler.{key}"
        assert len(b.buffer) == 0  # nothing loaded
        b.load_state_dict(_sequence_state(30))  # the writer's own state loads
        assert set(b.pull()["id"].reshape(-1).tolist()) <= set(range(100, 130))


def test_a_file_name_near_the_limit_can_be_saved_to(tmp_path, small_spec):
    """Defect: a save to a valid name of 238 to 255 bytes failed with 'File name too long',
    naming the temporary file (18 characters longer)."""
    path = tmp_path / ("a" * 250)
    with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4) as plane:
        plane.push(make_rows(small_spec, 8))
        plane.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left
    with ExperienceDataPlane.load(path) as loaded:
        assert len(loaded.buffer) == 8
