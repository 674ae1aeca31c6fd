"""Host tensors to the device without waiting for it. A plain copy from pageable memory waits
for everything queued before it; under async scheduling (engine.async_step) that is the step
being launched, whose inputs, sampling parameters and row indices would then hold the host
until the GPU had finished it. Through pinned memory the copy is queued like a kernel (torch's
pinned-memory cache keeps the buffer until the copy has run)."""

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; on CUDA, through pinned memory, without waiting."""
    if device.type == "cpu":
        return t
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor_on(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(data, dtype)`` on ``device``, without waiting."""
    return to_device(torch.tensor(data, dtype=dtype), device)


def rows_on(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices as an index tensor on ``device``, without waiting."""
    return tensor_on(rows, torch.int64, device)
