"""Where a stage computes and in what precision: ``--device`` and ``--precision``, parsed and checked.

``resolve_placement(device_text, precision_text)`` turns the two flags into a ``Placement``, or
raises a one-line ``ConfigError`` before the node starts:

- ``--device auto`` takes the first CUDA device when there is one, else Apple's mps, else the
  CPU; ``cuda`` is ``cuda:0``; ``cuda:N`` must exist;
- ``--precision auto`` is bf16 autocast on CUDA (fp32 master weights and fp32 AdamW states, the
  matrix products in bf16) and fp32 elsewhere. ``bf16`` is allowed on the CPU too (autocast to
  bf16 on CPUs with bf16 units, and how the bf16 path is tested without a GPU), not on mps.
  ``fp16`` is refused everywhere: it needs loss scaling, and a loss scale would have to be
  agreed by every stage of the pipeline (the last stage scales, the first one unscales), which
  the activation protocol does not carry; bf16 has fp32's range and needs none.

The pure core, ``choose_placement``, takes what the machine has as an ``Accelerators`` value;
only ``accelerators()`` asks torch, and imports it lazily: ``import p2pswarm.cli`` stays free of
torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from p2pswarm.errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N", "mps")  # what --device accepts (help text, errors)
PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # what --precision accepts
DEFAULT_DEVICE = "cpu"  # a Placement made in code (tests, in-process swarms) computes where every machine can
DEFAULT_PRECISION = "fp32"  # with the CPU's exact numerics
MIB = 1024 * 1024  # records announce memory in MiB
AUTOCAST_DTYPES = {"fp32": None, "bf16": "bfloat16"}  # precision -> autocast dtype (None: no autocast)

_CUDA = re.compile(r"cuda(?::(\d{1,3}))?")


@dataclass(frozen=True)
class Accelerators:
    """What the machine offers: CUDA devices and whether mps is there."""

    cuda_devices: int = 0
    mps: bool = False


@dataclass(frozen=True)
class Placement:
    """A resolved device (a torch device string: ``cpu``, ``cuda:0``, ``mps``) and precision
    (``fp32`` or ``bf16``: bf16 autocast over fp32 master weights)."""

    device: str = DEFAULT_DEVICE
    precision: str = DEFAULT_PRECISION

    @property
    def device_type(self) -> str:
        """``cpu``, ``cuda`` or ``mps``: what ``torch.autocast`` takes."""
        return self.device.split(":")[0]

    @property
    def accelerator(self) -> bool:
        return self.device_type != "cpu"

    @property
    def autocast_dtype(self) -> str | None:
        """The torch dtype name forwards autocast to, None for plain fp32."""
        return AUTOCAST_DTYPES[self.precision]


def accelerators() -> Accelerators:
    """Ask torch what this machine has (imports torch)."""
    import torch

    mps = getattr(torch.backends, "mps", None)
    return Accelerators(cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
                        mps=bool(mps is not None and mps.is_available()))


def free_device_memory_mb(device: str) -> int:
    """Free memory of an accelerator in MiB (imports torch): CUDA's own count of the whole device
    (other processes included), mps's recommended budget less what it holds; 0 if unknown."""
    import torch

    try:
        if device.startswith("cuda"):
            free, _total = torch.cuda.mem_get_info(torch.device(device))
            return int(free) // MIB
        if device == "mps":
            return max(0, int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())) // MIB
    except (RuntimeError, AssertionError, AttributeError):  # no driver, or one that does not say (a torch
        # without CUDA asserts): announce no memory rather than fail the announcement
        pass
    return 0


def resolve_placement(device_text: str, precision_text: str, found: Accelerators | None = None) -> Placement:
    """The placement the two flags ask for on this machine (``found``: asked of torch when None);
    ConfigError (one line) for a bad value, a device the machine lacks or a precision it cannot do."""
    device_text, precision_text = device_text.strip().lower(), precision_text.strip().lower()
    if device_text not in ("auto", "cpu", "mps") and not _CUDA.fullmatch(device_text):
        raise ConfigError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, not {device_text!r}")
    if precision_text not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision_text!r}")
    if found is None:
        found = Accelerators() if device_text == "cpu" else accelerators()
    return choose_placement(device_text, precision_text, found)


def choose_placement(device_text: str, precision_text: str, found: Accelerators) -> Placement:
    """The pure core of ``resolve_placement`` (its flags already well-formed)."""
    device = _choose_device(device_text, found)
    kind = device.split(":")[0]
    precision = precision_text
    if precision == "auto":
        precision = "bf16" if kind == "cuda" else "fp32"
    if precision == "fp16":
        raise ConfigError("--precision fp16 is not supported (it needs a loss scale that every stage of the "
                          "pipeline agrees on); use bf16, which needs none")
    if precision == "bf16" and kind == "mps":
        raise ConfigError("--precision bf16 is not supported on mps; use fp32 there")
    return Placement(device, precision)


def _choose_device(text: str, found: Accelerators) -> str:
    if text == "auto":
        return "cuda:0" if found.cuda_devices else "mps" if found.mps else "cpu"
    if text == "mps" and not found.mps:
        raise ConfigError("--device mps: this machine has no mps device (Apple silicon with torch's mps build)")
    match = _CUDA.fullmatch(text)
    if match:
        index = int(match.group(1) or 0)
        if index >= found.cuda_devices:
            have = f"{found.cuda_devices} CUDA device(s)" if found.cuda_devices else "no CUDA device"
            raise ConfigError(f"--device {text}: this machine has {have} (torch.cuda.is_available() is "
                              f"{bool(found.cuda_devices)})")
        return f"cuda:{index}"
    return text
