"""The checks and the all-or-nothing restore of a Conduit RLlib replay buffer's state.

A buffer's ``get_state`` holds its plane's spec, batch size and ``state_dict``, its episode
links, the slots of its last sample and RLlib's counters (:data:`STATE_KEYS`).
:func:`checked_spec` refuses a state that cannot be this buffer kind's before anything
changes; :func:`restore` loads one and puts the buffer back as it was when loading fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conduit import ExperienceSpec
from conduit.errors import ConduitError, StateError
from conduit.integrations.rllib.episode_rows import EpisodeRows
from conduit.storage.state import entry

#: The keys of a buffer's state.
STATE_KEYS = ("spec", "batch_size", "plane", "rows", "last_index", "_num_timesteps_added",
              "_num_episodes_evicted", "sampled_timesteps")

#: Loads a state (its ``spec`` read as the second argument) into the buffer.
Load = Callable[[dict[str, Any], ExperienceSpec | None], None]


def _holds_priorities(plane_state: Any) -> bool:
    """Whether a plane's state (in a buffer's ``get_state``) is a prioritized sampler's: its
    windows' inner sampler keeps a sum tree."""
    state: Any = plane_state
    for key in ("buffer", "sampler", "inner"):
        if not isinstance(state, dict):
            return False
        state = state.get(key)
    return isinstance(state, dict) and "tree" in state


def spec_of(state: dict[str, Any]) -> ExperienceSpec | None:
    """The spec of a state's rows (None: a buffer that never held a row)."""
    return ExperienceSpec.from_dict(state["spec"]) if state["spec"] is not None else None


def checked_spec(state: dict[str, Any], *, prioritized: bool,
                 rows: EpisodeRows) -> ExperienceSpec | None:
    """The spec of ``state``, a buffer's state checked against the buffer it is restored into.

    Args:
        state: A buffer's ``get_state``.
        prioritized: Whether the buffer it is restored into is prioritized.
        rows: That buffer's episode links (they check the state's, changing nothing).

    Raises:
        StateError: The state is missing a key, does not fit the buffer's capacity, or is a
            uniform buffer's state with priorities, or holds rows of other fields.
    """
    for key in STATE_KEYS:
        entry(state, key, "rllib_buffer")
    if not prioritized and _holds_priorities(state["plane"]):
        raise StateError("rllib_buffer.plane.buffer.sampler.inner",
                         "a prioritized buffer's state (its rows have priorities, which "
                         "this uniform buffer would drop): restore it into a "
                         "ConduitPrioritizedEpisodeReplayBuffer")
    spec = spec_of(state)
    if spec is not None and set(spec.fields) != {"obs", "action"}:
        raise StateError("spec", f"rows of fields {sorted(spec.fields)}; this buffer's rows "
                                 f"are (obs, action): restore a state of this buffer kind")
    rows.check_state(state["rows"])
    return spec


def restore(state: dict[str, Any], spec: ExperienceSpec | None, *, before: dict[str, Any],
            load: Load) -> None:
    """``load(state, spec)``, all or nothing: a state refused part way (its rows' table or
    tails, the plane's entry) is followed by ``load`` of ``before``, the buffer's state as it
    was, rows and links together.

    Raises:
        ConduitError: ``load`` raised it (the buffer is as it was).
        StateError: ``load`` raised another exception (the buffer is as it was).
    """
    try:
        load(state, spec)
    except Exception as exc:
        load(before, spec_of(before))
        if isinstance(exc, ConduitError):
            raise
        raise StateError("rllib_buffer", f"does not fit this buffer "
                                         f"({type(exc).__name__}: {exc})") from exc
