"""Mini-batches equal verl's own: DataProto.split without shuffling, and the actor update's
make_iterator (a seeded DataLoader) with it, epoch after epoch."""

from tests.verl.conftest import skip_without_verl

skip_without_verl()

import pytest  # noqa: E402
import torch  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

from conduit import Schedule  # noqa: E402
from conduit.integrations.verl import GRPOBuffer  # noqa: E402
from tests.verl.conftest import make_step  # noqa: E402

GROUPS, N, MB = 4, 4, 4


def _with_advantages(step):
    adv, ret = compute_grpo_outcome_advantage(
        token_level_rewards=step.batch["token_level_rewards"],
        response_mask=step.batch["response_mask"], index=step.non_tensor_batch["uid"])
    step.batch["advantages"], step.batch["returns"] = adv, ret
    return step


def _assert_same(got, want):
    """Conduit's mini-batches against verl's (DataProto or TensorDict), field by field."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        ref = b.batch if isinstance(b, DataProto) else b
        assert set(a.batch.keys()) == set(ref.keys())
        for k in ref.keys():  # noqa: SIM118 - a TensorDict iterates rows
            assert torch.equal(a.batch[k], ref[k]), k


@pytest.mark.parametrize("schedule", [None, Schedule(1, 1, 1, 0.25)], ids=["inline", "overlap"])
def test_unshuffled_minibatches_are_dataproto_split(schedule):
    with GRPOBuffer(group_size=N, groups_per_step=GROUPS, mini_batch_size=MB,
                    schedule=schedule) as buf:
        for s in range(2):
            step = make_step(groups=GROUPS, group_size=N, seed=s, first_uid=10 * s)
            for g in range(GROUPS):
                buf.put(step.slice(g * N, (g + 1) * N))
            got = buf.minibatches()
            want = _with_advantages(step).split(MB)
            _assert_same(got, want)
            for a, b in zip(got, want):
                assert list(a.non_tensor_batch["uid"]) == list(b.non_tensor_batch["uid"])


@pytest.mark.parametrize("seed", [42, 3])
def test_shuffled_minibatches_follow_verls_iterator_for_a_seed(seed):
    epochs = 2
    with GRPOBuffer(group_size=N, groups_per_step=GROUPS, mini_batch_size=MB, epochs=epochs,
                    shuffle=True, seed=seed, schedule=Schedule(1, 1, 1, 0.25)) as buf:
        for s in range(2):
            step = make_step(groups=GROUPS, group_size=N, seed=5 + s, first_uid=10 * s)
            buf.put(step)
            got = buf.minibatches()
            step = _with_advantages(step)
            # What verl's actor update iterates (workers/engine_workers.py, update_actor).
            want = list(tu.make_iterator(step.batch, mini_batch_size=MB, epochs=epochs,
                                         seed=seed, dataloader_kwargs={"shuffle": True}))
            assert len(got) == GROUPS * N // MB * epochs
            _assert_same(got, want)
    # A shuffle is a permutation: not the unshuffled order.
    assert not all(torch.equal(a.batch["responses"], b.batch["responses"])
                   for a, b in zip(got, step.split(MB) * epochs))
