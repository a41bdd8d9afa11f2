"""Data-parallel training of a digit classifier (scikit-learn's 8x8 digits) with a TF2 custom
training loop: tf.function, hvd.DistributedGradientTape and a plain Keras optimizer.

    hpc-horovod run -np 2 python examples/tensorflow2_digits_gradient_tape.py --epochs 10

Every rank trains on its shard; the tape averages the gradients over the ranks (one grouped
allreduce per step); after the first step (once the optimizer has its variables) the model and
optimizer state of rank 0 are broadcast. The validation accuracy is each rank's accuracy on its
shard, weighted by the shard sizes: the accuracy over the whole validation set.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hpc_horovod.tensorflow as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.002, help="for one rank; scaled by size")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:  # one GPU per process
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
    keras.utils.set_random_seed(args.seed + hvd.rank())  # rank 0's weights are broadcast

    digits = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(
        (digits.data / 16.0).astype(np.float32), digits.target, test_size=0.2,
        random_state=args.seed)
    steps_per_epoch = len(x_train) // (args.batch_size * hvd.size())
    shard = slice(hvd.rank(), None, hvd.size())
    x_val, y_val = x_val[shard], y_val[shard]
    train = iter(tf.data.Dataset.from_tensor_slices((x_train[shard], y_train[shard]))
                 .shuffle(len(x_train), seed=args.seed + hvd.rank()).repeat()
                 .batch(args.batch_size))

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.Adam(args.lr * hvd.size())

    @tf.function
    def train_step(images, labels, first_batch: bool):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    @tf.function
    def accuracy(images, labels):
        predictions = tf.argmax(model(images, training=False), axis=1, output_type=tf.int32)
        return tf.reduce_mean(tf.cast(tf.equal(predictions, tf.cast(labels, tf.int32)),
                                      tf.float32))

    for epoch in range(args.epochs):
        for step in range(steps_per_epoch):
            images, labels = next(train)
            loss = train_step(images, labels, epoch == 0 and step == 0)
        val_accuracy = hvd.weighted_average(accuracy(x_val, y_val), len(x_val))
        loss = hvd.allreduce(loss)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss {float(loss):.4f} "
                  f"val_accuracy {float(val_accuracy):.4f}", flush=True)
    if hvd.rank() == 0:
        print(f"FINAL val_accuracy={float(val_accuracy):.4f} processes={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
