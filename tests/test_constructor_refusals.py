"""Constructors refuse malformed arguments with a typed error naming the argument, instead of
a raw TypeError/ValueError/AttributeError later or a silent acceptance."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from conduit import ExperienceDataPlane
from conduit.errors import ConfigError, PlacementError, ScheduleError
from conduit.plane.config import PlaneConfig
from conduit.scheduling.space import Schedule
from conduit.spec import ExperienceSpec, FieldSpec
from conduit.storage.layout import Placement

SPEC = ExperienceSpec.of(obs=((4,), torch.float32))

# ---------------------------------------------------------------- ExperienceSpec


@pytest.mark.parametrize("value", [
    (4,), (4, torch.float32), None, ((4,), "float"), ((True,), torch.float32),
    ((4,), torch.float32, 1), "obs", 4,
], ids=["shape-only", "bare-int-shape", "none", "str-dtype", "bool-shape", "triple", "str",
        "int"])
def test_spec_of_refuses_malformed_field(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^obs: expected \(\(shape\.\.\.\), dtype\)") as info:
        ExperienceSpec.of(obs=value)
    assert info.value.field == "obs"


@pytest.mark.parametrize("value", [((4,), torch.float32), [[4], torch.float32],
                                   (torch.Size([4]), torch.float32), FieldSpec((4,))])
def test_spec_of_accepts_pairs_and_field_specs(value: object) -> None:
    assert ExperienceSpec.of(obs=value).fields["obs"] == FieldSpec((4,), torch.float32)


def test_spec_of_names_the_field_of_an_unstorable_dtype() -> None:
    with pytest.raises(ConfigError, match=r"torch\.int16.*\(field 'obs'\)$") as info:
        ExperienceSpec.of(obs=((4,), torch.uint16))
    assert info.value.field == "dtype"  # as tests/test_spec.py pins it


@pytest.mark.parametrize("fields", [[1, 2], "obs", 5, (("obs", FieldSpec()),)])
def test_spec_refuses_fields_that_are_not_a_mapping(fields: object) -> None:
    with pytest.raises(ConfigError, match="mapping of field name to FieldSpec") as info:
        ExperienceSpec(fields=fields)  # type: ignore[arg-type]
    assert info.value.field == "spec.fields"


@pytest.mark.parametrize("shape", [(True,), (4, False), (np.bool_(True),)])
def test_field_spec_refuses_bool_sizes(shape: tuple) -> None:
    with pytest.raises(ConfigError, match="True and False are not sizes") as info:
        FieldSpec(shape=shape)
    assert info.value.field == "shape"


# ---------------------------------------------------------------- Placement


@pytest.mark.parametrize("devices", [None, "cpu", torch.device("cpu"), 0])
def test_placement_refuses_devices_that_are_not_a_sequence(devices: object) -> None:
    with pytest.raises(PlacementError, match=r"^placement\.devices: must be a sequence of "
                                             r"device names"):
        Placement(kind="pageable", devices=devices)  # type: ignore[arg-type]


def test_placement_from_dict_and_sharded_refuse_a_bare_string() -> None:
    with pytest.raises(PlacementError, match=r"placement\.devices: .*got 'cpu'"):
        Placement.from_dict({"kind": "pageable", "devices": "cpu", "shares": None})
    with pytest.raises(PlacementError, match=r"placement\.devices: .*got 'cpu'"):
        Placement.sharded("cpu")  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match=r"^placement: expected a mapping"):
        Placement.from_dict(["pageable"])  # type: ignore[arg-type]


def test_placement_still_takes_lists_tuples_and_round_trips() -> None:
    assert Placement(kind="pageable", devices=["cpu"]).devices == ("cpu",)
    assert Placement(kind="pinned", devices=(torch.device("cpu"),)).devices == ("cpu",)
    for p in (Placement.pageable(), Placement.sharded(["cpu", "cpu"], shares=(0.25, 0.75))):
        assert Placement.from_dict(p.to_dict()) == p


# ---------------------------------------------------------------- Schedule


@pytest.mark.parametrize(("args", "kwargs", "field"), [
    ((), {"overlap_ing": True}, "overlap_ing"),
    ((), {"overlap_del": False}, "overlap_del"),
    ((True, 1, False, 1), {}, "overlap_ing"),
    ((0, 1, True, 1), {}, "overlap_del"),
    ((np.bool_(True), 1, 0, 1), {}, "overlap_ing"),
    (("1", 1, 0, 1), {}, "overlap_ing"),
])
def test_schedule_refuses_bool_overlap_flags(args: tuple, kwargs: dict, field: str) -> None:
    with pytest.raises(ScheduleError, match=rf"^{field}: must be 0 or 1"):
        Schedule(*args, **kwargs)


def test_schedule_still_takes_int_like_overlap_flags() -> None:
    for flag in (1, 1.0, np.int64(1), Fraction(1)):
        s = Schedule(flag, 1, 0, 1)
        assert s.overlap_ing == 1 and type(s.overlap_ing) is int


# ---------------------------------------------------------------- PlaneConfig


@pytest.mark.parametrize("rollout_spec", ["x", {}, 5, FieldSpec()])
def test_plane_config_refuses_a_rollout_spec_that_is_no_spec(rollout_spec: object) -> None:
    with pytest.raises(ConfigError, match="None or an ExperienceSpec") as info:
        PlaneConfig(spec=SPEC, capacity=8, batch_size=2,
                    rollout_spec=rollout_spec)  # type: ignore[arg-type]
    assert info.value.field == "rollout_spec"


def test_plane_refuses_a_rollout_spec_that_is_no_spec_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"^rollout_spec: "):
        ExperienceDataPlane(spec=SPEC, capacity=8, batch_size=2,
                            rollout_spec="x")  # type: ignore[arg-type]


def test_off_policy_refuses_epochs() -> None:
    with pytest.raises(ConfigError, match="only applies on-policy") as info:
        PlaneConfig(spec=SPEC, capacity=8, batch_size=2, num_epochs=3)
    assert info.value.field == "num_epochs"


def test_default_epochs_and_on_policy_epochs_stay_valid() -> None:
    assert PlaneConfig(spec=SPEC, capacity=8, batch_size=2, num_epochs=1).num_epochs == 1
    on = PlaneConfig(spec=SPEC, capacity=8, mode="on_policy", num_minibatches=2, num_epochs=3)
    assert on.batches_per_iteration == 6
    assert PlaneConfig(spec=SPEC, capacity=8, batch_size=2, rollout_spec=SPEC).rollout_spec is SPEC


@pytest.mark.parametrize("shares", [0.5, "0.5", 1])
def test_sharded_shares_that_are_not_a_sequence_are_refused_by_name(shares) -> None:
    with pytest.raises(PlacementError, match=r"placement\.shares"):
        Placement(kind="sharded", devices=("cpu", "cpu"), shares=shares)
    with pytest.raises(PlacementError, match=r"placement\.shares"):
        Placement.from_dict({"kind": "sharded", "devices": ["cpu", "cpu"], "shares": shares})


def test_a_placement_round_trips_through_its_dict() -> None:
    p = Placement.sharded(["cpu", "cpu"], shares=(0.25, 0.75))
    assert Placement.from_dict(p.to_dict()) == p


@pytest.mark.parametrize(("d", "field"), [([1, 2], "spec"),
                                          ({"obs": 5}, "spec.fields['obs']"),
                                          ({"obs": {"shape": 4, "dtype": "float32"}},
                                           "spec.fields['obs']"),
                                          ({"obs": {"shape": [4]}}, "spec.fields['obs']")])
def test_a_spec_dict_of_the_wrong_form_is_refused_by_name(d, field) -> None:
    with pytest.raises(ConfigError) as err:
        ExperienceSpec.from_dict(d)
    assert err.value.field == field
