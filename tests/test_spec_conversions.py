"""What a batch's values become at the boundary: Python numbers at full precision converted to
the field's dtype only when they fit, numpy arrays of either byte order, and typed refusals
for what cannot be stored."""

import numpy as np
import pytest
import torch

from conduit import ConfigError, ExperienceDataPlane, SpecError
from conduit.spec import ExperienceSpec, FieldSpec, RaggedFieldSpec
from conduit.storage import UniformSampler


def _plane(dtype, shape=(2,)):
    spec = ExperienceSpec.of(x=(shape, dtype))
    return ExperienceDataPlane(spec=spec, capacity=8, batch_size=2, timeout=5)


def test_python_floats_beyond_a_float32_field_are_refused_not_stored_as_inf():
    with _plane(torch.float32) as plane:
        with pytest.raises(SpecError, match="does not fit") as err:
            plane.push({"x": [[1e39, 1.0], [-1e39, 2.0]]})
        assert err.value.field == "x"
        plane.push({"x": [[0.1, 1.0], [3e38, 2.0]]})
        plane.flush()
        stored = plane.buffer.store.column("x")[:2]
        assert torch.equal(stored, torch.tensor([[0.1, 1.0], [3e38, 2.0]], dtype=torch.float32))


def test_python_floats_fill_a_float64_field_at_full_precision():
    with _plane(torch.float64) as plane:
        plane.push({"x": [[0.1, 1e300], [2.0, 3.0]]})
        plane.flush()
        assert plane.buffer.store.column("x")[0].tolist() == [0.1, 1e300]


def test_python_ints_that_would_wrap_an_int32_field_are_refused():
    with _plane(torch.int32) as plane:
        with pytest.raises(SpecError, match="does not fit") as err:
            plane.push({"x": [[2**40, 1], [2, 3]]})
        assert err.value.field == "x"
        plane.push({"x": [[-(2**31), 1], [2**31 - 1, 3]]})
        plane.flush()
        assert plane.buffer.store.column("x")[:2].tolist() == [[-(2**31), 1], [2**31 - 1, 3]]


def test_a_big_endian_array_is_stored_with_its_values():
    with _plane(torch.float32) as plane:
        plane.push({"x": np.array([[1.5, -2.0], [3.0, 4.25]], dtype=">f4")})
        plane.flush()
        assert plane.buffer.store.column("x")[:2].tolist() == [[1.5, -2.0], [3.0, 4.25]]


def test_a_numpy_complex_array_fills_a_complex_field():
    with _plane(torch.complex64) as plane:
        plane.push({"x": np.array([[1 + 2j, 3j], [4, 5 - 1j]], dtype=np.complex64)})
        plane.flush()
        assert plane.buffer.store.column("x")[0].tolist() == [1 + 2j, 3j]


def test_a_nested_tensor_is_refused_naming_the_field():
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    with pytest.raises(SpecError, match="nested") as err:
        ExperienceSpec.of(x=((2,), torch.float32)).validate({"x": nested})
    assert err.value.field == "x"


def test_a_ragged_field_of_a_dtype_torch_cannot_pad_is_refused():
    with pytest.raises(ConfigError) as err:
        RaggedFieldSpec(dtype=torch.float8_e4m3fn)
    assert err.value.field == "dtype"


@pytest.mark.parametrize("shape", [None, 3])
def test_a_field_shape_that_is_not_a_tuple_is_refused(shape):
    with pytest.raises(ConfigError) as err:
        FieldSpec(shape=shape, dtype=torch.float32)
    assert err.value.field == "shape"


def test_uniform_sampler_replacement_must_be_a_bool():
    with pytest.raises(ConfigError) as err:
        UniformSampler(replacement="false")
    assert err.value.field == "replacement"
