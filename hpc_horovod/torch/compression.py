"""Gradient compression applied around an allreduce (Horovod's ``hvd.Compression``)."""

from __future__ import annotations

import torch


class Compressor:
    """Interface: ``compress`` returns ``(tensor, ctx)``; ``decompress(tensor, ctx)`` undoes it."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default): the tensor goes on the wire as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Send floating point tensors as float16 (half the bytes); other dtypes pass unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        compressed = tensor
        if tensor.dtype.is_floating_point:
            compressed = tensor.type(torch.float16)
        return compressed, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        if ctx.is_floating_point:
            return tensor.type(ctx)
        return tensor


class Compression:
    """Optional gradient compression algorithm used during allreduce."""

    none = NoneCompressor
    fp16 = FP16Compressor
