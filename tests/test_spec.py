import numpy as np
import pytest
import torch

from conduit import ConfigError, ExperienceSpec, FieldSpec, SpecError


def test_bytes_per_sample_and_names():
    spec = ExperienceSpec.of(obs=((4, 2), torch.float32), action=((), torch.int64),
                             image=((3, 8, 8), torch.uint8))
    assert spec.names == ("obs", "action", "image")
    assert spec.bytes_per_sample == 4 * 2 * 4 + 8 + 3 * 8 * 8


def test_validate_converts_numpy_and_counts_rows(small_spec):
    batch = {"obs": np.zeros((5, 4), np.float32), "id": np.arange(5), "done": np.zeros(5, bool)}
    out, rows = small_spec.validate(batch)
    assert rows == 5 and all(isinstance(v, torch.Tensor) for v in out.values())


@pytest.mark.parametrize(("batch", "field", "words"), [
    ({"obs": torch.zeros(3, 4), "id": torch.zeros(3, dtype=torch.int64),
      "done": torch.zeros(3, dtype=torch.bool), "extra": torch.zeros(3)}, "extra", "unknown"),
    ({"obs": torch.zeros(3, 4), "id": torch.zeros(3, dtype=torch.int64)}, "done", "missing"),
    ({"obs": torch.zeros(3, 5), "id": torch.zeros(3, dtype=torch.int64),
      "done": torch.zeros(3, dtype=torch.bool)}, "obs", "shape"),
    ({"obs": torch.zeros(3, 4, dtype=torch.float64), "id": torch.zeros(3, dtype=torch.int64),
      "done": torch.zeros(3, dtype=torch.bool)}, "obs", "dtype"),
    ({"obs": torch.zeros(3, 4), "id": torch.zeros(2, dtype=torch.int64),
      "done": torch.zeros(3, dtype=torch.bool)}, "id", "rows"),
])
def test_validate_names_the_field(small_spec, batch, field, words):
    with pytest.raises(SpecError) as ei:
        small_spec.validate(batch)
    assert ei.value.field == field
    assert field in str(ei.value) and words in str(ei.value)


def test_validate_device(small_spec):
    batch = {"obs": torch.zeros(3, 4), "id": torch.zeros(3, dtype=torch.int64),
             "done": torch.zeros(3, dtype=torch.bool)}
    with pytest.raises(SpecError, match="device"):
        small_spec.validate(batch, device=torch.device("meta"))


def test_bad_specs_rejected():
    with pytest.raises(ConfigError):
        ExperienceSpec(fields={})
    with pytest.raises(ConfigError, match="_index"):
        ExperienceSpec.of(_index=((), torch.int64))
    with pytest.raises(ConfigError, match="shape"):
        FieldSpec(shape=(-1,))
    with pytest.raises(ConfigError, match="dtype"):
        FieldSpec(shape=(1,), dtype="float32")  # type: ignore[arg-type]


def test_spec_is_frozen_and_round_trips(small_spec):
    with pytest.raises(TypeError):
        small_spec.fields["x"] = FieldSpec()  # type: ignore[index]
    assert ExperienceSpec.from_dict(small_spec.to_dict()) == small_spec
    wider = small_spec.with_field("obs", FieldSpec((8,), torch.float32))
    assert wider.bytes_per_sample == small_spec.bytes_per_sample + 16


@pytest.mark.parametrize(("dtype", "twin"), [(torch.uint16, "int16"), (torch.uint32, "int32"),
                                             (torch.uint64, "int64"),
                                             (torch.float8_e4m3fn, "int8")])
def test_a_dtype_the_store_cannot_gather_is_refused_with_its_integer_twin(dtype, twin):
    # A 1-D uint16 column has no index_select kernel: the plane failed on its first gather.
    with pytest.raises(ConfigError, match=f"torch.{twin}") as ei:
        ExperienceSpec.of(x=((), dtype))
    assert ei.value.field == "dtype"
    spec = ExperienceSpec.of(x=((), getattr(torch, twin)), y=((2,), torch.bfloat16))
    col = torch.zeros(8, dtype=spec.fields["x"].dtype)
    assert torch.index_select(col, 0, torch.tensor([1, 3])).shape == (2,)


def test_a_sparse_field_is_refused_before_any_row_is_written(small_spec):
    # A sparse tensor passed validation and failed inside the store write: the rows before
    # it were counted as written, zeros where the write stopped.
    from conduit.storage import ExperienceBuffer
    buf = ExperienceBuffer(spec=small_spec, capacity=8)
    batch = {"obs": torch.ones(3, 4).to_sparse(), "id": torch.arange(3),
             "done": torch.zeros(3, dtype=torch.bool)}
    with pytest.raises(SpecError, match="to_dense") as ei:
        buf.extend(batch)
    assert ei.value.field == "obs" and len(buf) == 0 and buf.total_written == 0
    buf.extend({**batch, "obs": batch["obs"].to_dense()})
    assert len(buf) == 3 and buf.gather(torch.arange(3))["obs"].eq(1).all()


def test_a_conjugate_view_is_stored_as_the_values_it_shows():
    from conduit.storage import ExperienceBuffer
    spec = ExperienceSpec.of(z=((2,), torch.complex64), id=((), torch.int64))
    buf = ExperienceBuffer(spec=spec, capacity=8)
    z = (torch.ones(3, 2, dtype=torch.complex64) * (1 + 2j)).conj()
    assert z.is_conj()
    buf.extend({"z": z, "id": torch.arange(3)})
    got = buf.gather(torch.arange(3))
    assert len(buf) == 3 and torch.equal(got["z"], torch.full((3, 2), 1 - 2j))
    assert got["id"].tolist() == [0, 1, 2]
