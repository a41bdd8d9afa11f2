"""Training throughput on synthetic data: images per second of a small CNN trained with
hvd.DistributedGradientTape inside tf.function, for the run's number of processes.

    hpc-horovod run -np 1 python examples/tensorflow2_synthetic_benchmark.py
    hpc-horovod run -np 2 python examples/tensorflow2_synthetic_benchmark.py

Compare "Total img/sec" between runs to read the scaling efficiency
(total on N processes / (N x total on 1)). On a shared CPU machine pass
``--threads`` so that the processes do not oversubscribe the cores.
"""

from __future__ import annotations

import argparse
import timeit

import keras
import numpy as np
import tensorflow as tf

import hpc_horovod.tensorflow as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send gradients as float16")
    parser.add_argument("--threads", type=int, default=0,
                        help="TensorFlow intra- and inter-op threads per process (0: default)")
    return parser.parse_args(argv)


def small_cnn(image_size: int, classes: int = 1000) -> keras.Model:
    """About 0.4 M parameters, most of them in the classifier: enough gradient volume for the
    allreduce to matter next to the compute."""
    return keras.Sequential([
        keras.Input((image_size, image_size, 3)),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(128, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(256, activation="relu"), keras.layers.Dense(classes),
    ])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:  # one GPU per process
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")

    model = small_cnn(args.image_size)
    optimizer = keras.optimizers.SGD(0.01 * hvd.size())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform([args.batch_size], maxval=1000, dtype=tf.int64)

    @tf.function
    def benchmark_step(first_batch: bool):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    device = "GPU" if gpus else "CPU"
    log(f"Model: small CNN ({model.count_params() / 1e6:.2f} M parameters)")
    log(f"Batch size: {args.batch_size} per process, images {args.image_size}x{args.image_size}")
    log(f"Number of {device} processes: {hvd.size()}")

    benchmark_step(first_batch=True)
    timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(lambda: benchmark_step(first_batch=False),
                                number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {rate:.1f} img/sec per process")
        rates.append(rate)
    mean, spread = float(np.mean(rates)), 1.96 * float(np.std(rates))
    log(f"Img/sec per process: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {hvd.size()} {device} process(es): {hvd.size() * mean:.1f} "
        f"+-{hvd.size() * spread:.1f}")


if __name__ == "__main__":
    main()
