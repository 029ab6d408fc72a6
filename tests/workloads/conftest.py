"""Fixtures of the workload tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def ray_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch HOME for every local Ray of the session: Ray keeps the token it read first
    for the rest of the process, so a later Ray under another HOME could not start."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def ray_session(ray_home: Path) -> Iterator[None]:
    """A local Ray with its default token authentication (its token under ``ray_home``)."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_AUTH_MODE", raising=False)
        mp.setenv("HOME", str(ray_home))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        assert os.environ["RAY_AUTH_MODE"] == "token"  # Ray's own default, left on
        yield
        ray.shutdown()
