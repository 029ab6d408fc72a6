"""The ``conduit`` command line.

Subcommands:

* ``conduit demo``: the main job, a short distributed training run, inline then through
  Conduit, with its per-iteration latency breakdown;
* ``conduit train``: one training run (DQN, SAC or PPO on Ray actors; GRPO with TRL);
* ``conduit bench NAME``: benchmarks that print tables and write JSON and PNG files (plane,
  placement, schedule, peers, convergence, workloads, persist, scale, grpo, rllib);
* ``conduit profile``: measure this machine's copy bandwidths (cached);
* ``conduit plan``: print the placement and schedule Conduit would choose, without training.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from conduit.cli_args import command_parser
from conduit.errors import (
    CapacityError,
    ConduitError,
    ConfigError,
    PlacementError,
    ScheduleError,
    SpecError,
    TopologyError,
    interrupt_of,
)

#: Errors that mean the input was bad: exit status 2, as for a usage error.
_BAD_INPUT = (ConfigError, SpecError, ScheduleError, PlacementError, TopologyError,
              CapacityError)

_BENCHES = {
    "plane": ("conduit.bench.plane", "exposed latency inline vs overlap; gather vs copy"),
    "placement": ("conduit.bench.placement", "exposed delivery latency per placement"),
    "schedule": ("conduit.bench.schedule", "every manual schedule vs the auto pick; "
                                          "cost-model fidelity"),
    "peers": ("conduit.bench.peers.harness", "Conduit next to TorchRL, cpprb, RLlib, Reverb"),
    "convergence": ("conduit.bench.convergence", "learning curves, inline vs Conduit"),
    "workloads": ("conduit.bench.workloads", "per-iteration breakdown for every workload"),
    "persist": ("conduit.bench.persist", "checkpoint save/load GB/s vs dd and TorchRL; "
                                         "the learner's stall during snapshots"),
    "scale": ("conduit.bench.scale", "Ray-sharded plane on 1, 2, 4 nodes; recovery; projection"),
    "grpo": ("conduit.bench.grpo", "TRL's GRPOTrainer alone vs TRL + Conduit on a CPU LM"),
    "rllib": ("conduit.bench.rllib", "RLlib alone vs RLlib + Conduit: DQN, SAC, PPO; buffers"),
}

_BENCH_HELP = """\
Run one benchmark: conduit bench BENCH [flags]. Each prints its tables and writes JSON and
PNG files, by default under runs/bench/BENCH (--out); 'conduit bench BENCH --help' lists its
flags (all but convergence take --quick, a short development run)."""

_COMMANDS = {
    "demo": ("conduit.workloads.cli", "demo_main",
             "the main job: heavy-payload training on Ray actors, inline then Conduit"),
    "train": ("conduit.workloads.cli", "train_main",
              "train DQN, SAC or PPO on Ray actors through an inline or Conduit buffer, or "
              "GRPO with TRL (--algo grpo)"),
    "profile": ("conduit.placement.bandwidth", "run_profile_cli",
                "measure and cache this machine's copy bandwidths"),
    "plan": ("conduit.plan_cli", "main",
             "print the placement and schedule Conduit would choose"),
}


def _call(prog: str, module: str, func: str, argv: list[str]) -> int:
    """Run one command; a :class:`~conduit.errors.ConduitError` becomes one line on stderr.

    Exit status 2 for bad input (:class:`~conduit.errors.ConfigError`,
    :class:`~conduit.errors.SpecError`, :class:`~conduit.errors.ScheduleError`,
    :class:`~conduit.errors.PlacementError`, :class:`~conduit.errors.TopologyError`,
    :class:`~conduit.errors.CapacityError`), 1 for any other Conduit error, 130 when
    interrupted (Ctrl-C, also inside an operator: one line, no traceback; the command's own
    cleanup has run), 143 when ``conduit train`` or ``conduit demo`` gets SIGTERM (the same).
    ``CONDUIT_TRACEBACK=1`` lets the error propagate with its traceback instead.
    """
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        print(f"{prog}: {module} is unavailable: {exc}", file=sys.stderr)
        return 2
    try:
        return int(getattr(mod, func)(argv) or 0)
    except ConduitError as exc:
        if os.environ.get("CONDUIT_TRACEBACK") == "1":
            raise
        interrupt = interrupt_of(exc)  # Ctrl-C inside an operator
        if interrupt is not None:
            return _interrupted(prog, interrupt)
        print(f"{prog}: error: {type(exc).__name__}: {exc} "
              "(CONDUIT_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 2 if isinstance(exc, _BAD_INPUT) else 1
    except KeyboardInterrupt as exc:
        if os.environ.get("CONDUIT_TRACEBACK") == "1":
            raise
        return _interrupted(prog, exc)


def _interrupted(prog: str, exc: KeyboardInterrupt) -> int:
    """One line for an interrupt, with the notes it carries (a benchmark's partial results);
    the exit status 128 + the signal (130 for Ctrl-C, 143 for SIGTERM, which ``conduit train``
    and ``conduit demo`` raise as an interrupt)."""
    signum = int(getattr(exc, "signum", signal.SIGINT))
    notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", ()) if isinstance(n, str))
    print(f"{prog}: " + ("interrupted" if signum == signal.SIGINT
                         else f"terminated ({signal.Signals(signum).name})") + notes,
          file=sys.stderr)
    return 128 + signum


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``conduit`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = command_parser("conduit", __doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, help_text) in _COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks (tables, JSON, PNG)",
                           description=_BENCH_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    for name, (_, help_text) in _BENCHES.items():
        bench_sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):  # help asked for, or the command to choose
        parser.print_help()
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in _COMMANDS:
        module, func, _ = _COMMANDS[cmd]
        return _call(f"conduit {cmd}", module, func, rest)
    if cmd == "bench":
        if not rest or rest[0] in ("-h", "--help"):
            bench.print_help()
            return 0
        if rest[0] not in _BENCHES:
            bench.error(f"unknown benchmark {rest[0]!r} (choose from {', '.join(_BENCHES)})")
        # The first plane would set it part-way through a run: every system a benchmark
        # compares runs under the same allocator policy instead (docs/design.md §9).
        from conduit.storage.hostmem import retain_freed_memory
        retain_freed_memory()
        return _call(f"conduit bench {rest[0]}", _BENCHES[rest[0]][0], "main", rest[1:])
    parser.error(f"unknown command {cmd!r} (choose from {', '.join([*_COMMANDS, 'bench'])})")


if __name__ == "__main__":
    raise SystemExit(main())
