"""The packed upload (rollout/device/staging.py) through its staging ring: values, dtypes and alignment hold,
and a slot written again never changes a tensor an earlier upload returned (on the GPU: while the
device is still busy with work queued before the copies)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.device.staging import Staging, to_device


def _arrays(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [
        rng.integers(0, 1 << 40, size=n, dtype=np.int64),
        rng.integers(0, 1 << 20, size=(2, n), dtype=np.int32),
        rng.random(n, dtype=np.float32),
        rng.random(3),
        rng.random(n) > 0.5,
        np.zeros(0, dtype=np.int32),
    ]


def _check(arrays: list[np.ndarray], out: list[torch.Tensor]) -> None:
    for a, t in zip(arrays, out):
        assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
        assert np.array_equal(t.cpu().numpy(), a)
        assert a.size == 0 or t.data_ptr() % 16 == 0


def _ring_keeps_earlier_uploads(device: torch.device, busy) -> Staging:
    staging = Staging(device, slots=3)
    rng = np.random.default_rng(0)
    sent = []
    for i in range(20):  # the ring wraps six times; sizes grow past the slots' first buffers
        busy()
        arrays = _arrays(rng, 1 + 700 * i)
        sent.append((arrays, to_device(arrays, device, staging)))
    for arrays, out in sent:
        _check(arrays, out)
    return staging


def test_ring_on_the_cpu_keeps_every_upload_and_grows_its_slots():
    staging = _ring_keeps_earlier_uploads(torch.device("cpu"), lambda: None)
    assert 3 <= staging.grown < 20  # buffers grow by doubling, not once per upload


def test_upload_without_a_ring_and_an_empty_one():
    arrays = _arrays(np.random.default_rng(1), 5)
    _check(arrays, to_device(arrays, torch.device("cpu")))
    assert to_device([], torch.device("cpu"), Staging(torch.device("cpu"))) == []
    with pytest.raises(ValueError, match="slots"):
        Staging(torch.device("cpu"), slots=0)


@pytest.mark.gpu
def test_ring_on_the_gpu_waits_for_copies_queued_behind_device_work():
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)

    def busy() -> None:  # a few ms of queued work, so the copies are still pending at reuse
        for _ in range(4):
            a.matmul(a)

    staging = _ring_keeps_earlier_uploads(dev, busy)
    assert all(b is None or b.is_pinned() for b in staging._buffers)
    torch.cuda.synchronize()
