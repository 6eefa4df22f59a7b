import pytest
import torch

from expertmesh.contracts import wire
from expertmesh.contracts.errors import InvalidRequest
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


def test_buffer_views_of_a_layout_seen_before_are_the_same_views_and_bad_layouts_stay_refused():
    from expertmesh.contracts import frames as wire_frames

    shared = wire_frames.BufferViews(torch.zeros(16384, dtype=torch.uint8))
    hidden, ids = torch.randn(3, 8), torch.tensor([[1, -1], [0, 2], [2, 1]], dtype=torch.int32)
    metas = [wire_frames.meta(hidden), wire_frames.meta(ids), wire_frames.meta(ids.float())]
    first = shared.views(metas, wire_frames.REQUEST_TENSORS)
    for view, tensor in zip(first, (hidden, ids, ids.float())):
        view.copy_(tensor)
    again = shared.views([pb.TensorMeta.FromString(m.SerializeToString()) for m in metas], wire_frames.REQUEST_TENSORS)
    assert all(a is b for a, b in zip(first, again))  # made once: a decode loop repeats its layouts
    assert torch.equal(again[0], hidden) and torch.equal(again[1], ids)
    # another shape, or the same tensors at another offset, is another layout
    (one_row,) = shared.views([wire_frames.meta(hidden[:1])], wire_frames.ANSWER_TENSORS)
    assert torch.equal(one_row, hidden[:1])
    (later,) = shared.views([wire_frames.meta(hidden)], wire_frames.ANSWER_TENSORS, start=wire_frames.span(metas))
    assert later.data_ptr() == shared.buffer.data_ptr() + wire_frames.span(metas)
    too_big = [pb.TensorMeta(dtype=metas[0].dtype, shape=[1000, 8], nbytes=32000)]
    for _ in range(2):  # a refused layout is never remembered as a good one
        with pytest.raises(InvalidRequest, match="do not fit"):
            shared.views(too_big, wire_frames.ANSWER_TENSORS)
    for n in range(1, wire_frames.MAX_CACHED_LAYOUTS + 2):  # many layouts: kept bounded, still right
        (rows,) = shared.views([wire_frames.meta(hidden[: n % 3 + 1])], wire_frames.ANSWER_TENSORS, start=64 * n)
        assert rows.shape == (n % 3 + 1, 8) and rows.data_ptr() == shared.buffer.data_ptr() + 64 * n
    assert len(shared._layouts) <= wire_frames.MAX_CACHED_LAYOUTS
