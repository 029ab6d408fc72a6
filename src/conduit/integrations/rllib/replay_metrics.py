"""The values Conduit's RLlib replay buffers log per ``add`` and per ``sample``.

RLlib's ``EpisodeReplayBuffer`` logs them through ``_update_add_metrics`` and
``_update_sample_metrics``; :func:`add_metrics` and :func:`sample_metrics` give those methods'
keyword arguments for a single-agent buffer, whose one agent and one module get every value.
"""

from __future__ import annotations

from typing import Any

from ray.rllib.core import DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
from ray.rllib.utils.typing import AgentID, ModuleID

from conduit.integrations.rllib.episode_rows import Appended
from conduit.integrations.rllib.windows import Transitions


def _per_id(value: float) -> tuple[dict[AgentID, float], dict[ModuleID, float]]:
    return {DEFAULT_AGENT_ID: value}, {DEFAULT_MODULE_ID: value}


def add_metrics(added: Appended) -> dict[str, Any]:
    """The keyword arguments of RLlib's ``_update_add_metrics`` for what an add changed.

    Args:
        added: The episodes and timesteps the add linked and evicted.

    Returns:
        Every count, for the buffer, its agent and its module.
    """
    a_added, m_added = _per_id(added.new_episodes)
    a_steps, m_steps = _per_id(added.steps)
    a_evicted, m_evicted = _per_id(added.evicted_episodes)
    a_esteps, m_esteps = _per_id(added.evicted_steps)
    return dict(
        num_episodes_added=added.new_episodes, num_env_steps_added=added.steps,
        num_episodes_evicted=added.evicted_episodes,
        num_env_steps_evicted=added.evicted_steps,
        agent_to_num_episodes_added=a_added, agent_to_num_steps_added=a_steps,
        agent_to_num_episodes_evicted=a_evicted, agent_to_num_steps_evicted=a_esteps,
        module_to_num_episodes_added=m_added, module_to_num_steps_added=m_steps,
        module_to_num_episodes_evicted=m_evicted, module_to_num_steps_evicted=m_esteps)


def sample_metrics(batch: Transitions, resamples: int) -> dict[str, Any]:
    """The keyword arguments of RLlib's ``_update_sample_metrics`` for a sample.

    Args:
        batch: The sample's transitions.
        resamples: Rows the sampler drew again for the sample (their windows were cut short).

    Returns:
        Every count and mean, for the buffer, its agent and its module.
    """
    size = len(batch.index)
    n_step = batch.n_step.tolist()
    a_sampled, m_sampled = _per_id(size)
    a_eps, m_eps = _per_id(len(set(batch.episode.tolist())))
    a_steps, m_steps = _per_id(len(set(batch.index.tolist())))
    # (the mean of a few small integers: exact either way, and a Python sum costs less)
    a_n, m_n = _per_id(sum(n_step) / len(n_step) if n_step else float(batch.n_step.mean()))
    a_re, m_re = _per_id(resamples)
    return dict(
        num_env_steps_sampled=size, num_episodes_per_sample=a_eps[DEFAULT_AGENT_ID],
        num_env_steps_per_sample=a_steps[DEFAULT_AGENT_ID],
        sampled_n_step=a_n[DEFAULT_AGENT_ID], num_resamples=resamples,
        agent_to_num_steps_sampled=a_sampled, agent_to_num_episodes_per_sample=a_eps,
        agent_to_num_steps_per_sample=a_steps, agent_to_sampled_n_step=a_n,
        agent_to_num_resamples=a_re, module_to_num_steps_sampled=m_sampled,
        module_to_num_episodes_per_sample=m_eps, module_to_num_steps_per_sample=m_steps,
        module_to_sampled_n_step=m_n, module_to_num_resamples=m_re)
