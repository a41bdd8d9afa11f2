"""Synthetic training throughput with hpc_horovod.torch, in the shape of Horovod's
``pytorch_synthetic_benchmark.py``: random images, a small CNN defined inline, images/s per
worker and in total.

    hpc-horovod run -np 2 python examples/pytorch_synthetic_benchmark.py
"""

from __future__ import annotations

import argparse
import os
import timeit

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import hpc_horovod.torch as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send gradients as float16")
    parser.add_argument("--batch-size", type=int, default=32, help="images per worker")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=32, help="channels of the first layer")
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--no-cuda", action="store_true", help="train on the CPU")
    parser.add_argument("--use-adasum", action="store_true", help="combine with Adasum")
    return parser.parse_args(argv)


def small_cnn(width: int, image_size: int, classes: int = 1000) -> nn.Module:
    """Three conv blocks and a classifier: enough layers for gradients to be reduced while
    earlier layers still compute their backward pass."""
    side = image_size // 8
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * width, 4 * width, 3, padding=1), nn.BatchNorm2d(4 * width), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4 * width * side * side, 512), nn.ReLU(),
        nn.Linear(512, classes),
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
        device = torch.device("cpu")

    model = small_cnn(args.width, args.image_size).to(device)
    # Adasum combines updates rather than averaging them: no learning rate scaling with it.
    lr_scale = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scale)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    kind = "GPU" if cuda else "CPU"
    log("Model: small CNN (inline)")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {kind}s: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {rate:.1f} img/sec per {kind}")
        img_secs.append(rate)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per {kind}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {kind}(s): {hvd.size() * mean:.1f} "
        f"+-{hvd.size() * conf:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
