"""The typed errors cross process boundaries as themselves."""

from __future__ import annotations

import pickle

import pytest

from conduit import errors
from conduit.storage import CheckpointError


@pytest.mark.parametrize("err", [
    errors.ConfigError("env", "cannot make 'NoSuchEnv-v0'"),
    errors.SpecError(None, "rollout must be a mapping"),
    errors.SpecError("obs", "shape (3, 5)"),
    errors.CapacityError("does not fit", needed=3, available=1),
    errors.OperatorError("ingestion", ValueError("scorer down"), lost_units=2, lost_rows=8),
    errors.DataLossError("2 units lost", lost_units=2, lost_rows=8),
    errors.StateError("buffer.writer.cursor", "out of range"),
    errors.PriorityError("priorities: must be finite"),
    CheckpointError("/tmp/p.ckpt", "bad crc", part="rows/0/obs"),
], ids=lambda e: type(e).__name__)
def test_every_error_pickles_with_its_message_and_attributes(err):
    """Defect: errors whose constructor takes other arguments than the message could not be
    unpickled, so one raised in a Ray actor (a ConfigError for an unknown environment)
    reached the caller as Ray's UnserializableException instead."""
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    assert back.__dict__ == err.__dict__
