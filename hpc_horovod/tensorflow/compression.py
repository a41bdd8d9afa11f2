"""Gradient compression for the allreduce: cast to a smaller dtype before the collective and back
after it (Horovod's ``hvd.Compression.none`` and ``hvd.Compression.fp16``)."""

from __future__ import annotations

import tensorflow as tf


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Send floating point tensors as float16 (half the bytes); other dtypes as they are."""

    @staticmethod
    def compress(tensor):
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            return tf.cast(tensor, tf.float16), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The available compressors, as in ``hvd.DistributedOptimizer(opt, compression=...)``."""

    none = NoneCompressor
    fp16 = FP16Compressor
