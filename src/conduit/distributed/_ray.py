"""The one place that imports Ray, lazily, and connects to a cluster."""

from __future__ import annotations

import socket
import threading
from types import ModuleType
from typing import Any

from conduit.distributed.errors import ClusterConnectionError, RayUnavailableError


def import_ray() -> ModuleType:
    """The ``ray`` module.

    Raises:
        RayUnavailableError: Ray is not installed; the message names the extra to install.
    """
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailableError(exc) from exc
    return ray


def _probe(address: str, timeout_s: float) -> None:
    """Fail fast on an address nothing listens on (``ray.init`` would retry for a minute)."""
    if address == "auto" or address.startswith("ray://"):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterConnectionError(address, "expected 'host:port' of the cluster's GCS (as "
                                              "ray.init(address=...) takes), 'auto', or "
                                              "'ray://host:port'")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ClusterConnectionError(address, f"no Ray cluster answers there ({exc}); start "
                                              f"one with `ray start --head` or pass "
                                              f"address=None for a local one") from exc


def _host(name: str) -> str:
    """``name`` as an IP address (itself when it does not resolve)."""
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def _check_same(ray: Any, address: str) -> None:
    """Refuse ``address`` when this process is connected to another cluster (``"auto"``
    names the one it is connected to; a Ray Client address is not compared).

    Raises:
        ClusterConnectionError: ``address`` is not the current cluster's GCS address.
    """
    if address == "auto" or address.startswith("ray://"):
        return
    current = ray.get_runtime_context().gcs_address
    host, _, port = address.rpartition(":")
    cur_host, _, cur_port = str(current).rpartition(":")
    ip, cur_ip = _host(host), _host(cur_host)
    here = {ray.util.get_node_ip_address()}

    def local(name: str) -> bool:  # this machine, by a loopback address or the node's own
        return name.startswith("127.") or name in here
    if port != cur_port or (ip != cur_ip and not (local(ip) and local(cur_ip))):
        raise ClusterConnectionError(address, f"this process is already connected to the Ray "
                                              f"cluster at {current}; pass that address, "
                                              f"'auto' or None, or ray.shutdown() first")


_users_lock = threading.Lock()
_users = 0
"""Planes using the Ray that a plane of this process started (0: none runs): it is shut down
when the last of them closes (:func:`release`), not under the others."""
_users_conn: str | None = None  # that Ray's connection_id (another means it is gone)


def connection_id(ray: Any) -> str | None:
    """Which connection to Ray this process holds: the cluster's GCS address and this
    driver's job id (a reconnect to the same cluster is another job), or None when not
    connected (the runtime context would start a local Ray then)."""
    if not ray.is_initialized():
        return None
    try:
        ctx = ray.get_runtime_context()
        return f"{ctx.gcs_address}/{ctx.get_job_id()}"
    except Exception:  # not connected
        return None


def connect(address: str | None, *, timeout_s: float, local_cpus: int | None = None
            ) -> tuple[Any, bool]:
    """Attach to the cluster at ``address`` or, with None, to the Ray this process already
    runs, else start a local one. Token authentication is left as Ray configures it.

    Returns:
        ``(ray, started)``: ``started`` is True when a plane started this Ray (this call or,
        for a plane attaching to it, an earlier one): the plane calls :func:`release` on
        close, and the last plane using it shuts it down.

    Raises:
        RayUnavailableError: Ray is not installed.
        ClusterConnectionError: ``address`` is malformed or nothing answers there, or Ray is
            already connected to another cluster.
    """
    global _users, _users_conn
    ray = import_ray()
    if address is not None:
        if not isinstance(address, str) or not address:
            raise ClusterConnectionError(str(address), "expected a non-empty string")
        _probe(address, min(timeout_s, 5.0))
    with _users_lock:
        if ray.is_initialized():
            if address is not None:
                _check_same(ray, address)
            if _users and connection_id(ray) == _users_conn:  # a plane's Ray: one more user
                _users += 1
                return ray, True
            _users = 0  # not (or no longer) a plane's Ray
            return ray, False
        _start(ray, address, local_cpus)
        _users, _users_conn = 1, connection_id(ray)
        return ray, True


def release(ray: Any, conn: str | None) -> None:
    """A plane that :func:`connect` reported ``started`` closed (``conn``: its
    :func:`connection_id` then): the last one using that Ray shuts it down (a Ray connected
    anew since is left alone)."""
    global _users
    with _users_lock:
        if _users <= 0 or conn != _users_conn:
            return
        _users -= 1
        if _users == 0 and connection_id(ray) == _users_conn:
            ray.shutdown()


def _start(ray: Any, address: str | None, local_cpus: int | None) -> None:
    try:
        if address is None:
            ray.init(address="local", num_cpus=local_cpus, include_dashboard=False,
                     log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise ClusterConnectionError(str(address), f"ray.init failed: {exc}") from exc


def alive_nodes(ray: Any, demand: dict[str, float] | None = None) -> list[str]:
    """Ids of the cluster's live nodes (with ``demand``: those whose resources hold it), the
    driver's node first, then in id order."""
    here = ray.get_runtime_context().get_node_id()
    need = demand or {}
    ids = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and all(
        n.get("Resources", {}).get(key, 0.0) >= amount for key, amount in need.items()))
    return sorted(ids, key=lambda n: n != here)


def lost_object(ray: Any, exc: BaseException, ref: Any) -> bool:
    """Whether ``exc`` says the object of ``ref`` is gone (its owner died, or every copy was
    lost and it cannot be rebuilt): the data is lost, not the shard that read it. A task
    whose argument's owner died reports a nil object id (all ``f``): the object of the only
    reference it was given, ``ref``."""
    lost = getattr(ray.exceptions, "ObjectLostError", None)
    if lost is None or not isinstance(exc, lost):
        return False
    hex_id = getattr(exc, "object_ref_hex", None)
    return hex_id is None or hex_id == ref.hex() or set(hex_id) == {"f"}


def failed_task(ray: Any, exc: BaseException, ref: Any, timeout: float) -> bool:
    """Whether ``exc``, a task's error, is the error of the task that was to make ``ref``'s
    object (the rollout's producer raised, and every task given ``ref`` raises its error).
    Told by fetching ``ref`` (only on this error path) within ``timeout`` seconds."""
    task_error = ray.exceptions.RayTaskError
    if not isinstance(exc, task_error):
        return False
    try:
        ray.get(ref, timeout=timeout)
    except task_error:
        return True
    except Exception:  # not its producer's error (or not known in time): the task's own
        return False
    return False


def actor_died_errors(ray: Any) -> tuple[type[BaseException], ...]:
    """Exceptions that mean a shard's actor (or its node) is gone."""
    exc = ray.exceptions
    return tuple(t for t in (getattr(exc, "RayActorError", None),
                             getattr(exc, "ActorDiedError", None),
                             getattr(exc, "ActorUnavailableError", None),
                             getattr(exc, "NodeDiedError", None),
                             getattr(exc, "ObjectLostError", None),
                             getattr(exc, "OwnerDiedError", None)) if t is not None)
