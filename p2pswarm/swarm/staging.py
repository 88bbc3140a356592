"""Moving activations and gradients between the engine's device and the wire's host bytes.

What crosses the wire is a tensor in the run's activation dtype (``TrainConfig.activation_dtype``:
float32, or bfloat16 for GPU runs: half the bytes). ``Staging`` makes the host copy of an output
in that dtype, and puts a received tensor on the device in the compute dtype:

- on an accelerator the host side is a reusable **pinned** buffer per (shape, dtype), copied
  with ``non_blocking=True``: a device-to-host copy is waited for (the bytes are read at once),
  a host-to-device one is ordered on the stream, and the buffer is reused only after the copy
  that read it has finished (an event per buffer);
- on the CPU there is nothing to stage: a cast where the dtypes differ, else the tensor itself.

It runs on the engine's compute thread only (one thread: the buffers need no lock). Imports torch.
"""

from __future__ import annotations

import torch

MAX_BUFFERS = 8  # (shape, dtype) pairs kept pinned: training, evaluation and a last partial batch fit


class Staging:
    """Host buffers for one device (module docstring)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"  # pinned memory and async copies need CUDA
        # (direction, shape, dtype) -> (buffer, event)
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def to_host(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor holding ``tensor`` cast to ``dtype``: valid until the next call with the
        same shape and dtype (the caller turns it into bytes at once)."""
        tensor = tensor.detach()
        if tensor.device.type == "cpu":
            return tensor.to(dtype)
        if not self.pinned:  # mps: a plain copy
            return tensor.to("cpu", dtype)
        buffer, event = self._buffer("out", tuple(tensor.shape), dtype)
        buffer.copy_(tensor.to(dtype), non_blocking=True)  # (the cast on the device: fewer bytes to move)
        event.record()
        event.synchronize()  # the bytes are read right after this
        return buffer

    def to_device(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``tensor`` (a host tensor from the wire) on our device, cast to ``dtype``."""
        if self.device.type == "cpu":
            return tensor.to(dtype)
        if not self.pinned:
            return tensor.to(self.device, dtype)
        buffer, event = self._buffer("in", tuple(tensor.shape), tensor.dtype)
        event.synchronize()  # the previous copy out of this buffer is done
        buffer.copy_(tensor)
        on_device = buffer.to(self.device, non_blocking=True)
        event.record()
        return on_device.to(dtype)

    def _buffer(self, direction: str, shape: tuple, dtype: torch.dtype):
        key = (direction, shape, dtype)
        found = self._buffers.get(key)
        if found is None:
            if len(self._buffers) >= MAX_BUFFERS:
                self._drop_oldest()
            found = (torch.empty(shape, dtype=dtype, pin_memory=True), torch.cuda.Event())
            self._buffers[key] = found
        return found

    def _drop_oldest(self) -> None:
        key = next(iter(self._buffers))
        _, event = self._buffers.pop(key)
        event.synchronize()  # never free pinned memory a copy still reads
