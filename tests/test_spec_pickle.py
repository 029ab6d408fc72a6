"""Specs survive pickling (Ray sends them to shard actors) and copying, and stay frozen."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from conduit.spec import ExperienceSpec, FieldSpec, RaggedFieldSpec

SPEC = ExperienceSpec.of(obs=((4, 2), torch.float32), action=((), torch.int64),
                         mask=((3,), torch.bool), low=((), torch.bfloat16))


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_experience_spec_round_trips_through_pickle(protocol):
    back = pickle.loads(pickle.dumps(SPEC, protocol=protocol))
    assert back == SPEC and hash(back) == hash(SPEC)
    assert back.names == SPEC.names  # field order kept
    assert back.fields["low"] == FieldSpec((), torch.bfloat16)
    assert back.bytes_per_sample == SPEC.bytes_per_sample
    with pytest.raises(TypeError, match="read-only"):
        back.fields["extra"] = FieldSpec()  # type: ignore[index]
    batch, n = back.validate({"obs": torch.zeros(2, 4, 2), "action": torch.zeros(2).long(),
                              "mask": torch.ones(2, 3, dtype=torch.bool),
                              "low": torch.zeros(2, dtype=torch.bfloat16)})
    assert n == 2 and set(batch) == set(SPEC.names)


def test_the_field_mapping_pickles_and_copies_on_its_own():
    fields = pickle.loads(pickle.dumps(SPEC.fields))
    assert dict(fields) == dict(SPEC.fields) and type(fields) is type(SPEC.fields)
    with pytest.raises(TypeError, match="read-only"):
        fields.clear()
    assert copy.deepcopy(SPEC) == SPEC and copy.copy(SPEC) == SPEC


def test_a_widened_spec_round_trips_and_differs_from_the_original():
    wide = SPEC.with_field("ret", FieldSpec((), torch.float32))
    back = pickle.loads(pickle.dumps(wide))
    assert back == wide and back != SPEC and back.names[-1] == "ret"


def test_ragged_field_spec_round_trips_through_pickle():
    ragged = RaggedFieldSpec(dtype=torch.int32, max_length=64, min_length=0)
    back = pickle.loads(pickle.dumps(ragged))
    assert back == ragged
    values, lengths = back.validate([torch.tensor([1, 2], dtype=torch.int32), []],
                                     field="tokens")
    assert lengths.tolist() == [2, 0] and values.dtype == torch.int32
