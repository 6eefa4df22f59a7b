import pytest
import torch

from expertmesh import wire
from expertmesh.errors import InvalidRequest
from expertmesh.v1 import experts_pb2 as pb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64])
def test_round_trip_is_bit_exact(dtype):
    t = (torch.randn(5, 7) * 100).to(dtype)
    back = wire.decode(wire.encode(t))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_empty_and_non_contiguous():
    assert wire.decode(wire.encode(torch.empty(0, 4))).shape == (0, 4)
    t = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(wire.decode(wire.encode(t)), t)


def test_bytes_must_match_shape():
    msg = wire.encode(torch.ones(2, 3))
    msg.data = msg.data[:-4]
    with pytest.raises(InvalidRequest, match=r"hidden: 20 bytes do not match shape \[2, 3\]"):
        wire.decode(msg, "hidden")


def test_unset_dtype_and_negative_shape_are_refused():
    with pytest.raises(InvalidRequest, match="unsupported or unset dtype"):
        wire.decode(pb.Tensor(shape=[1], data=b"\0\0\0\0"))
    with pytest.raises(InvalidRequest, match="negative dimension"):
        wire.decode(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1], data=b""))


def test_unsupported_dtype_cannot_be_encoded():
    with pytest.raises(InvalidRequest, match="cannot travel"):
        wire.encode(torch.ones(2, dtype=torch.float64))
