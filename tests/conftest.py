"""Shared fixtures."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conduit.spec import ExperienceSpec


@pytest.fixture
def small_spec() -> ExperienceSpec:
    """A spec with a vector, an integer id and a done flag."""
    return ExperienceSpec.of(obs=((4,), torch.float32), id=((), torch.int64),
                             done=((), torch.bool))


def make_rows(spec: ExperienceSpec, n: int, start: int = 0) -> dict[str, torch.Tensor]:
    """Rows whose content is a function of their global id, so any mix-up is visible."""
    ids = torch.arange(start, start + n, dtype=torch.int64)
    out: dict[str, torch.Tensor] = {}
    for name, fs in spec.fields.items():
        if name == "id":
            out[name] = ids
        elif fs.dtype == torch.bool:
            out[name] = (ids % 7 == 6).reshape(n, *([1] * len(fs.shape))).expand(n, *fs.shape)
        else:
            base = ids.to(torch.float64).reshape(n, *([1] * len(fs.shape)))
            out[name] = (base + torch.zeros(n, *fs.shape, dtype=torch.float64)).to(fs.dtype)
    return out


def one_and_two_threads(spec: ExperienceSpec, sampler: Callable[[], Any], rows: int = 64
                        ) -> tuple[Any, Any]:
    """Two buffers holding the same ``rows`` rows, each with its own ``sampler()`` (same
    seed): one on one data-path thread, one on two; what they gather must be the same."""
    from conduit.storage import ExperienceBuffer

    data = make_rows(spec, rows)
    one = ExperienceBuffer(spec=spec, capacity=rows, sampler=sampler())
    two = ExperienceBuffer(spec=spec, capacity=rows, sampler=sampler(), threads=2)
    for buf in (one, two):
        buf.extend(data)
    return one, two


CLUSTER_PACKAGE = "tests/distributed/"
"""The tests that share one package-scoped three-node Ray cluster (its ``conftest.py``)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The cluster package first (a stable sort: the order within each part is kept). Under
    ``make test``'s two workers (``--dist loadfile --no-loadscope-reorder``) each worker
    then runs its share of the package's modules back to back, so its package-scoped
    cluster starts once, and the longest modules start first."""
    items.sort(key=lambda item: not item.nodeid.startswith(CLUSTER_PACKAGE))


@pytest.fixture(autouse=True)
def _restore_torch_determinism():
    """RLlib's seeding turns on torch's deterministic algorithms for the whole process; each
    test gets the setting it started with back."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


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
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        assert os.environ["RAY_AUTH_MODE"] == "token"  # Ray's own default, left on
        yield
        ray.shutdown()


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a run gets as far as starting (or attaching to) Ray."""
    from conduit.workloads import actors

    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("Ray was started for a run that should have been refused")

    monkeypatch.setattr(actors, "ray_running", refuse)


def usage_error(argv: list[str], flag: str, says: str, capsys: Any) -> str:
    """Run ``conduit argv``: a usage error naming ``flag``, saying ``says``, exit status 2,
    nothing on stdout and no traceback; returns what it wrote on stderr."""
    from conduit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert f"error: argument {flag}: " in err and says in err, err
    assert "Traceback" not in err and out == ""
    return err
