"""DataProto groups in, DataProto mini-batches out: every tensor and non-tensor entry returns."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from verl import DataProto  # noqa: E402

from conduit.integrations.verl import GRPOBuffer  # noqa: E402
from tests.verl.conftest import make_step  # noqa: E402

GROUPS, N = 4, 3


def _by_row(batches: list[DataProto]) -> DataProto:
    """The delivered rows, back in put order (``prompts`` is unique per row here)."""
    whole = DataProto.concat(batches)
    order = torch.argsort(whole.batch["input_ids"][:, 0] * 10_000
                          + whole.batch["input_ids"][:, 1] * 100
                          + whole.batch["input_ids"][:, 2])
    return whole.select_idxs(order)


def _sorted_like(step: DataProto) -> DataProto:
    order = torch.argsort(step.batch["input_ids"][:, 0] * 10_000
                          + step.batch["input_ids"][:, 1] * 100 + step.batch["input_ids"][:, 2])
    return step.select_idxs(order)


@pytest.mark.parametrize("shuffle", [False, True])
def test_round_trip_keeps_tensors_and_non_tensors(shuffle):
    step = make_step(groups=GROUPS, group_size=N, seed=1)
    with GRPOBuffer(group_size=N, groups_per_step=GROUPS, mini_batch_size=N * 2,
                    shuffle=shuffle, seed=7) as buf:
        for g in range(GROUPS):  # one put per arriving group
            buf.put(step.slice(g * N, (g + 1) * N))
        out = buf.minibatches()
    assert len(out) == GROUPS * N // (N * 2)
    assert all(len(mb) == N * 2 for mb in out)
    got, want = _by_row(out), _sorted_like(step)
    assert set(got.batch.keys()) == set(want.batch.keys()) | {"advantages", "returns"}
    for k in want.batch.keys():  # noqa: SIM118 - a TensorDict iterates rows
        assert got.batch[k].dtype == want.batch[k].dtype, k
        assert torch.equal(got.batch[k], want.batch[k]), k
    assert got.non_tensor_batch.keys() == want.non_tensor_batch.keys()
    for k, v in want.non_tensor_batch.items():
        assert got.non_tensor_batch[k].dtype == object
        assert list(got.non_tensor_batch[k]) == list(v), k
    assert all(mb.meta_info == {"temperature": 1.0} for mb in out)


def test_steps_follow_each_other():
    with GRPOBuffer(group_size=N, groups_per_step=GROUPS, mini_batch_size=GROUPS * N) as buf:
        for s in range(3):
            step = make_step(groups=GROUPS, group_size=N, seed=10 + s, first_uid=100 * s)
            buf.put(step)
            (mb,) = buf.minibatches()
            assert list(mb.non_tensor_batch["uid"]) == list(step.non_tensor_batch["uid"])
            assert torch.equal(mb.batch["responses"], step.batch["responses"])
        assert buf.plane.policy_version == 3


def test_non_tensor_entries_are_not_copied_into_the_plane():
    step = make_step(groups=GROUPS, group_size=N)
    with GRPOBuffer(group_size=N, groups_per_step=GROUPS, mini_batch_size=N) as buf:
        buf.put(step)
        assert set(buf.plane.spec.names) == set(step.batch.keys()) | {"advantages", "returns",
                                                                       "row_id"}
        decision = buf.plane.placement_decision  # placement="auto": Conduit chose it
        assert decision is not None and decision.chosen.placement == buf.plane.buffer.placement
        out = buf.minibatches()
    assert isinstance(out[0].non_tensor_batch["extra_info"][0], dict)
    assert np.array_equal(np.concatenate([mb.non_tensor_batch["uid"] for mb in out]),
                          step.non_tensor_batch["uid"])
