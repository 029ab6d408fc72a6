"""Bandwidth profiler: micro-benchmarks of the real copy paths on this machine.

Measured paths (each at several payload sizes, median of ``repeats`` after one warm-up):

==================== ============================ =============================================
path                 endpoints                    operation
==================== ============================ =============================================
``pageable->pinned`` ``cpu -> cpu_pinned``        ``pinned.copy_(pageable)``
``pageable->device`` ``cpu -> cuda:i``            ``dev.copy_(pageable)``
``pinned->device``   ``cpu_pinned -> cuda:i``     ``dev.copy_(pinned, non_blocking=True)`` + sync
``device->device``   ``cuda:i -> cuda:j``         peer ``copy_`` + sync
``gather``           ``t -> t`` for every tier    ``torch.index_select(buf, 0, idx, out=...)``
==================== ============================ =============================================

Without an accelerator torch has no pinned allocator; the ``pageable->pinned`` and pinned
gather rows then measure pageable memory and say so in their ``note``.

Intra-op threads are set to one during the measurement and restored afterwards, as on the
data path (docs/design.md §7).

Results are cached per machine as JSON under ``$CONDUIT_CACHE_DIR`` (default
``~/.cache/conduit``), keyed by host name, torch version and device names;
:meth:`conduit.placement.topology.Topology.detect` reads the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from conduit.errors import ConfigError
from conduit.placement.endpoints import CPU, CPU_PINNED
from conduit.timing import repeat_times

DEFAULT_SIZES = (64 * 1024, 1024 * 1024, 16 * 1024 * 1024)
"""Payload sizes in bytes measured by default (64 KiB, 1 MiB, 16 MiB)."""
DEFAULT_REPEATS = 5
GATHER_ROW_BYTES = 1024
"""Row size of the gather benchmark (256 float32 values)."""
_FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class BandwidthSample:
    """One measurement.

    Attributes:
        path: ``"pageable->pinned"``, ``"pageable->device"``, ``"pinned->device"``,
            ``"device->device"`` or ``"gather"``.
        src: Source endpoint (``"cpu"``, ``"cpu_pinned"``, ``"cuda:0"``).
        dst: Destination endpoint.
        size_bytes: Payload bytes moved per operation.
        seconds: Median seconds per operation.
        note: Caveat, e.g. that pinned memory was unavailable.
    """

    path: str
    src: str
    dst: str
    size_bytes: int
    seconds: float
    note: str = ""

    @property
    def bandwidth(self) -> float:
        """Bytes per second (``size_bytes / seconds``)."""
        return self.size_bytes / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True, kw_only=True)
class BandwidthProfile:
    """All measurements of one machine.

    Attributes:
        key: Cache key: host name, torch version and device names.
        hostname: Host the profile was measured on.
        torch_version: ``torch.__version__``.
        devices: Device names (``"cpu"``, then accelerator model names).
        sizes: Payload sizes measured.
        repeats: Timed repetitions per measurement.
        created: Unix time of the measurement.
        samples: The measurements.
        from_cache: True when loaded from the cache rather than measured now.
    """

    key: str
    hostname: str
    torch_version: str
    devices: tuple[str, ...]
    sizes: tuple[int, ...]
    repeats: int
    created: float
    samples: tuple[BandwidthSample, ...]
    from_cache: bool = False

    def link_table(self) -> dict[tuple[str, str], float]:
        """``(src, dst) -> bytes/s`` at the largest measured size, for a bandwidth table."""
        best: dict[tuple[str, str], BandwidthSample] = {}
        for s in self.samples:
            k = (s.src, s.dst)
            if k not in best or s.size_bytes > best[k].size_bytes:
                best[k] = s
        return {k: s.bandwidth for k, s in best.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (the cache file format)."""
        return {"version": _FORMAT_VERSION, "key": self.key, "hostname": self.hostname,
                "torch_version": self.torch_version, "devices": list(self.devices),
                "sizes": list(self.sizes), "repeats": self.repeats, "created": self.created,
                "samples": [{"path": s.path, "src": s.src, "dst": s.dst,
                             "size_bytes": s.size_bytes, "seconds": s.seconds, "note": s.note}
                            for s in self.samples]}

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, from_cache: bool = False) -> BandwidthProfile:
        """Inverse of :meth:`to_dict`.

        Raises:
            ConfigError: The data is malformed (field ``bandwidth_profile``).
        """
        try:
            if d.get("version") != _FORMAT_VERSION:
                raise ValueError(f"unsupported version {d.get('version')!r}")
            return cls(key=str(d["key"]), hostname=str(d["hostname"]),
                       torch_version=str(d["torch_version"]),
                       devices=tuple(str(x) for x in d["devices"]),
                       sizes=tuple(int(x) for x in d["sizes"]), repeats=int(d["repeats"]),
                       created=float(d["created"]),
                       samples=tuple(BandwidthSample(
                           path=str(s["path"]), src=str(s["src"]), dst=str(s["dst"]),
                           size_bytes=int(s["size_bytes"]), seconds=float(s["seconds"]),
                           note=str(s.get("note", ""))) for s in d["samples"]),
                       from_cache=from_cache)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError("bandwidth_profile", f"malformed profile data: {exc!r}") from exc


# -- cache ---------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """``$CONDUIT_CACHE_DIR`` or ``~/.cache/conduit``."""
    env = os.environ.get("CONDUIT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "conduit"


def _cache_error(folder: Path, exc: OSError) -> ConfigError:
    """The error of a cache folder that cannot be created or written, naming where it comes
    from (``CONDUIT_CACHE_DIR`` when set, else the default folder)."""
    what = ("it is not a folder" if folder.exists() and not folder.is_dir()
            else exc.strerror or type(exc).__name__)
    field = "CONDUIT_CACHE_DIR" if os.environ.get("CONDUIT_CACHE_DIR") else "cache_dir"
    return ConfigError(field, f"cannot write the bandwidth cache in {str(folder)!r} ({what}); "
                              f"set CONDUIT_CACHE_DIR to a writable folder, or pass --no-cache")


def check_cache_dir() -> Path:
    """Create the cache folder if needed and make sure a file can be written in it, before any
    measurement is spent.

    Returns:
        The cache folder.

    Raises:
        ConfigError: The folder cannot be created or written (field ``CONDUIT_CACHE_DIR``
            when that variable is set, else ``cache_dir``).
    """
    folder = cache_dir()
    probe = folder / f".write-test{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise _cache_error(folder, exc) from exc
    return folder


def machine_identity() -> tuple[str, str, tuple[str, ...]]:
    """``(hostname, torch version, device names)`` of this machine."""
    devs = [CPU]
    if torch.cuda.is_available():
        devs += [f"cuda:{i}={torch.cuda.get_device_name(i)}"
                 for i in range(torch.cuda.device_count())]
    return socket.gethostname(), torch.__version__, tuple(devs)


def machine_key() -> str:
    """Cache key of this machine: host name + torch version + device names."""
    host, tv, devs = machine_identity()
    return f"{host}|torch-{tv}|{';'.join(devs)}"


def cache_path(key: str | None = None) -> Path:
    """The cache file for ``key`` (default: this machine)."""
    key = key or machine_key()
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return cache_dir() / f"bandwidth-{digest}.json"


def load_cached_profile(key: str | None = None) -> BandwidthProfile | None:
    """The cached profile of this machine, or ``None`` (missing, unreadable or stale)."""
    key = key or machine_key()
    path = cache_path(key)
    try:
        data = json.loads(path.read_text())
        prof = BandwidthProfile.from_dict(data, from_cache=True)
    except (OSError, json.JSONDecodeError, ConfigError):
        return None
    return prof if prof.key == key else None


def save_profile(profile: BandwidthProfile) -> Path:
    """Write ``profile`` to its cache file (atomically) and return the path.

    Raises:
        ConfigError: The cache folder cannot be created or written (field
            ``CONDUIT_CACHE_DIR`` when that variable is set, else ``cache_dir``).
    """
    path = cache_path(profile.key)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(profile.to_dict(), indent=1))
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise _cache_error(path.parent, exc) from exc
    return path


# -- measurement ---------------------------------------------------------------------------------


def _time(op: Callable[[], object], sync: Callable[[], None] | None, repeats: int) -> float:
    times = repeat_times(op, repeats=repeats, warmup=1, sync=sync)
    return max(statistics.median(times), 1e-9)


def _measure(sizes: Sequence[int], repeats: int) -> list[BandwidthSample]:
    cuda = torch.cuda.is_available()
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else []

    def sync_all() -> None:
        for g in gpus:
            torch.cuda.synchronize(g)

    sync = sync_all if gpus else None
    out: list[BandwidthSample] = []
    pin_note = "" if cuda else "no pinned allocator without an accelerator; pageable measured"

    def host(n: int, pinned: bool) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.uint8, pin_memory=pinned and cuda)
        t.fill_(1)
        return t

    for size in sizes:
        src = host(size, False)
        dst = host(size, True)
        out.append(BandwidthSample(path="pageable->pinned", src=CPU, dst=CPU_PINNED,
                                   size_bytes=size, seconds=_time(lambda s=src, d=dst: d.copy_(s),
                                                                  None, repeats),
                                   note=pin_note))
        for g in gpus:
            dev = torch.empty(size, dtype=torch.uint8, device=g)
            out.append(BandwidthSample(
                path="pageable->device", src=CPU, dst=g, size_bytes=size,
                seconds=_time(lambda s=src, d=dev: d.copy_(s), sync, repeats)))
            out.append(BandwidthSample(
                path="pinned->device", src=CPU_PINNED, dst=g, size_bytes=size,
                seconds=_time(lambda s=dst, d=dev: d.copy_(s, non_blocking=True), sync,
                              repeats)))
            for h in gpus:
                if h == g:
                    continue
                peer = torch.empty(size, dtype=torch.uint8, device=h)
                out.append(BandwidthSample(
                    path="device->device", src=g, dst=h, size_bytes=size,
                    seconds=_time(lambda s=dev, d=peer: d.copy_(s, non_blocking=True), sync,
                                  repeats)))
                del peer
            del dev
        del src, dst
        # gather within each tier: rows of GATHER_ROW_BYTES from a buffer 4x the payload
        rows = max(1, size // GATHER_ROW_BYTES)
        width = GATHER_ROW_BYTES // 4
        tiers: list[tuple[str, str, str]] = [(CPU, "cpu", ""), (CPU_PINNED, "cpu", pin_note)]
        tiers += [(g, g, "") for g in gpus]
        gen = torch.Generator().manual_seed(size)
        for name, device, note in tiers:
            buf = torch.ones(max(4 * rows, 1024), width, dtype=torch.float32,
                             pin_memory=(name == CPU_PINNED and cuda)).to(device)
            idx = torch.randint(0, buf.shape[0], (rows,), generator=gen).to(device)
            res = torch.empty(rows, width, dtype=torch.float32, device=device)
            out.append(BandwidthSample(
                path="gather", src=name, dst=name, size_bytes=rows * GATHER_ROW_BYTES,
                seconds=_time(lambda b=buf, i=idx, r=res: torch.index_select(b, 0, i, out=r),
                              sync if device != "cpu" else None, repeats),
                note=note))
            del buf, idx, res
    return out


def profile_bandwidth(*, sizes: Sequence[int] | None = None, repeats: int = DEFAULT_REPEATS,
                      use_cache: bool = True, refresh: bool = False) -> BandwidthProfile:
    """Measure (or load from cache) this machine's copy and gather bandwidths.

    Args:
        sizes: Payload sizes in bytes (default :data:`DEFAULT_SIZES`).
        repeats: Timed repetitions per measurement (median is kept).
        use_cache: Read and write the per-machine cache.
        refresh: Measure even when a cached profile with the same sizes exists.

    Returns:
        The profile (``from_cache`` tells whether it was measured now).

    Raises:
        ConfigError: ``sizes`` or ``repeats`` are not positive integers; with ``use_cache``,
            the cache folder cannot be written (field ``CONDUIT_CACHE_DIR`` when that
            variable is set, else ``cache_dir``), found before anything is measured.
    """
    sizes = tuple(DEFAULT_SIZES if sizes is None else sizes)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
        raise ConfigError("sizes", f"must be positive integers (bytes), got {sizes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError("repeats", f"must be a positive integer, got {repeats!r}")
    host, tv, devs = machine_identity()
    key = f"{host}|torch-{tv}|{';'.join(devs)}"
    if use_cache and not refresh:
        cached = load_cached_profile(key)
        if cached is not None and cached.sizes == sizes:
            return cached
    if use_cache:
        check_cache_dir()  # before the measurement, not after it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            samples = _measure(sizes, repeats)
    finally:
        torch.set_num_threads(threads)
    prof = BandwidthProfile(key=key, hostname=host, torch_version=tv, devices=devs, sizes=sizes,
                            repeats=repeats, created=time.time(), samples=tuple(samples))
    if use_cache:
        save_profile(prof)
    return prof


def _fmt_size(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"


def format_table(profile: BandwidthProfile) -> str:
    """The profile as a text table (what ``conduit profile`` prints)."""
    lines = [f"bandwidth profile of {profile.hostname} (torch {profile.torch_version}; "
             f"devices: {', '.join(profile.devices)}; {profile.repeats} repeats, median"
             + ("; from cache" if profile.from_cache else "") + ")",
             f"{'path':<18} {'src -> dst':<26} {'size':>9} {'time':>11} {'GB/s':>9}  note"]
    for s in profile.samples:
        t = s.seconds
        ts = f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"
        lines.append(f"{s.path:<18} {s.src + ' -> ' + s.dst:<26} {_fmt_size(s.size_bytes):>9} "
                     f"{ts:>11} {s.bandwidth / 1e9:>9.2f}  {s.note}")
    return "\n".join(lines)


def _parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suf, f in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suf):
            t, mult = t[:-1], f
            break
    try:
        v = int(float(t) * mult)  # inf: OverflowError, nan: ValueError
    except (ValueError, OverflowError):
        raise ConfigError("sizes", f"cannot parse {text!r} (a finite size: try 64K, 1M, "
                                   f"16M)") from None
    if v <= 0:
        raise ConfigError("sizes", f"must be positive, got {text!r}")
    return v


#: Host buffers of one payload size the profile may hold at once (the gather tier holds a
#: source four times the payload and a result of it, and a pinned copy of the source): a size
#: is refused above the available host memory divided by this.
SIZE_HOST_COPIES = 8


def _sizes_flag(text: str) -> tuple[int, ...]:
    """argparse ``type`` of ``--sizes``: a bad size, or one too large to measure with the
    host memory available now (see :data:`SIZE_HOST_COPIES`), is a usage error naming the
    flag."""
    import psutil

    try:
        sizes = tuple(_parse_size(s) for s in text.split(","))
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.reason) from None
    available = psutil.virtual_memory().available
    limit = available // SIZE_HOST_COPIES
    too_big = [s for s in sizes if s > limit]
    if too_big:
        raise argparse.ArgumentTypeError(
            f"{too_big[0]:,} B is too large: measuring a size holds about "
            f"{SIZE_HOST_COPIES} buffers of it, and {available / 2**30:.1f} GiB of host memory "
            f"is available, so at most {limit:,} B ({limit / 2**30:.2f} GiB)")
    return sizes


def _repeats_flag(text: str) -> int:
    """argparse ``type`` of ``--repeats``: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run_profile_cli(args: Sequence[str] | None = None) -> int:
    """Entry point of ``conduit profile``: measure (or load) and print the table.

    Args:
        args: Command-line arguments after ``profile`` (``--sizes 64K,1M --repeats 5
            --refresh --no-cache --json``).

    Returns:
        Exit status (0). A bad ``--sizes`` or ``--repeats`` exits with status 2 and a usage
        line naming the flag.

    Raises:
        ConfigError: The cache folder cannot be written (field ``CONDUIT_CACHE_DIR`` when that
            variable is set, else ``cache_dir``); ``conduit`` prints it as one line, exit
            status 2.
    """
    ap = argparse.ArgumentParser(
        prog="conduit profile", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure copy and gather bandwidths on this machine.\n\n"
                    "The profile is cached as JSON in $CONDUIT_CACHE_DIR, by default "
                    "~/.cache/conduit\n"
                    f"(here: {cache_dir()}), one file per host name, torch version and "
                    "device names;\nthis machine's topology (conduit plan, auto "
                    "placement) reads it.")
    ap.add_argument("--sizes", type=_sizes_flag, default=None,
                    help="comma-separated payload sizes in bytes, with an optional binary "
                         "suffix K (KiB), M (MiB) or G (GiB), e.g. 4096,64K,1M (default: "
                         "64K,1M,16M)")
    ap.add_argument("--repeats", type=_repeats_flag, default=DEFAULT_REPEATS,
                    help=f"timed copies per size and path; the median is kept "
                         f"(default: {DEFAULT_REPEATS})")
    ap.add_argument("--refresh", action="store_true",
                    help="re-measure even when a cached profile of the same sizes exists, "
                         "and overwrite it")
    ap.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ns = ap.parse_args(list(args) if args is not None else None)
    prof = profile_bandwidth(sizes=ns.sizes, repeats=ns.repeats, use_cache=not ns.no_cache,
                             refresh=ns.refresh)
    if ns.json:
        print(json.dumps(prof.to_dict(), indent=1))
    else:
        print(format_table(prof))
        if not ns.no_cache:
            print(f"cache: {cache_path(prof.key)}")
    return 0
