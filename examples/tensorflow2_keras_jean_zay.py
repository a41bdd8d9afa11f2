"""The Keras recipe of the Jean Zay cluster's Horovod page, on synthetic data: ``model.fit`` with
the distributed optimizer, rank 0's initial weights broadcast, checkpoints written by rank 0
only, then a distributed validation: each rank evaluates its shard of the validation set in a
``tf.function`` step that accumulates a sample-weighted ``keras.metrics.Mean``, and
``hvd.allreduce(val_loss.result())`` averages the ranks' results (a tensor, so ``.numpy()`` and
TensorFlow ops take it).

    hpc-horovod run -np 2 python examples/tensorflow2_keras_jean_zay.py --checkpoint-dir ckpt
    srun python examples/tensorflow2_keras_jean_zay.py      # inside a SLURM allocation

The data: points in 8 dimensions labelled by which of 4 fixed random directions they are closest
to, the same on every rank (seeded), split into shards by rank.
"""

from __future__ import annotations

import argparse
import os

import keras
import numpy as np
import tensorflow as tf

import hpc_horovod.tensorflow.keras as hvd

FEATURES, CLASSES = 8, 4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--samples", type=int, default=2048, help="training samples, all ranks")
    parser.add_argument("--lr", type=float, default=0.01, help="for one rank; scaled by size")
    parser.add_argument("--checkpoint-dir", default="./jean_zay_checkpoints")
    return parser.parse_args(argv)


def synthetic(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    directions = np.random.RandomState(0).randn(CLASSES, FEATURES).astype(np.float32)
    x = np.random.RandomState(seed).randn(samples, FEATURES).astype(np.float32)
    return x, np.argmax(x @ directions.T, axis=1).astype(np.int64)


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:  # one GPU per process
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
    keras.utils.set_random_seed(hvd.rank())  # different initial weights: rank 0's are broadcast

    x_train, y_train = synthetic(args.samples, seed=1)
    x_val, y_val = synthetic(args.samples // 4 + 3, seed=2)  # shards of unequal sizes
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shard(hvd.size(), hvd.rank()).shuffle(1024, seed=hvd.rank()).repeat()
               .batch(args.batch_size))
    val_dataset = (tf.data.Dataset.from_tensor_slices((x_val, y_val))
                   .shard(hvd.size(), hvd.rank()).batch(args.batch_size))

    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(CLASSES)])
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(args.lr * hvd.size()))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # jit_compile=False: the collectives are host ops, which XLA (on by default on GPUs) cannot
    # compile.
    model.compile(loss=loss, optimizer=opt, metrics=["accuracy"], jit_compile=False)

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    if hvd.rank() == 0:  # the other ranks would write the same files at the same time
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))
    steps_per_epoch = args.samples // (args.batch_size * hvd.size())
    model.fit(dataset, steps_per_epoch=steps_per_epoch, epochs=args.epochs, callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)

    # Distributed validation: each rank its shard, then one allreduce of the metric.
    val_loss = keras.metrics.Mean()
    val_accuracy = keras.metrics.Mean()

    @tf.function
    def eval_step(images, labels):
        logits = model(images, training=False)
        weight = tf.shape(images)[0]
        val_loss.update_state(loss(labels, logits), sample_weight=weight)
        correct = tf.cast(tf.equal(tf.argmax(logits, axis=1), labels), tf.float32)
        val_accuracy.update_state(tf.reduce_mean(correct), sample_weight=weight)

    for images, labels in val_dataset:
        eval_step(images, labels)
    # The average of the ranks' means; hvd.weighted_average weighs them by the shard sizes.
    val_loss_dist = hvd.allreduce(val_loss.result())
    val_accuracy_dist = hvd.allreduce(val_accuracy.result())
    if hvd.rank() == 0:
        print(f"FINAL val_accuracy={float(val_accuracy_dist):.4f} "
              f"val_loss={val_loss_dist.numpy():.4f} processes={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
