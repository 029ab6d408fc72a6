"""The ``conduit`` command line: help text and environment."""

from __future__ import annotations

import os

import pytest

from conduit.cli import main
from conduit.cli_args import plain_text

BENCHES = ("plane", "placement", "schedule", "peers", "convergence", "workloads", "persist",
           "scale", "grpo", "rllib")


def test_plain_text_removes_rst_inline_markup() -> None:
    text = ("``conduit plan`` uses :func:`~conduit.plane.profile_plane`, "
            ":meth:`Topology.detect() <conduit.placement.Topology.detect>` and "
            ":mod:`conduit.placement`; ``a\nb``")
    assert plain_text(text) == ("conduit plan uses profile_plane, Topology.detect() and "
                                "conduit.placement; a\nb")


@pytest.mark.parametrize("argv", [[], ["--help"], ["plan", "--help"], ["profile", "--help"],
                                  ["bench", "--help"],
                                  *(["bench", b, "--help"] for b in BENCHES)])
def test_help_is_plain_text(argv: list[str], capsys) -> None:
    try:
        main(argv)
    except SystemExit as exc:  # argparse exits after printing a subcommand's help
        assert exc.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out
    assert "``" not in out and ":func:`" not in out and ":meth:`" not in out


def test_the_cli_leaves_ray_authentication_alone(monkeypatch: pytest.MonkeyPatch,
                                                 capsys) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    main(["--help"])
    assert "RAY_AUTH_MODE" not in os.environ
