"""One real three-node Ray cluster (``ray.cluster_utils.Cluster``) for every test of the
package, with Ray's default token authentication left on (its token under ``ray_home``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

NODE_CPUS = 2
NODE_STORE_BYTES = 96 << 20


@pytest.fixture(scope="package")
def cluster(ray_home: Path) -> Iterator[Any]:
    """A head and two worker nodes, the driver attached to it, with token authentication on
    as a local ``ray.init()`` turns it on (the nodes inherit the mode and the token)."""
    ray = pytest.importorskip("ray")
    from ray._private.authentication.authentication_token_setup import (
        enable_token_auth_by_default,
        ensure_token_if_auth_enabled,
    )
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_AUTH_MODE", raising=False)
        mp.setenv("HOME", str(ray_home))
        # What ray.init() does before it starts a local cluster; cluster_utils' nodes skip it.
        enable_token_auth_by_default()
        ensure_token_if_auth_enabled(None, create_token_if_missing=True)
        assert (ray_home / ".ray" / "auth_token").is_file()
        c = Cluster(initialize_head=True,
                    head_node_args={"num_cpus": NODE_CPUS,
                                    "object_store_memory": NODE_STORE_BYTES})
        for _ in range(2):
            c.add_node(num_cpus=NODE_CPUS, object_store_memory=NODE_STORE_BYTES)
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        assert os.environ["RAY_AUTH_MODE"] == "token"  # Ray's own default, left on
        try:
            yield c
        finally:
            ray.shutdown()
            c.shutdown()
