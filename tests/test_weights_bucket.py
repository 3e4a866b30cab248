"""Flattened buckets and IPC handles, without an engine."""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from rollout.process import ipc
from rollout.weights.bucket import (
    FlattenedBucket,
    TensorMeta,
    as_bucket,
    layout,
    pack,
    parse_dtype,
    unpack,
    validate,
)


def mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes: the next entry is misaligned
        ("b", torch.randn(7, generator=g)),
        ("c", torch.randn(2, 3, 4, generator=g, dtype=torch.float64)),
        ("d", torch.tensor(1.5, dtype=torch.float16)),  # 0-dim
        ("e", torch.randn(4, 6, generator=g).T),  # non-contiguous
    ]


def test_pack_unpack_round_trip_mixed_dtypes():
    named = mixed()
    b = pack(named)
    assert b.buffer.dtype == torch.uint8 and b.nbytes == sum(t.numel() * t.element_size() for _, t in named)
    assert [m.offset for m in b.metas] == [0, 30, 58, 250, 252]  # back to back, as SGLang lays them out
    for (name, t), (name2, u) in zip(named, unpack(b)):
        assert name == name2 and u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)


def test_pack_into_buffer_with_cast_and_layout_from_specs():
    named = mixed()
    out = torch.zeros(4096, dtype=torch.uint8)
    b = pack(named, out=out, dtype=torch.float32)
    assert b.buffer.data_ptr() == out.data_ptr() and b.nbytes == 4 * sum(t.numel() for _, t in named)
    for (_, t), (_, u) in zip(named, unpack(b)):
        assert u.dtype == torch.float32 and torch.equal(u, t.float())
    # a receiver rebuilds the same metadata from names, dtype names and shapes alone
    rebuilt = layout([m.name for m in b.metas], ["float32"] * len(named), [list(m.shape) for m in b.metas])
    assert rebuilt == b.metas
    with pytest.raises(ValueError, match="at least"):
        pack(named, out=torch.zeros(8, dtype=torch.uint8))


def test_unpack_views_share_the_buffer():
    b = pack([("x", torch.zeros(4)), ("y", torch.zeros(2, 2))])
    x = dict(unpack(b))["x"]
    b.buffer[:4].fill_(255)
    assert x.data_ptr() == b.buffer.data_ptr() and torch.isnan(x[0])


@pytest.mark.parametrize(
    "metas, match",
    [
        ([TensorMeta("x", torch.float32, (4,), 12)], "beyond the buffer"),
        ([TensorMeta("x", torch.float32, (2,), 0), TensorMeta("y", torch.float32, (2,), 4)], "overlap"),
        ([TensorMeta("x", torch.float32, (2,), -1)], "offset"),
        ([TensorMeta("x", torch.float32, (-2,), 0)], "non-negative"),
        ([TensorMeta("x", "float32x", (2,), 0)], "not a torch dtype"),
        ([], "non-empty"),
        (["x"], "TensorMeta"),
    ],
)
def test_validate_rejects_bad_metadata(metas, match):
    with pytest.raises((ValueError, TypeError), match=match):
        validate(FlattenedBucket(torch.zeros(16, dtype=torch.uint8), metas))


def test_validate_rejects_bad_buffers():
    metas = [TensorMeta("x", torch.float32, (2,), 0)]
    for buf in (
        torch.zeros(4),
        torch.zeros(4, 4, dtype=torch.uint8),
        torch.zeros(32, dtype=torch.uint8)[::2],
    ):
        with pytest.raises(ValueError, match="contiguous 1-D uint8"):
            validate(FlattenedBucket(buf, metas))
    with pytest.raises(TypeError, match="torch.Tensor"):
        validate(FlattenedBucket([0] * 8, metas))


def test_layout_and_dtype_parsing_errors():
    assert parse_dtype("torch.bfloat16") is torch.bfloat16 and parse_dtype("float16") is torch.float16
    with pytest.raises(TypeError, match="not a torch dtype"):
        parse_dtype("Tensor")
    with pytest.raises(ValueError, match="differ in length"):
        layout(["a", "b"], ["float32"], [[1], [2]])
    with pytest.raises(TypeError, match="sequence of ints"):
        layout(["a"], ["float32"], ["12"])
    with pytest.raises(TypeError, match="must be a str"):
        layout([3], ["float32"], [[1]])
    with pytest.raises(TypeError, match="flattened_tensor"):
        as_bucket([("a", torch.zeros(1))])


def test_handles_carry_no_data():
    big = torch.randn(1 << 20)  # 4 MB
    h = ipc.share(big)
    assert len(ForkingPickler.dumps(h)) < 4096  # a file descriptor and metadata, not the bytes
    assert torch.equal(h.open(), big)
    bucket = pack([("w", big)])
    wire = ipc.to_handles(("update", bucket), set())
    assert isinstance(wire[1].buffer, ipc.TensorHandle) and wire[1].metas == bucket.metas
    assert torch.equal(dict(unpack(ipc.open_handles(wire)[1]))["w"], big)
    assert not big.is_shared()  # the caller's tensor is copied into shared memory, not moved there
