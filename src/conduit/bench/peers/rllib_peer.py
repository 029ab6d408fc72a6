"""RLlib (new API stack) through its public buffer API.

* Uniform: ``EpisodeReplayBuffer``; prioritized: ``PrioritizedEpisodeReplayBuffer`` followed by
  ``update_priorities`` — the pair RLlib's DQN/SAC training step uses.
* Both are fed ``SingleAgentEpisode``s built the way RLlib's ``SingleAgentEnvRunner`` returns
  them (``observations`` one longer than ``actions``, converted with ``to_numpy()``), one
  episode per inserted chunk. Building the episode is the actor's work and is not timed; the
  buffer's ``add`` (which deep-copies the episode, as RLlib's does) is.
* Sampling follows DQN's call: ``sample(num_items=batch, n_step=1, gamma=0.99,
  sample_episodes=True)``, which returns one-step episodes. Turning those into a tensor
  batch is RLlib's learner-connector work, not timed here, so the comparison favours RLlib.
* On-policy: RLlib's PPO keeps no buffer. Its learner splits the train batch with
  ``MiniBatchCyclicIterator`` (a ``DeveloperAPI`` class, the one ``Learner.update`` uses), which
  is what is timed: one epoch of ``M`` mini-batches over a ``MultiAgentBatch`` of one rollout,
  including RLlib's in-place shuffle when the epoch wraps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from conduit.bench.peers.adapter import Chunk, PeerAdapter, PeerUnavailable, Workload, priorities


class RLlibPeer(PeerAdapter):
    """RLlib ``EpisodeReplayBuffer`` / ``PrioritizedEpisodeReplayBuffer`` / PPO mini-batching.

    Args:
        alpha: Priority exponent of the prioritized buffer.
        beta: Importance-sampling exponent used when sampling it.
        gamma: Discount passed to ``sample`` (``n_step=1`` makes it irrelevant to the data).
    """

    name = "rllib"
    description = ("ray.rllib EpisodeReplayBuffer / PrioritizedEpisodeReplayBuffer fed "
                   "SingleAgentEpisodes, sample(n_step=1, sample_episodes=True); "
                   "MiniBatchCyclicIterator for the on-policy epoch")
    package = "ray"

    def __init__(self, *, alpha: float = 0.6, beta: float = 0.4, gamma: float = 0.99) -> None:
        self._alpha = alpha
        self._beta = beta
        self._gamma = gamma
        self._rb: Any = None
        self._on_policy = False
        self._pending: list[Chunk] = []
        self._train_batch: Any = None
        self._w: Workload | None = None
        self._prios: Iterator[np.ndarray] = iter(())

    def check(self) -> None:
        try:
            from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: F401
            from ray.rllib.utils.replay_buffers.episode_replay_buffer import (  # noqa: F401
                EpisodeReplayBuffer,
            )
        except Exception as exc:
            raise PeerUnavailable(f"ray[rllib] cannot be imported: {exc!r} "
                                  f"(pip install 'ray[rllib]')") from exc

    def notes(self) -> list[str]:
        return ["sampled batches are lists of one-step SingleAgentEpisodes; converting them "
                "into tensors (RLlib's learner connectors) is not timed",
                "on-policy epoch: MiniBatchCyclicIterator is RLlib's DeveloperAPI, not a buffer"]

    def prepare(self, chunk: Chunk) -> Any:
        if self._on_policy:
            return chunk
        from ray.rllib.env.single_agent_episode import SingleAgentEpisode

        obs = chunk["obs"]
        # An env runner's episode holds one observation more than actions: the final one.
        observations = [*obs, obs[-1]]
        eps = SingleAgentEpisode(observations=observations,
                                 actions=list(chunk["action"]),
                                 rewards=list(chunk["reward"]),
                                 terminated=bool(chunk["done"][-1]),
                                 len_lookback_buffer=0)
        return eps.to_numpy()

    def setup(self, workload: Workload) -> None:
        from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

        self._w = workload
        self.close()
        self._rb = EpisodeReplayBuffer(capacity=workload.capacity)
        self._rb.rng = np.random.default_rng(workload.seed)

    def insert(self, chunk: Any) -> None:
        if self._on_policy:
            self._collect(chunk)
        else:
            self._rb.add([chunk])

    def _collect(self, chunk: Chunk) -> None:
        """Gather a rollout; once complete, build the train batch a PPO learner iterates."""
        from ray.rllib.policy.sample_batch import DEFAULT_POLICY_ID, MultiAgentBatch, SampleBatch

        assert self._w is not None
        self._pending.append(chunk)
        n = sum(len(c["obs"]) for c in self._pending)
        if n < self._w.epoch_rows:
            return
        cols = {k: np.concatenate([c[k] for c in self._pending]) for k in chunk}
        self._pending = []
        self._train_batch = MultiAgentBatch({DEFAULT_POLICY_ID: SampleBatch({
            SampleBatch.OBS: cols["obs"], SampleBatch.ACTIONS: cols["action"],
            SampleBatch.REWARDS: cols["reward"], SampleBatch.TERMINATEDS: cols["done"],
        })}, env_steps=n)

    def sample_uniform(self) -> Any:
        assert self._w is not None
        return self._rb.sample(num_items=self._w.batch, n_step=1, gamma=self._gamma,
                               sample_episodes=True)

    def setup_prioritized(self, workload: Workload) -> None:
        from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
            PrioritizedEpisodeReplayBuffer,
        )

        self._w = workload
        self.close()
        self._rb = PrioritizedEpisodeReplayBuffer(capacity=workload.capacity,
                                                  alpha=self._alpha)
        self._rb.rng = np.random.default_rng(workload.seed)
        self._prios = priorities(workload)

    def sample_prioritized_and_update(self) -> Any:
        assert self._w is not None
        episodes = self._rb.sample(num_items=self._w.batch, n_step=1, gamma=self._gamma,
                                   beta=self._beta)
        self._rb.update_priorities(next(self._prios))
        return episodes

    def setup_on_policy(self, workload: Workload) -> None:
        self._w = workload
        self.close()
        self._on_policy = True

    def on_policy_epoch(self) -> int:
        from ray.rllib.policy.sample_batch import DEFAULT_POLICY_ID
        from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

        assert self._w is not None
        batch, self._train_batch = self._train_batch, None
        if batch is None:
            raise RuntimeError("on_policy_epoch: the rollout was not inserted first")
        rows = 0
        it = MiniBatchCyclicIterator(batch, minibatch_size=self._w.minibatch, num_epochs=1,
                                     shuffle_batch_per_epoch=True)
        for i, mb in enumerate(it):
            rows += len(mb.policy_batches[DEFAULT_POLICY_ID])
            if i + 1 >= self._w.minibatches:
                break
        return rows

    def close(self) -> None:
        self._rb = None
        self._on_policy = False
        self._pending = []
        self._train_batch = None
