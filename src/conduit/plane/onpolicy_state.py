"""An on-policy iteration's checkpoint entries: what a save records of where the iteration
stands, and what a load checks before it changes anything (docs/design.md §8).

Pure functions of the plane's configuration, the buffer's sampler and the saved mapping; the
on-policy flow (:class:`~conduit.plane.onpolicy.OnPolicyFlow`) applies what they return.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from conduit.errors import ConfigError, StateError
from conduit.plane.config import PlaneConfig
from conduit.storage import Sampler
from conduit.storage.state import integer


def iteration_state(config: PlaneConfig, sampler: Sampler, *, version: int, written: int,
                    delivered: int) -> dict[str, Any]:
    """The checkpoint entries of iteration ``version``.

    Args:
        config: The plane's configuration.
        sampler: The buffer's sampler, which lays the iteration's epochs out.
        version: The iteration's policy version.
        written: Rows written into the iteration.
        delivered: Mini-batches delivered from the iteration (all epochs).

    Returns:
        ``policy_version``, ``iter_written_rows`` and ``delivered_in_iter``, and ``layout``:
        part way through an epoch, how that epoch is laid out (:func:`epoch_layout`).
    """
    return {"policy_version": version,
            "iter_written_rows": written,
            "delivered_in_iter": delivered,
            "layout": epoch_layout(config, sampler, version, delivered)}


def epoch_layout(config: PlaneConfig, sampler: Sampler, version: int,
                 delivered: int) -> dict[str, Any] | None:
    """What a load re-lays after ``delivered`` mini-batches of iteration ``version``.

    Args:
        config: The plane's configuration.
        sampler: The buffer's sampler.
        version: The iteration's policy version.
        delivered: Mini-batches delivered from the iteration (all epochs).

    Returns:
        None at an epoch's start (nothing of the epoch is laid out yet); else the sampler's
        ``kind`` and ``config`` and a ``digest`` of the epoch's mini-batches, as a
        checkpoint's JSON holds them (a value JSON lacks is compared as its text).
        ``digest`` is None for a sampler whose ``layout`` raises ``ConfigError`` (the base
        class's: no pure layout); its kind and configuration are compared instead.
    """
    m = config.num_minibatches
    if delivered % m == 0:
        return None
    digest = None
    try:
        parts = sampler.layout(config.capacity, iteration=version, epoch=delivered // m)
    except ConfigError:  # a consume-once sampler without a pure layout
        parts = None
    if parts is not None:
        h = hashlib.sha1(usedforsecurity=False)
        for part in parts:
            h.update(np.asarray(part, dtype=np.int64).tobytes() + b"|")
        digest = h.hexdigest()
    return json.loads(json.dumps({"kind": type(sampler).__name__, "config": sampler.config(),
                                  "digest": digest}, default=repr))


def check_iteration_state(state: Mapping[str, Any], *, rows: int, config: PlaneConfig,
                          sampler: Sampler, most_early: int) -> tuple[int, int, int]:
    """Check saved iteration entries (:func:`iteration_state`) against a buffer of ``rows``
    rows and this plane's sampler, changing nothing.

    Args:
        state: The saved entries.
        rows: Rows in the buffer the entries are loaded over.
        config: The plane's configuration.
        sampler: The buffer's sampler, which lays the rest of a saved epoch out again.
        most_early: The most mini-batches an iteration delivers before all of its rows are
            written (early assembly).

    Returns:
        ``(policy_version, iter_written_rows, delivered_in_iter)``.

    Raises:
        StateError: An entry is missing or out of range, the rows written are not the
            buffer's, more mini-batches were delivered from an iteration that is not full
            than early assembly delivers, or the saved epoch's mini-batches are not those
            ``sampler`` lays out (an entry ``layout`` absent from the state is not compared).
    """
    version = integer(state, "policy_version", "flow")
    written = integer(state, "iter_written_rows", "flow", high=config.capacity)
    delivered = integer(state, "delivered_in_iter", "flow",
                        high=config.batches_per_iteration - 1)
    if written != rows:
        raise StateError("flow.iter_written_rows", f"{written}, but the buffer holds "
                                                   f"{rows} rows")
    if written < config.capacity and delivered > most_early:
        # early assembly delivers an iteration's first mini-batches before its last rows
        raise StateError("flow.delivered_in_iter", f"{delivered} mini-batches delivered "
                                                   f"from an iteration that is not full "
                                                   f"(at most {most_early} are "
                                                   f"delivered early)")
    saved = state.get("layout")
    if isinstance(saved, dict) and delivered % config.num_minibatches:
        mine = epoch_layout(config, sampler, version, delivered)
        assert mine is not None
        same = (saved.get("digest") == mine["digest"] if saved.get("digest") and
                mine["digest"] else (saved.get("kind"), saved.get("config"))
                == (mine["kind"], mine["config"]))
        if not same:  # the rest of the epoch is laid out again on load
            raise StateError("flow.layout", f"the saved epoch's mini-batches (laid out by "
                                            f"a {saved.get('kind')} with "
                                            f"{saved.get('config')}) are not those this "
                                            f"plane's {mine['kind']} with "
                                            f"{mine['config']} lays out: rows delivered "
                                            f"before the save would be delivered again "
                                            f"and others never; load into a plane whose "
                                            f"sampler is like the saved one (or save at "
                                            f"an epoch's end)")
    return version, written, delivered
