"""Data-parallel training of a digit classifier (scikit-learn's 8x8 digits) with Keras 3 and
hpc_horovod.tensorflow.keras: Horovod's Keras recipe, end to end.

    hpc-horovod run -np 2 python examples/tensorflow2_keras_digits.py --epochs 10

What every rank does: pin a GPU, read its shard of the data, scale the learning rate by the
number of ranks (warming it up over the first epochs), wrap the optimizer, start from rank 0's
weights, average the epoch metrics over the ranks, and run 1/size of the steps of an epoch. Only
rank 0 prints and writes checkpoints. The final validation accuracy is each rank's accuracy on
its shard, weighted by the shard sizes: the accuracy over the whole validation set.
"""

from __future__ import annotations

import argparse
import os

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hpc_horovod.tensorflow.keras as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.002, help="for one rank; scaled by size")
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--checkpoint-dir", default="./keras_checkpoints")
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
    train = (tf.data.Dataset.from_tensor_slices((x_train[shard], y_train[shard]))
             .shuffle(len(x_train), seed=args.seed + hvd.rank()).repeat()
             .batch(args.batch_size))

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    scaled_lr = args.lr * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr))
    # jit_compile=False: the collectives are host ops, which XLA (on by default on GPUs) cannot
    # compile.
    model.compile(optimizer=opt, jit_compile=False, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr,
                                                 warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
    ]
    if hvd.rank() == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))

    model.fit(train, steps_per_epoch=steps_per_epoch, epochs=args.epochs, shuffle=False,
              validation_data=(x_val, y_val), callbacks=callbacks,  # `train` shuffles itself
              verbose=2 if hvd.rank() == 0 else 0)

    logs = model.evaluate(x_val, y_val, return_dict=True, verbose=0)
    logs = hvd.weighted_average(logs, len(x_val))
    if hvd.rank() == 0:
        print(f"FINAL val_accuracy={float(logs['accuracy']):.4f} "
              f"val_loss={float(logs['loss']):.4f} processes={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
