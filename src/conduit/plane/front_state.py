"""The plane's calls on the plane as a whole: migration (:meth:`migrate`, :meth:`grow`,
Alg. 2), checkpoints (:meth:`state_dict`, :meth:`save`, :meth:`load`, :meth:`snapshots`) and
its lifecycle (:meth:`recover`, :meth:`close`). Each group is a class whose methods
:class:`~conduit.plane.data_plane.ExperienceDataPlane` inherits: they check the call and hand
it to the engine (:mod:`conduit.plane.migration`, :mod:`conduit.plane.checkpoint`,
:class:`~conduit.plane.engine.PlaneEngine`) (docs/design.md §2).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from conduit._checks import check_int
from conduit.errors import ConfigError, DataLossError, OperatorError
from conduit.placement import PlacementMap
from conduit.plane import checkpoint
from conduit.plane.config import PlaneConfig
from conduit.plane.engine import PlaneEngine
from conduit.plane.migration import grow_target, migrate
from conduit.spec import ExperienceSpec
from conduit.storage import CheckpointInfo, ExperienceBuffer, Placement
from conduit.timing import Timings

if TYPE_CHECKING:
    from conduit.plane.data_plane import ExperienceDataPlane


def _check_spec(spec: Any) -> ExperienceSpec:
    """Refuse a ``spec`` argument that is not an :class:`~conduit.spec.ExperienceSpec`.

    Raises:
        ConfigError: (field ``spec``) It is not.
    """
    if not isinstance(spec, ExperienceSpec):
        raise ConfigError("spec", f"expected an ExperienceSpec, got {type(spec).__name__} "
                                  f"{spec!r:.80}")
    return spec


class MigrationCalls:
    """:meth:`migrate` and :meth:`grow` of
    :class:`~conduit.plane.data_plane.ExperienceDataPlane`."""

    config: PlaneConfig
    timings: Timings
    placement_map: PlacementMap | None
    _engine: PlaneEngine
    _ingest_registered: bool
    buffer: ExperienceBuffer
    spec: ExperienceSpec
    _check_open: Callable[[], None]

    def migrate(self, placement: Placement, *, spec: ExperienceSpec | None = None,
                chunk_rows: int = 65_536) -> dict[str, Any]:
        """Move the buffer to ``placement``, and optionally a wider ``spec`` (same dtypes,
        shapes that grow, fields may be added; old rows are zero-padded and get zeros in the
        new fields), online (Alg. 2): the operators pause, rows move ``chunk_rows`` at a time
        keeping their slots (so the ring cursor, priorities and FIFO layout stay valid), and
        the operators resume. No row is lost or duplicated: rollout units pushed before the
        call and not ingested yet are widened too (unless a ``rollout_spec`` or a registered
        ingestion operator shapes them), and so are those of pushes that checked their
        rollout before it and queue it after, and training batches staged before it (fields
        it adds only with the default delivery operator).

        One migration at a time: a call while another thread migrates, or otherwise holds
        the plane paused (:meth:`paused`, :meth:`set_schedule`, :meth:`load_state_dict`, a
        save), waits for it within the plane's timeout, then starts from the buffer, spec
        and placement it left (``spec=None`` keeps the spec in force then).
        Returns what moved (see :func:`~conduit.plane.migration.move_buffer`).

        Raises:
            ConfigError: ``placement`` is not a Placement, ``spec`` is neither an
                ExperienceSpec nor None, or ``chunk_rows`` is not a positive integer, or the
                call comes from inside an operator (nothing moves).
            SpecError: ``spec`` drops or narrows a field or changes a dtype.
            CapacityError: The new placement cannot hold the buffer.
            OperatorError: (``operator="runtime"``) Another thread held the plane paused,
                or an operator invocation ran, past the plane's timeout: nothing moves.
        """
        self._check_open()
        self._engine.refuse_inside_operator("migrate")
        chunk_rows = check_int("chunk_rows", chunk_rows, minimum=1)
        if not isinstance(placement, Placement):
            raise ConfigError("placement", f"expected a Placement, got {placement!r}")
        if spec is not None:
            _check_spec(spec)
        return self._migrate(placement, spec, chunk_rows)

    def _migrate(self, placement: Placement | None, spec: ExperienceSpec | None,
                 chunk_rows: int) -> dict[str, Any]:
        report = migrate(self._engine, placement, spec=spec, chunk_rows=chunk_rows,
                         placement_map=self.placement_map,
                         widen_pending=(self.config.rollout_spec is None
                                        and not self._ingest_registered))
        self.timings.record("migration", report["seconds"])
        return report

    def grow(self, *, spec: ExperienceSpec, chunk_rows: int = 65_536) -> dict[str, Any]:
        """Widen the spec online, following the plane's :class:`PlacementMap` (Alg. 2): when
        the new per-sample size falls in another region of the map the buffer migrates there
        (the report then holds the Eq. 3 plan), otherwise it is widened where it is. Runs as
        :meth:`migrate` does, one at a time: the target is chosen once the plane is paused,
        from the spec and placement in force then.

        Raises:
            ConfigError: ``spec`` is not an ExperienceSpec, the plane was not built with a
                ``PlacementMap``, ``chunk_rows`` is not a positive integer, or the call comes
                from inside an operator.
            SpecError: ``spec`` is not a growth of the current spec.
            CapacityError: No placement of the map holds the new size.
            OperatorError: (``operator="runtime"``) Another thread held the plane paused,
                or an operator invocation ran, past the plane's timeout: nothing moves.
        """
        self._check_open()
        self._engine.refuse_inside_operator("grow")
        _check_spec(spec)
        chunk_rows = check_int("chunk_rows", chunk_rows, minimum=1)
        # refused before pausing; chosen again once paused
        grow_target(self.placement_map, self.buffer.placement, self.spec, spec)
        return self._migrate(None, spec, chunk_rows)


class CheckpointCalls:
    """:meth:`state_dict`, :meth:`frozen`, :meth:`load_state_dict`, :meth:`save`,
    :meth:`load` and :meth:`snapshots` of
    :class:`~conduit.plane.data_plane.ExperienceDataPlane`."""

    _engine: PlaneEngine
    _snapshotters: weakref.WeakSet[checkpoint.Snapshotter]
    failed: OperatorError | None
    _check_open: Callable[[], None]
    flush: Callable[..., None]
    paused: Callable[[], AbstractContextManager[None]]

    def state_dict(self, *, rows: bool = True) -> dict[str, Any]:
        """An in-memory checkpoint: rows (``rows``: a copy), sampler state, row ids, the
        on-policy iteration and counters; tensors and plain values only, so ``torch.load``'s
        default weights-only mode reads it back. Queued units are ingested first unless an
        operator failed. Staged batches are not saved: on-policy, their rows are delivered
        again after a restore.

        Raises:
            OperatorError: An operator invocation did not finish within the plane's timeout
                (a stuck operator); the plane stays usable.
            ConfigError: Called from inside an operator, whose invocation it would wait for.
        """
        self._engine.refuse_inside_operator("state_dict")
        with self.frozen(rows=rows) as state:
            return state

    @contextmanager
    def frozen(self, *, rows: bool = False, flush: bool = True, reads: bool = False,
               buffer: bool = True) -> Iterator[dict[str, Any]]:
        """Ingest queued units (``flush``; not after a failure), hold the operators (``reads``:
        only those that change rows) and yield :meth:`state_dict`, without the buffer's entry
        unless ``buffer``; rows stay as they are. With ``reads`` and not ``buffer`` the caller
        reads the buffer in one call under its lock (``buffer.begin_snapshot()``), and where
        that alone is a consistent instant (off-policy) nothing is held.

        Raises:
            ConfigError: Called from inside an operator, whose invocation it would wait for.
            BackpressureTimeout: The flush waited past the plane's timeout for another
                thread's inline ingestion (nothing is held).
        """
        self._engine.refuse_inside_operator("frozen")
        if flush and self.failed is None:
            self.flush()
        with (self._engine.writes_held(atomic_buffer=not buffer) if reads
              else self._engine.quiesced()):
            yield self._engine.capture(rows=rows, buffer=buffer)

    def load_state_dict(self, state: dict[str, Any], *, rows: bool = True) -> None:
        """Restore :meth:`state_dict` (placement and schedule may differ).

        Raises:
            StateError: A key is missing or a value would corrupt the buffer; or, on-policy,
                pushed units still wait for ingestion here (they would join the loaded
                iteration): pull the iteration or call :meth:`flush` first. Nothing changes.
            ConfigError: Called from inside an operator (nothing changes).
        """
        self._check_open()
        self._engine.refuse_inside_operator("load_state_dict")
        with self.paused():
            self._engine.restore(state, rows=rows)

    def save(self, path: str | Path) -> CheckpointInfo:
        """Write the plane to one file, atomically: a crash mid-save leaves the previous file
        intact. Rows stream from the buffer's memory while the operators pause; queued units
        are ingested first (unless an operator failed). Format: :mod:`conduit.plane.checkpoint`.

        Raises:
            ConfigError: ``path`` does not name a file, or names something that exists and
                is not a regular file (a folder, a device, a FIFO); checked before the
                operators pause, and nothing is written.
            OperatorError: An operator invocation did not finish within the plane's timeout
                (a stuck operator); nothing is written and the plane stays usable.
            ConfigError: ``path`` as above, or the call comes from inside an operator, whose
                invocation it would wait for (nothing is written).
            OSError: The folder does not exist or cannot be written (``FileNotFoundError``,
                ``PermissionError``, ...), as ``open`` raises it; an earlier file at ``path``
                is left as it was.
            BackpressureTimeout: Its flush waited past the plane's timeout for another
                thread's inline ingestion (nothing is written).
        """
        self._engine.refuse_inside_operator("save")
        return checkpoint.save(self, path)

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> ExperienceDataPlane:
        """A plane rebuilt from :meth:`save`'s file; ``overrides`` replace constructor
        arguments (``placement``, ``schedule``, ``learner_device``, a custom ``sampler``; not
        ``capacity``, which the saved slots fix, nor ``seed``: the sampler's generator and the
        on-policy layout go on from their saved state).

        A refused load changes nothing, a ``store`` override's rows included.

        A ``sampler`` override must take the saved sampler's state as it was saved: it is of
        the saved sampler's kind, with the saved configuration except ``seed`` (the saved
        generator state is restored) and keys the state does not depend on (a
        PrioritizedSampler's ``beta``; a FifoSampler's ``shuffle`` and ``first_within``,
        whose epoch layout the iteration state checks; a UniformSampler's ``replacement``; a
        SequenceSampler's ``length``). Another kind, or a PrioritizedSampler of another
        ``alpha`` or ``eps`` (its saved leaves are priorities raised under the saved ones),
        is refused rather than dropping or misreading the saved state.

        Raises:
            CheckpointError: The file is corrupt, of another version, or holds a value out of
                range or inconsistent with another (a row part of a field the header's spec
                lacks, a state part of another kind of value, the state's copy of the spec
                or schedule differing from the header's); the message names the part.
            ConfigError: ``path`` is not a path; a ``capacity``, ``mode`` or ``seed`` override
                other than the saved one, a ``sampler`` override that does not fit the saved
                sampler (above), a ``num_epochs``, ``num_minibatches``, ``batch_size``,
                ``min_size`` or ``rollout_rows`` override that the saved sampler or
                iteration state does not fit (an on-policy file saved in its second epoch,
                loaded with ``num_epochs=1``), an override that is not a constructor
                argument, or a bad override value (as the constructor raises it, with
                :class:`~conduit.errors.ScheduleError` and
                :class:`~conduit.errors.PlacementError`); ``field`` names the override.
            SpecError: A ``spec`` override differs from the saved spec (the field is named).
            FileNotFoundError: ``path`` does not exist (``OSError`` for others that ``open``
                raises).
        """
        return checkpoint.load(cls, path, **overrides)

    def snapshots(self, path: str | Path, *, every_s: float,
                  double_buffer: bool = True) -> checkpoint.Snapshotter:
        """Start periodic background snapshots to ``path`` (see
        :class:`~conduit.plane.checkpoint.Snapshotter`); close it to stop (:meth:`close`
        stops it too). Closing waits up to the plane's ``timeout`` for a snapshot being
        written; one not finished by then is abandoned with a ``RuntimeWarning`` (its
        temporary file is removed, the previous snapshot stays intact). The snapshotter does
        not keep the plane alive: a plane dropped without :meth:`close` is closed by its
        finaliser, which stops the snapshotter.

        Raises:
            ConfigError: ``path`` does not name a file (or names a folder, a device or a
                FIFO), ``every_s`` is not a number > 0, or ``double_buffer`` is not a bool.
            PlaneClosedError: The plane is closed.
        """
        self._check_open()
        return checkpoint.Snapshotter(self, path, every_s=every_s, double_buffer=double_buffer)


class LifecycleCalls:
    """:meth:`recover`, :meth:`close` and the context manager of
    :class:`~conduit.plane.data_plane.ExperienceDataPlane`."""

    _engine: PlaneEngine
    _finalizer: weakref.finalize
    _snapshotters: weakref.WeakSet[checkpoint.Snapshotter]
    _check_open: Callable[[], None]

    def recover(self) -> OperatorError | None:
        """Clear an operator failure once the caller has handled it, and return it.

        After an operator raises on a worker, dependent calls raise its ``OperatorError``
        until this is called. Rows in the buffer stay intact (and can be saved meanwhile); the
        failed invocation's units are lost (counted in the error and ``counters``). The call
        also clears the losses of inline ingestions that failed on another thread than the
        one that pushed their units, which :meth:`close` would otherwise report.

        Raises:
            ConfigError: Called from inside an operator (the restart waits for its
                invocation); the error stays latched.
        """
        self._check_open()
        self._engine.refuse_inside_operator("recover")
        return self._engine.recover()

    def close(self) -> None:
        """Refuse new calls, stop the workers, and store every queued unit. Idempotent. Each
        of its waits (for the workers, for other threads' inline ingestions, for operators
        held by another thread) is bounded by the plane's ``timeout``; the queued units are
        then ingested on the calling thread, each invocation taking as long as the ingestion
        operator takes. A plane dropped without ``close()`` is closed when collected or at
        interpreter exit, with a warning if units were lost.

        Snapshotters of this plane (:meth:`snapshots`) are closed first: a snapshot being
        written gets up to the plane's ``timeout`` to finish; one not finished by then is
        abandoned with a ``RuntimeWarning`` (its temporary file is removed, the previous
        snapshot stays intact).

        Raises:
            DataLossError: Some units that ``push`` acknowledged could not be stored (an
                ingestion failure not cleared by :meth:`recover`, even one another call
                raised meanwhile, one while draining, an
                inline ingestion failure raised on another thread than the one that pushed
                them and not cleared by :meth:`recover` either, or an operator stuck past the
                timeout). The plane is closed all the same.
            KeyboardInterrupt: The ingestion operator raised it (or another interrupt that
                is not an ``Exception``) while close ingested the queued units: the units
                still queued are not ingested, the plane is closed all the same, and the
                interrupt is raised with the ``DataLossError`` message as a note.
            ConfigError: Called from inside an operator, whose invocation close would wait
                for; the plane stays open and nothing changes. (Once the plane is closed,
                a call returns at once from anywhere.)
        """
        if self._engine.closed:
            return
        self._engine.refuse_inside_operator("close")
        self._finalizer.detach()
        for snapshotter in list(self._snapshotters):
            snapshotter.close()
        self._engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        """Close the plane. Leaving the block on an interrupt (``KeyboardInterrupt``,
        ``SystemExit``, or an ``OperatorError`` whose operator was interrupted), the
        exception goes on and a ``DataLossError`` of the close is added to it as a note, so
        that stopping a run stays a stop; otherwise ``close()``'s errors are raised."""
        cause = exc.__cause__ if isinstance(exc, OperatorError) else exc
        if exc is None or isinstance(cause, Exception) or cause is None:
            self.close()
            return
        try:
            self.close()
        except DataLossError as lost:
            exc.add_note(f"conduit: {lost}")
