"""DeepMind Reverb, measured in its own virtualenv through :mod:`reverb_worker`.

Reverb 0.14.0 pins TensorFlow 2.15, numpy<2 and protobuf<5, which conflict with Ray's pins, so
it cannot share Conduit's environment. ``make peers`` builds ``.venv-reverb``; this module runs
``reverb_worker.py`` with that venv's Python, once per server mode:

* ``inproc``: the ``reverb.Server`` lives in the worker process;
* ``grpc``: the server is a separate process and the client talks to it over gRPC at
  127.0.0.1.

The worker sends back raw timings as JSON; the harness turns them into the same medians as
every other peer. Without ``.venv-reverb`` the peer is reported as skipped, with the command
that builds it; if the worker fails, as unavailable, with the tail of its error output.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from conduit.bench.peers.adapter import Workload

WORKER = Path(__file__).with_name("reverb_worker.py")
MODES = ("inproc", "grpc")


def default_python() -> Path:
    """``.venv-reverb/bin/python`` in the working directory, else in the source checkout."""
    here = Path.cwd() / ".venv-reverb" / "bin" / "python"
    if here.exists():
        return here
    # src/conduit/bench/peers/reverb_peer.py -> the checkout root is four levels up.
    return Path(__file__).resolve().parents[4] / ".venv-reverb" / "bin" / "python"


class ReverbPeer:
    """Runs the Reverb worker in ``.venv-reverb`` and collects its rows.

    Args:
        python: Interpreter of the Reverb virtualenv (default: :func:`default_python`).
        modes: Server modes to measure (``"inproc"``, ``"grpc"``).
        timeout_s: Wall-clock limit per mode.
        alpha: Priority exponent of the prioritized table.
    """

    name = "reverb"

    def __init__(self, *, python: str | Path | None = None, modes: tuple[str, ...] = MODES,
                 timeout_s: float = 3600.0, alpha: float = 0.6) -> None:
        self.python = Path(python) if python else default_python()
        bad = [m for m in modes if m not in MODES]
        if bad:
            raise ValueError(f"modes: {bad} not in {MODES}")
        self.modes = modes
        self.timeout_s = timeout_s
        self.alpha = alpha
        self.versions: dict[str, Any] = {}

    def availability(self) -> tuple[str, str] | None:
        """``None`` when runnable, else ``(status, reason)``."""
        if not self.python.exists():
            return ("skipped", f"{self.python} not found: Reverb runs in its own virtualenv "
                               f"(dm-reverb 0.14.0 pins TensorFlow 2.15, numpy<2, protobuf<5, "
                               f"which conflict with Ray); build it with `make peers`")
        try:
            res = subprocess.run([str(self.python), str(WORKER), "--probe"], capture_output=True,
                                 text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return ("unavailable", f"cannot run {self.python}: {exc}")
        if res.returncode != 0:
            tail = " | ".join(res.stderr.strip().splitlines()[-3:])
            return ("unavailable", f"the Reverb venv does not import reverb/tensorflow "
                                   f"(exit {res.returncode}): {tail}")
        try:
            self.versions = json.loads(res.stdout.strip().splitlines()[-1])["versions"]
        except (ValueError, KeyError, IndexError):
            self.versions = {}
        return None

    def run(self, workloads: list[Workload], *, warmup: int, repeats: int,
            insert_64_repeats: int, epoch_repeats: int,
            progress: Callable[[str], None]) -> list[dict[str, Any]]:
        """Measure every workload in every mode; returns the worker's rows (never raises)."""
        cfg = {"warmup": warmup, "repeats": repeats, "insert_64_repeats": insert_64_repeats,
               "epoch_repeats": epoch_repeats, "alpha": self.alpha,
               "workloads": [asdict(w) for w in workloads]}
        rows: list[dict[str, Any]] = []
        for mode in self.modes:
            rows.extend(self._run_mode(mode, cfg, workloads, progress))
        return rows

    def _run_mode(self, mode: str, cfg: dict[str, Any], workloads: list[Workload],
                  progress: Callable[[str], None]) -> list[dict[str, Any]]:
        def failed(reason: str) -> list[dict[str, Any]]:
            return [{"peer": f"reverb-{mode}", "dim": w.dim, "capacity": w.capacity,
                     "batch": w.batch, "status": "unavailable", "reason": reason}
                    for w in workloads]

        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)  # the Reverb venv must not see Conduit's site-packages
        try:
            proc = subprocess.Popen([str(self.python), str(WORKER), "--mode", mode],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)
        except OSError as exc:
            return failed(f"cannot start the Reverb worker: {exc}")
        tail: deque[str] = deque(maxlen=20)

        def pump() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                line = line.rstrip()
                if line.startswith("[reverb] "):
                    progress(line)
                elif line:
                    tail.append(line)

        chunks: list[str] = []

        def collect() -> None:
            assert proc.stdout is not None
            chunks.append(proc.stdout.read())

        readers = [threading.Thread(target=f, daemon=True) for f in (pump, collect)]
        for t in readers:
            t.start()
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(cfg))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the worker died at start; its exit code and stderr say why
        try:
            proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return failed(f"the Reverb worker ({mode}) ran past {self.timeout_s:.0f} s")
        for t in readers:
            t.join(timeout=10)
        out = "".join(chunks)
        if proc.returncode != 0:
            return failed(f"the Reverb worker ({mode}) exited with {proc.returncode}: "
                          + " | ".join(list(tail)[-4:]))
        try:
            doc = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return failed(f"the Reverb worker ({mode}) printed no JSON result")
        self.versions = doc.get("versions", self.versions)
        return list(doc.get("rows", []))

