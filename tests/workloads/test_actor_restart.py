"""Rollout actors that die mid-run, on a real local Ray with token authentication: the actor
group re-creates them with the current weights, the trainers keep training, and the run reports
the rollouts lost."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

ray = pytest.importorskip("ray")

from conduit import ExperienceDataPlane  # noqa: E402
from conduit.workloads import dqn, ppo  # noqa: E402
from conduit.workloads.actors import ActorGroup, cpu_weights  # noqa: E402
from conduit.workloads.envs import env_info  # noqa: E402
from conduit.workloads.nets import PPOAgent  # noqa: E402
from tests.workloads.crashing_env import CRASHING_CARTPOLE  # noqa: E402

pytestmark = pytest.mark.ray

TINY = dict(actors=2, envs_per_actor=2, steps_per_rollout=8, log_every=0, device="cpu", seed=3)


@pytest.fixture
def kill_on_submit(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``arm(n)``: the ``n``-th ``ActorGroup.submit`` of the test (1-based) kills actor 1 as
    soon as its rollout is asked for, so that the rollout is in flight or queued."""

    def arm(n: int) -> None:
        submit, seen = ActorGroup.submit, []

        def killing_submit(self: ActorGroup, *args, **kwargs):
            calls = submit(self, *args, **kwargs)
            seen.append(None)
            if len(seen) == n:
                ray.kill(self.workers[1])
            return calls

        monkeypatch.setattr(ActorGroup, "submit", killing_submit)

    return arm


def test_a_dead_actor_is_re_created_with_the_latest_weights(ray_session, capsys) -> None:
    info = env_info("CartPole-v1")
    agent = PPOAgent(info)
    with ActorGroup(2, algo="ppo", env_id="CartPole-v1", info=info, num_envs=2, seed=3,
                    label="[test] ") as group:
        calls = group.submit(8, cpu_weights(agent)) + group.submit(8, None)
        ray.kill(group.workers[1])  # before it even started: both of its rollouts are lost
        outs = [group.result(c) for c in calls]
        assert group.actors_restarted >= 1 and group.rollouts_lost >= 2
        assert group.result(group.submit(8, None)[1])["stats"]["rows"] == 16  # it stays up
    assert "[test] rollout actor 1 died" in capsys.readouterr().out
    # Every rollout, the two collected again included, comes from the policy it was asked
    # with: the replacement received the weights sent with the first of them.
    for out in outs:
        r = {k: torch.tensor(v) for k, v in out["rollout"].items()}
        with torch.no_grad():
            logp, _, _ = agent.evaluate(r["obs"], r["action"], None)
        torch.testing.assert_close(logp, r["logprob"])


def test_an_actor_that_keeps_dying_is_given_up(ray_session) -> None:
    # Every incarnation's process exits on its first environment step.
    with ActorGroup(1, algo="dqn", env_id=CRASHING_CARTPOLE, info=env_info(CRASHING_CARTPOLE),
                    num_envs=1, seed=0, max_restarts=1) as group:
        with pytest.raises(RuntimeError, match="died 2 times in a row"):
            group.result(group.submit(4, None)[0])
        assert group.actors_restarted == 1


def test_an_actor_that_cannot_be_built_is_not_re_created(ray_session) -> None:
    with ActorGroup(1, algo="dqn", env_id="NoSuchEnv-v0", info=env_info("CartPole-v1"),
                    num_envs=1, seed=0) as group:
        with pytest.raises(ray.exceptions.RayActorError, match="NoSuchEnv"):
            group.result(group.submit(4, None)[0])
        assert group.actors_restarted == 0


def test_dqn_keeps_training_when_an_actor_dies(ray_session, kill_on_submit) -> None:
    kill_on_submit(2)
    args = dqn.Args(**TINY, batch_size=32, buffer_size=2_000, learning_starts=64,
                    updates_per_iter=2, iters=5)
    res = dqn.train(args)
    assert res.losses_finite and len(res.records) == 5
    # Every iteration collected both actors' rollouts (2 actors x 2 envs x 8 steps).
    assert [r.env_steps for r in res.records] == [32, 64, 96, 128, 160]
    assert res.actors_restarted >= 1 and res.rollouts_lost >= 1
    log = res.to_json()
    assert (log["actors_restarted"], log["rollouts_lost"]) == (res.actors_restarted,
                                                               res.rollouts_lost)


@pytest.mark.parametrize("schedule", ["0,1/4,0,1/4", "1,1/4,0,1/4"],
                         ids=["learner-pushes", "port-thread-pushes"])
def test_ppo_iterations_stay_whole_when_an_actor_dies(ray_session, kill_on_submit, monkeypatch,
                                                      schedule: str) -> None:
    pushed: dict[int | None, list[int]] = defaultdict(list)  # policy version -> rows pushed
    push = ExperienceDataPlane.push

    def counting_push(self, rollout, *, policy_version=None, **kwargs):
        push(self, rollout, policy_version=policy_version, **kwargs)
        pushed[policy_version].append(len(rollout["reward"]))

    monkeypatch.setattr(ExperienceDataPlane, "push", counting_push)
    kill_on_submit(3)  # iteration 1, fragment 0 (two fragments per iteration)
    batches: list[dict[str, torch.Tensor]] = []
    args = ppo.Args(**TINY, rollout_fragments=2, num_minibatches=4, update_epochs=2, iters=3,
                    schedule=schedule)
    res = ppo.train(args, on_batch=batches.append)
    assert res.losses_finite and len(res.records) == 3
    assert res.actors_restarted >= 1 and res.rollouts_lost >= 1
    # Each iteration's policy version received exactly its capacity: 2 fragments of 16 rows
    # from each of 2 actors, the lost ones collected again under the same version.
    assert dict(pushed) == {v: [16] * 4 for v in range(3)}
    assert len(batches) == 3 * 2 * 4 and all(b["obs"].shape[0] == 16 for b in batches)
