"""Out-of-range leaves and slots, states no buffer can have, shared gather memory, empty
writes and malformed arguments: each is refused with a typed error naming what to change
(or, for an empty write, is a no-op), identically on both sum-tree backends."""

import copy

import numpy as np
import pytest
import torch

from conduit.errors import ConfigError, PriorityError, StateError
from conduit.spec import ExperienceSpec
from conduit.storage import (
    ExperienceBuffer,
    FifoSampler,
    MemmapColumnStore,
    PrioritizedSampler,
    SequenceSampler,
    SumTree,
    UniformSampler,
)
from conduit.storage.column_store import GatherOutputs
from conduit.storage.samplers import sampler_from_config

SPEC = ExperienceSpec.of(obs=((2,), torch.float32), done=((), torch.bool))
BACKENDS = ["numba", "numpy"]


def rows(start: int, n: int, done_every: int = 0) -> dict[str, torch.Tensor]:
    x = torch.arange(start, start + n, dtype=torch.float32)
    done = torch.zeros(n, dtype=torch.bool)
    if done_every:
        done = (torch.arange(start, start + n) % done_every) == done_every - 1
    return {"obs": torch.stack([x, -x], 1), "done": done}


def per_buffer(capacity: int = 8, n: int = 4) -> ExperienceBuffer:
    buf = ExperienceBuffer(spec=SPEC, capacity=capacity,
                           sampler=PrioritizedSampler(alpha=1.0, beta=1.0, seed=0))
    buf.extend(rows(0, n))
    return buf


# -- 1. SumTree leaves outside [0, capacity), capacity < 1 -------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("capacity, leaf", [(4, -1), (5, 6), (5, 5), (4, 40), (4, -100)])
def test_sum_tree_refuses_leaves_outside_its_capacity(backend, capacity, leaf):
    tree = SumTree(capacity=capacity, backend=backend)
    tree.set(np.arange(capacity), np.ones(capacity))
    before = (tree._sum.copy(), tree._min.copy())
    for call in (lambda: tree.set(np.array([1, leaf]), np.array([7.0, 100.0])),
                 lambda: tree.clear(np.array([1, leaf])),
                 lambda: tree.get(np.array([leaf]))):
        with pytest.raises(ConfigError) as err:
            call()
        assert err.value.field == "idx"
        np.testing.assert_array_equal(tree._sum, before[0])  # nothing changed, no node
        np.testing.assert_array_equal(tree._min, before[1])
    assert tree.total == capacity


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("capacity", [0, -3, 2.5, True])
def test_sum_tree_refuses_a_capacity_below_one(backend, capacity):
    with pytest.raises(ConfigError) as err:
        SumTree(capacity=capacity, backend=backend)
    assert err.value.field == "capacity"


def test_prioritized_priorities_refuse_slots_outside_the_buffer():
    buf = per_buffer()
    for bad in (torch.tensor([-1]), torch.tensor([8]), torch.tensor([0.5])):
        with pytest.raises(PriorityError, match="indices"):
            buf.sampler.priorities(bad)
    got = buf.sampler.priorities(torch.tensor([[0], [1]]))
    assert got.shape == (2, 1) and torch.all(got > 0)


# -- 2. gather memory shared with another process ----------------------------------------------


def test_a_set_shared_with_another_process_is_never_reused():
    buf = ExperienceBuffer(spec=SPEC, capacity=100)
    buf.extend(rows(0, 100))
    batch = buf.gather(torch.arange(8))
    batch["obs"].share_memory_()  # what torch.multiprocessing does to a tensor it sends
    storage = batch["obs"].untyped_storage()  # stands for the other process's mapping
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    expected = batch["obs"].clone()
    del batch  # no reference left in this process
    for _ in range(20):
        out = buf.gather(torch.randint(0, 100, (8,)))
        for t in out.values():
            assert not start <= t.data_ptr() < end
            assert not t.untyped_storage().is_shared()
    seen = torch.empty(0, dtype=torch.float32).set_(storage, 0, (8, 2))
    torch.testing.assert_close(seen, expected)


def test_gather_outputs_drops_a_shared_set_and_keeps_reusing_the_others():
    outputs = GatherOutputs(SPEC.fields, keep=2)
    first = outputs.take(4)
    key = first["obs"].data_ptr()
    del first
    again = outputs.take(4)
    assert again["obs"].data_ptr() == key  # reused while not shared
    again["obs"].share_memory_()
    shared = again["obs"].data_ptr()
    del again
    ptrs = set()
    for _ in range(3):
        out = outputs.take(4)
        assert out["obs"].data_ptr() != shared and not out["obs"].is_shared()
        ptrs.add(out["obs"].data_ptr())
        del out
    assert len(ptrs) == 1  # the set that replaced it is reused again


# -- 3. a stale update given as a list after clear() -------------------------------------------


def test_a_stale_list_update_after_clear_does_not_land_on_new_rows():
    buf = per_buffer(capacity=4, n=4)
    slots = buf.sample(4)["_index"].tolist()  # as sent to a remote learner
    buf.clear()
    buf.extend(rows(100, 4))
    before = buf.sampler.tree.get(np.arange(4)).copy()
    assert buf.update_priorities(slots, [50.0] * 4) == 0
    np.testing.assert_array_equal(buf.sampler.tree.get(np.arange(4)), before)
    # The new rows, once delivered, take updates again.
    fresh = buf.sample(4)["_index"].tolist()
    assert buf.update_priorities(fresh, [50.0] * 4) == 4


# -- 4. prioritized states no sampler can have -------------------------------------------------


@pytest.mark.parametrize("spoil, key", [
    (lambda s: s["sampler"]["tree"]["leaves"].__setitem__(0, 0.0), "tree.leaves"),
    (lambda s: s["sampler"]["tree"]["leaves"].__setitem__(slice(0, 4), 1e308), "tree.leaves"),
    (lambda s: s["sampler"]["tree"]["leaves"].__setitem__(1, float("inf")), "tree.leaves"),
    (lambda s: s["sampler"].__setitem__("max_priority", 1e308), "sampler.max_priority"),
    (lambda s: s["sampler"].__setitem__("max_priority", float("inf")), "sampler.max_priority"),
])
def test_prioritized_load_refuses_leaves_it_cannot_reach(spoil, key):
    state = per_buffer().state_dict()
    spoil(state)
    buf = per_buffer()
    before = buf.state_dict()
    with pytest.raises(StateError) as err:
        buf.load_state_dict(state)
    assert err.value.key == key
    after = buf.state_dict()
    torch.testing.assert_close(after["sampler"]["tree"], before["sampler"]["tree"])
    assert after["sampler"]["max_priority"] == before["sampler"]["max_priority"]


def test_a_prioritized_state_saved_under_another_beta_loads_back():
    """``beta`` is not part of the state and changes at run time (RLlib's sample(beta=)): the
    priorities it allowed when they were set load back under any beta."""
    buf = per_buffer()
    buf.sampler.beta = 0.0  # no weight bound: priorities up to the float-range bound
    assert buf.update_priorities(buf.sample(4)["_index"], torch.full((4,), 1e150,
                                                                dtype=torch.float64)) == 4
    state = buf.state_dict()
    for beta in (0.0, 0.4, 1.0):
        again = per_buffer()
        again.sampler.beta = beta
        again.load_state_dict(state)
        torch.testing.assert_close(again.state_dict()["sampler"]["tree"],
                                   state["sampler"]["tree"])


def test_prioritized_load_refuses_priorities_for_slots_the_writer_does_not_hold():
    state = per_buffer().state_dict()
    state["sampler"]["tree"]["leaves"][6] = 1000.0
    state["sampler"]["tree"]["set"][6] = True
    buf = per_buffer()
    before = buf.sampler.tree.get(np.arange(8)).copy()
    with pytest.raises(StateError) as err:
        buf.load_state_dict(state)
    assert err.value.key == "sampler.tree.set"  # as the sampler's other keys
    np.testing.assert_array_equal(buf.sampler.tree.get(np.arange(8)), before)


def test_prioritized_states_it_made_load_back_even_with_a_small_leaf_bound():
    # beta=10 makes leaf_bound() below the leaf new rows get ((1 + eps) ** alpha).
    for sampler in (PrioritizedSampler(alpha=1.0, beta=1.0), PrioritizedSampler(beta=10.0)):
        buf = ExperienceBuffer(spec=SPEC, capacity=8, sampler=sampler)
        buf.extend(rows(0, 5))
        batch = buf.sample(3)
        buf.update_priorities(batch["_index"], torch.full((3,), 0.01))
        other = ExperienceBuffer(spec=SPEC, capacity=8, sampler=copy.deepcopy(sampler))
        other.load_state_dict(buf.state_dict())
        np.testing.assert_array_equal(other.sampler.tree.get(np.arange(8)),
                                      buf.sampler.tree.get(np.arange(8)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sum_tree_load_refuses_a_set_leaf_of_zero(backend):
    tree = SumTree(capacity=4, backend=backend)
    with pytest.raises(StateError, match="slot 0"):
        tree.load_state_dict({"leaves": np.array([0.0, 1.0, 1.0, 1.0]),
                              "set": np.ones(4, bool)})
    tree.load_state_dict({"leaves": np.array([0.0, 1.0, 1.0, 1.0]),
                          "set": np.array([False, True, True, True])})  # unset: fine
    assert tree.total == 3


def test_sum_tree_backends_agree_on_weights_when_a_leaf_is_zero():
    out = []
    for backend in BACKENDS:
        tree = SumTree(capacity=4, backend=backend)
        tree.set(np.arange(4), np.array([0.0, 1.0, 1.0, 1.0]))
        out.append(tree.stratified_draw(np.full(4, 0.5), size=4, beta=0.4))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_array_equal(out[0][1], out[1][1])


# -- 5. FifoSampler layouts that are not a permutation -----------------------------------------


@pytest.mark.parametrize("parts", [
    [torch.tensor([0.0, 1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])],
    [torch.tensor([0, 1, 99]), torch.tensor([3, 4, 5])],
    [torch.tensor([0, 1, 7]), torch.tensor([3, 4, 5])],
    [torch.tensor([0, 0, 0]), torch.tensor([0, 0, 0])],
    [torch.tensor([0, 1, -1]), torch.tensor([3, 4, 5])],
    [torch.tensor([True, False]), torch.tensor([True])],
])
def test_fifo_load_refuses_a_layout_that_is_not_each_row_once(parts):
    def make():
        buf = ExperienceBuffer(spec=SPEC, capacity=8, sampler=FifoSampler(num_minibatches=2))
        buf.extend(rows(0, 6))
        buf.sampler.begin_epoch(6, iteration=0, epoch=0)
        return buf

    state = make().state_dict()
    state["sampler"]["parts"] = parts
    buf = make()
    layout = [p.clone() for p in buf.sampler._parts]
    with pytest.raises(StateError) as err:
        buf.load_state_dict(state)
    assert err.value.key == "sampler.parts"
    assert all(torch.equal(a, b) for a, b in zip(buf.sampler._parts, layout))


def test_fifo_load_takes_an_int32_layout_as_int64():
    buf = ExperienceBuffer(spec=SPEC, capacity=8, sampler=FifoSampler(num_minibatches=2))
    buf.extend(rows(0, 6))
    buf.sampler.begin_epoch(6, iteration=0, epoch=0)
    state = buf.state_dict()
    state["sampler"]["parts"] = [p.to(torch.int32) for p in state["sampler"]["parts"]]
    buf.load_state_dict(state)
    assert all(p.dtype == torch.int64 for p in buf.sampler._parts)
    assert buf.sample(3)["obs"].shape == (3, 2)


# -- 6. an empty write -------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: SequenceSampler(length=2), PrioritizedSampler,
                                  UniformSampler, FifoSampler])
def test_an_empty_write_is_a_no_op(make):
    buf = ExperienceBuffer(spec=SPEC, capacity=8, sampler=make())
    buf.extend(rows(0, 3, 2))
    assert buf.extend(rows(0, 0)).numel() == 0
    assert len(buf) == 3
    if isinstance(buf.sampler, SequenceSampler):
        assert buf.sampler._cursor == 3
        assert buf.sample(2)["obs"].shape == (2, 2, 2)


# -- 7. malformed gather and update arguments --------------------------------------------------


@pytest.mark.parametrize("info", [[0, 1], np.array([0, 1]), torch.tensor(1), (0, 1)])
def test_gather_refuses_slots_that_are_not_a_tensor_with_a_batch_dimension(info):
    buf = per_buffer()
    with pytest.raises(ConfigError) as err:
        buf.gather(info)
    assert err.value.field == "indices"


def test_update_priorities_takes_bfloat16_priorities():
    buf = per_buffer()
    batch = buf.sample(2)
    assert buf.update_priorities(batch["_index"],
                                 torch.tensor([3.0, 5.0], dtype=torch.bfloat16)) == 2
    assert buf.update_priorities([0], torch.tensor([2.0], dtype=torch.bfloat16)) == 1
    assert buf.sampler.max_priority == 5.0
    with pytest.raises(PriorityError, match="indices"):
        buf.sampler.update_priorities(torch.tensor([0.0], dtype=torch.bfloat16),
                                      torch.tensor([1.0]))


def test_update_priorities_with_a_two_dimensional_index_matches_its_rows():
    buf = per_buffer()
    batch = buf.gather(torch.tensor([[0], [1], [2]]))
    assert buf.update_priorities(batch["_index"], torch.tensor([5.0, 6.0, 7.0])) == 3
    np.testing.assert_allclose(buf.sampler.tree.get(np.arange(3)),
                               np.array([5.0, 6.0, 7.0]) + buf.sampler.eps)


@pytest.mark.parametrize("device", ["bogus", "cuda:99", 3.5])
def test_sample_and_gather_refuse_a_device_this_machine_lacks(device):
    buf = per_buffer()
    with pytest.raises(ConfigError) as err:
        buf.sample(2, device=device)
    assert err.value.field == "device"
    with pytest.raises(ConfigError) as err:
        buf.gather(torch.tensor([0, 1]), device=device)
    assert err.value.field == "device"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_sample_to_cuda_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        per_buffer().sample(2, device="cuda")
    assert err.value.field == "device"


def test_sample_to_the_cpu_by_name_still_works():
    assert per_buffer().sample(2, device="cpu")["obs"].shape == (2, 2)


# -- 8. MemmapColumnStore folders that are not folders -----------------------------------------


def test_memmap_store_refuses_a_directory_that_is_a_file_or_lies_under_one(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "manifest.json").mkdir()
    for directory in (afile, afile / "x", tmp_path / "s"):
        with pytest.raises(ConfigError) as err:
            MemmapColumnStore(directory=directory, spec=SPEC, capacity=4)
        assert err.value.field == "directory"
    assert afile.read_text() == "x"


# -- 9. sampler_from_config --------------------------------------------------------------------


@pytest.mark.parametrize("kind, config", [
    ("UniformSampler", {"bogus": 1}),
    ("SequenceSampler", {}),  # length is required
    ("PrioritizedSampler", None),
    ("PrioritizedSampler", [("alpha", 0.5)]),
    ("FifoSampler", {1: 2}),
    (None, {}),
    (["UniformSampler"], {}),
])
def test_sampler_from_config_refuses_configs_that_do_not_fit(kind, config):
    with pytest.raises(ConfigError) as err:
        sampler_from_config(kind, config)
    assert err.value.field == "sampler"


def test_sampler_from_config_rebuilds_every_built_in_sampler():
    for sampler in (UniformSampler(seed=3), PrioritizedSampler(alpha=0.5),
                    FifoSampler(num_minibatches=2), SequenceSampler(length=3)):
        again = sampler_from_config(type(sampler).__name__, sampler.config())
        assert type(again) is type(sampler) and again.config() == sampler.config()


@pytest.mark.parametrize(("kwargs", "field"), [({"spec": "x"}, "spec"),
                                               ({"sampler": "uniform"}, "sampler"),
                                               ({"placement": "cpu"}, "placement"),
                                               ({"store": 1}, "store")])
def test_buffer_parts_of_the_wrong_type_are_refused_by_name(kwargs, field):
    """Defect: these raised AttributeErrors from deep inside the constructor."""
    with pytest.raises(ConfigError) as err:
        ExperienceBuffer(**{"spec": SPEC, "capacity": 8, **kwargs})
    assert err.value.field == field


@pytest.mark.parametrize("key", [3, "", None])
def test_a_sequence_boundary_key_that_is_not_a_name_is_refused(key):
    """Defect: SequenceSampler(boundary_key=3) was accepted and failed at the first pull."""
    with pytest.raises(ConfigError) as err:
        SequenceSampler(length=2, boundary_key=key)
    assert err.value.field == "boundary_key"
