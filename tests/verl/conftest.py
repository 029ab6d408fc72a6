"""tests/verl run in .venv-verl (``make test``): verl pins transformers < 5.11, which the main
test environment cannot share. Elsewhere every module here skips before importing verl."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from typing import Any

import pytest

HAVE_VERL = all(importlib.util.find_spec(m) is not None for m in ("verl", "transfer_queue"))
WHY = "verl is not installed here; tests/verl run in .venv-verl (make test)"


def skip_without_verl() -> None:
    """Skip the calling test module unless verl and TransferQueue are importable."""
    if not HAVE_VERL:
        pytest.skip(WHY, allow_module_level=True)


class KVStore:
    """TransferQueue's key-value calls (``kv_batch_put``, ``kv_list``, ``kv_batch_get``,
    ``kv_clear``) over a dict, with its semantics: tags merge on every put, fields of a key
    accumulate, ``kv_list`` nests by partition; calls are atomic, as the rollout writes while
    the trainer reads. TransferQueue itself needs a Ray cluster, which the CPU tests do not
    start; the GPU check drives the real one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tags: dict[str, dict[str, dict[str, Any]]] = {}
        self.fields: dict[tuple[str, str], dict[str, Any]] = {}

    def _kv_batch_put(self, keys: list[str], partition_id: str, fields: Any = None,
                      tags: list[dict] | None = None) -> None:
        part = self.tags.setdefault(partition_id, {})
        for i, key in enumerate(keys):
            part.setdefault(key, {}).update(tags[i] if tags is not None else {})
            if fields is not None:
                row = self.fields.setdefault((partition_id, key), {})
                for name in fields.keys():  # noqa: SIM118 - a TensorDict iterates rows
                    row[name] = fields[name][i]

    def _kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict]]:
        parts = [partition_id] if partition_id is not None else list(self.tags)
        return {p: {k: dict(t) for k, t in self.tags.get(p, {}).items()} for p in parts}

    def _kv_batch_get(self, keys: list[str], partition_id: str,
                      select_fields: list[str] | None = None) -> Any:
        import torch
        from tensordict import TensorDict

        rows = [self.fields[(partition_id, k)] for k in keys]
        names = select_fields if select_fields is not None else list(rows[0])
        out = {}
        for name in names:
            values = [r[name] for r in rows]
            if len({tuple(v.shape) for v in values}) == 1:
                out[name] = torch.stack(values)
            else:  # ragged, as TransferQueue returns it
                out[name] = torch.nested.nested_tensor(values, layout=torch.jagged)
        return TensorDict(out, batch_size=[len(keys)])

    def _kv_clear(self, keys: list[str] | str, partition_id: str) -> None:
        for key in [keys] if isinstance(keys, str) else keys:
            self.tags.get(partition_id, {}).pop(key, None)
            self.fields.pop((partition_id, key), None)


    def kv_batch_put(self, *args: Any, **kwargs: Any) -> None:
        with self.lock:
            self._kv_batch_put(*args, **kwargs)

    def kv_list(self, *args: Any, **kwargs: Any) -> dict[str, dict[str, dict]]:
        with self.lock:
            return self._kv_list(*args, **kwargs)

    def kv_batch_get(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return self._kv_batch_get(*args, **kwargs)

    def kv_clear(self, *args: Any, **kwargs: Any) -> None:
        with self.lock:
            self._kv_clear(*args, **kwargs)

@pytest.fixture
def kv_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[KVStore]:
    """TransferQueue's module-level calls answered by a :class:`KVStore`."""
    import transfer_queue

    store = KVStore()
    for name in ("kv_batch_put", "kv_list", "kv_batch_get", "kv_clear"):
        monkeypatch.setattr(transfer_queue, name, getattr(store, name))
    yield store


def make_step(*, groups: int, group_size: int, response_length: int = 6, prompt_length: int = 3,
              seed: int = 0, first_uid: int = 0) -> Any:
    """A step as verl's rollout leaves it: ``groups`` prompts with ``group_size`` responses
    each (rows of a group adjacent, as ``DataProto.repeat(interleave=True)`` lays them out),
    padded responses, a reward on each response's last token, and non-tensor entries."""
    import numpy as np
    import torch
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    rows = groups * group_size
    lengths = torch.randint(1, response_length + 1, (rows,), generator=g)
    mask = (torch.arange(response_length) < lengths[:, None]).to(torch.int64)
    rewards = torch.zeros(rows, response_length)
    rewards[torch.arange(rows), lengths - 1] = torch.randint(0, 3, (rows,), generator=g).float()
    responses = torch.randint(3, 50, (rows, response_length), generator=g) * mask
    prompts = torch.randint(3, 50, (rows, prompt_length), generator=g)
    uids = np.array([f"p{first_uid + i // group_size}" for i in range(rows)], dtype=object)
    extra = np.array([{"turn": i, "tools": [i % 3]} for i in range(rows)], dtype=object)
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses,
                 "input_ids": torch.cat([prompts, responses], dim=1),
                 "attention_mask": torch.cat([torch.ones_like(prompts), mask], dim=1),
                 "response_mask": mask, "token_level_rewards": rewards,
                 "old_log_probs": torch.randn(rows, response_length, generator=g) * mask},
        non_tensors={"uid": uids, "data_source": np.array(["digits"] * rows, dtype=object),
                     "extra_info": extra},
        meta_info={"temperature": 1.0})
