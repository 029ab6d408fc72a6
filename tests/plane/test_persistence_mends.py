"""States and checkpoints that described other rows than the plane loading them, and file
names the temporary file of a save could not hold. Each test names the defect it guards."""

from __future__ import annotations

import pytest
import torch

from conduit import ConfigError, ExperienceDataPlane, ExperienceSpec, SpecError, StateError
from conduit.storage import FifoSampler, SequenceSampler
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


ON = ExperienceSpec.of(obs=((4,), torch.float32), id=((), torch.int64))
ON_KW = {"spec": ON, "capacity": 32, "batch_size": 8, "mode": "on_policy",
         "num_minibatches": 4, "num_epochs": 2, "seed": 5}


def _saved_after(pulls: int, path) -> tuple[list[int], dict]:  # type: ignore[no-untyped-def]
    with ExperienceDataPlane(**ON_KW) as a:
        a.push(make_rows(ON, 32), policy_version=0)
        ids = [i for _ in range(pulls) for i in a.pull()["id"].tolist()]
        a.save(path)
        return ids, a.state_dict()


def test_an_epoch_saved_part_way_is_not_laid_out_again_by_another_sampler(tmp_path):
    """Defect: an on-policy plane saved part way through an epoch, loaded with a sampler of
    another seed (a sampler= override, or load_state_dict into a plane built so), laid the
    rest of the epoch out anew: rows delivered before the save came again, others never."""
    first, state = _saved_after(1, tmp_path / "ck")
    with pytest.raises(ConfigError) as err:
        ExperienceDataPlane.load(tmp_path / "ck",
                                 sampler=FifoSampler(num_minibatches=4, seed=99))
    assert err.value.field == "sampler" and "flow.layout" in str(err.value)
    with ExperienceDataPlane(**{**ON_KW, "seed": 99}) as other:
        with pytest.raises(StateError) as refused:
            other.load_state_dict(state)
        assert refused.value.key == "flow.layout"
        assert len(other.buffer) == 0  # nothing loaded
    with ExperienceDataPlane.load(tmp_path / "ck") as same:  # the saved sampler: exact
        rest = [i for _ in range(3) for i in same.pull()["id"].tolist()]
    assert sorted(first + rest) == list(range(32))


def test_an_epoch_saved_at_its_end_loads_with_another_sampler(tmp_path):
    """At an epoch's end nothing of the next is laid out yet: another sampler may lay it."""
    _, state = _saved_after(4, tmp_path / "ck")
    with ExperienceDataPlane(**{**ON_KW, "seed": 99}) as other:
        other.load_state_dict(state)
        epoch = [i for _ in range(4) for i in other.pull()["id"].tolist()]
    assert sorted(epoch) == list(range(32))  # every row once in the second epoch



def test_an_off_policy_file_saved_with_num_epochs_loads(tmp_path, small_spec):
    """num_epochs did nothing off-policy and is now refused there: files saved with another
    value still load (as they did)."""
    from conduit.storage import read_checkpoint, write_checkpoint

    with ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4) as plane:
        plane.push(make_rows(small_spec, 8))
        plane.save(tmp_path / "ck")
    meta, parts = read_checkpoint(tmp_path / "ck")
    meta["config"]["num_epochs"] = 3
    write_checkpoint(tmp_path / "old", tensors=parts, meta=meta)
    with ExperienceDataPlane.load(tmp_path / "old") as loaded:
        assert len(loaded.buffer) == 8 and loaded.config.num_epochs == 1
    with pytest.raises(ConfigError) as err:
        ExperienceDataPlane(spec=small_spec, capacity=16, batch_size=4, num_epochs=3)
    assert err.value.field == "num_epochs"


def test_an_epoch_saved_part_way_loads_with_a_sampler_that_lays_it_out_alike():
    """Defect (review): the check compared the samplers' configurations, not the epoch's
    layout, and refused loads that deliver every row once: a seed that an unshuffled
    sampler does not use, a leading sampler past its first epoch."""
    spec = ExperienceSpec.of(x=((1,), torch.float32))

    def plane(sampler: FifoSampler) -> ExperienceDataPlane:
        return ExperienceDataPlane(spec=spec, capacity=8, mode="on_policy", batch_size=8,
                                   num_minibatches=4, num_epochs=2, sampler=sampler)

    cases = [(FifoSampler(num_minibatches=4, shuffle=False, seed=0),
              FifoSampler(num_minibatches=4, shuffle=False, seed=1), 2),
             (FifoSampler.leading(units=2, num_minibatches=4),
              FifoSampler(num_minibatches=4), 5)]
    for saved_with, loaded_with, pulls in cases:
        with plane(saved_with) as a:
            a.push({"x": torch.arange(8.0).reshape(8, 1)})
            batches = [a.pull()["x"].reshape(-1).tolist() for _ in range(pulls)]
            state = a.state_dict()
        epoch = [x for rows in batches[pulls // 4 * 4:] for x in rows]  # the current epoch's
        with plane(loaded_with) as b:
            b.load_state_dict(state)
            while len(epoch) < 8:
                epoch += b.pull()["x"].reshape(-1).tolist()
        assert sorted(epoch) == [float(i) for i in range(8)]  # each row once in the epoch


def test_a_sampler_without_a_pure_layout_saves_part_way_through_an_epoch(monkeypatch):
    """A consume-once sampler that does not implement ``layout`` (the base raises) is saved
    with its kind and configuration only, not refused."""
    with ExperienceDataPlane(**ON_KW) as a:
        a.push(make_rows(ON, 32), policy_version=0)
        a.pull()

        def no_layout(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise ConfigError("sampler", "no epoch layout")

        monkeypatch.setattr(a.buffer.sampler, "layout", no_layout)
        state = a.state_dict()
    assert state["flow"]["layout"]["digest"] is None
    assert state["flow"]["layout"]["kind"] == "FifoSampler"
    with ExperienceDataPlane(**ON_KW) as b:
        b.load_state_dict(state)  # no digest saved: the same kind and configuration load
        assert len(b.buffer) == 32
