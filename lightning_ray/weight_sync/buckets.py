"""Weights as a few flat byte buffers ("buckets") and back: the unit every GPU transport moves.

A bucket holds tensors of one dtype, back to back, as raw bytes, so each tensor's offset is a multiple of its
element size and a view of the buffer gives it back with no copy. The layout (names, dtype names, shapes, byte
sizes) is vLLM's packed weight-transfer format (`IPCWeightTransferUpdateInfo`, `NCCLWeightTransferUpdateInfo`):
one bucket is one `update_weights` call there, so our buckets and vLLM's chunks are the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import torch

BUCKET_BYTES = 512 << 20  # a 1.5B bf16 model (3.3 GB) is 7 buckets: few calls, bounded receive buffers


@dataclass(frozen=True)
class Bucket:
    names: list[str]
    dtype_names: list[str]  # "bfloat16", ...: what vLLM's update info carries
    shapes: list[list[int]]
    tensor_sizes: list[int] = field(default_factory=list)  # bytes of each tensor, in order

    @property
    def nbytes(self) -> int:
        return sum(self.tensor_sizes)

    def update_info(self) -> dict:
        """vLLM's update-info fields for this bucket (a transport adds its own: IPC handles)."""
        return {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes,
                "tensor_sizes": self.tensor_sizes}


def plan(named: list[tuple[str, torch.Tensor]], bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """Buckets of at most `bucket_bytes` (a larger tensor goes alone), one dtype each, in the tensors' order within a
    dtype."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        by_dtype.setdefault(t.dtype, []).append((name, t))
    buckets: list[Bucket] = []
    for dtype, group in by_dtype.items():
        current: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in group:
            if current and size + _nbytes(t) > bucket_bytes:
                buckets.append(_bucket(current))
                current, size = [], 0
            current.append((name, t))
            size += _nbytes(t)
        if current:
            buckets.append(_bucket(current))
    return buckets


def allocate(buckets: list[Bucket], device: torch.device | str) -> list[torch.Tensor]:
    return [torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in buckets]


def pack(named: dict[str, torch.Tensor], buckets: list[Bucket], buffers: list[torch.Tensor]) -> None:
    """Copy each tensor's bytes into its place (on the buffers' device; a copy, so they outlive ZeRO-3's gather)."""
    for bucket, buffer in zip(buckets, buffers):
        offset = 0
        for name, size in zip(bucket.names, bucket.tensor_sizes):
            flat = named[name].detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[offset:offset + size].copy_(flat, non_blocking=True)
            offset += size


def unpack(buffer: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views of `buffer` (no copy)."""
    out, offset = [], 0
    for name, dtype_name, shape, size in zip(bucket.names, bucket.dtype_names, bucket.shapes, bucket.tensor_sizes):
        out.append((name, buffer[offset:offset + size].view(getattr(torch, dtype_name)).view(shape)))
        offset += size
    return out


def layout_of(buckets: list[Bucket]) -> dict[str, tuple[int, ...]]:
    """Name -> shape over all buckets (what an engine checks before it loads anything)."""
    return {n: tuple(s) for b in buckets for n, s in zip(b.names, b.shapes)}


def matches(buckets: list[Bucket], named: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether a plan still describes these tensors (same names, dtypes and shapes): else plan again."""
    planned = [(n, d, tuple(s)) for b in buckets for n, d, s in zip(b.names, b.dtype_names, b.shapes)]
    return sorted(planned) == sorted((n, _dtype_name(t.dtype), tuple(t.shape)) for n, t in named)


def _bucket(tensors: list[tuple[str, torch.Tensor]]) -> Bucket:
    return Bucket(names=[n for n, _ in tensors], dtype_names=[_dtype_name(t.dtype) for _, t in tensors],
                  shapes=[list(t.shape) for _, t in tensors], tensor_sizes=[_nbytes(t) for _, t in tensors])


def _nbytes(t: torch.Tensor) -> int:
    return prod(t.shape) * t.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
