"""TF1-style data-parallel training: tf.compat.v1 graph, MonitoredTrainingSession, Horovod's
original recipe unchanged but for the import (scikit-learn's 8x8 digits, a small MLP).

    hpc-horovod run -np 2 python examples/tensorflow1_monitored_session.py

The five steps of the recipe: init; pin one GPU per process (visible_device_list); scale the
learning rate by the number of processes and wrap the optimizer; broadcast the initial variables
from rank 0 with a hook; write checkpoints on rank 0 only. The validation accuracy is measured by
every rank on its shard and combined with a sample-weighted average.
"""

from __future__ import annotations

import argparse

import numpy as np
import tensorflow.compat.v1 as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hpc_horovod.tensorflow as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="global steps, split over ranks")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.002, help="for one rank; scaled by size")
    parser.add_argument("--checkpoint-dir", default="./tf1_checkpoints")
    return parser.parse_args(argv)


def dense(inputs, units: int, name: str):
    with tf.variable_scope(name):
        kernel = tf.get_variable("kernel", [int(inputs.shape[1]), units],
                                 initializer=tf.glorot_uniform_initializer())
        bias = tf.get_variable("bias", [units], initializer=tf.zeros_initializer())
        return tf.matmul(inputs, kernel) + bias


class ValidationHook(tf.train.SessionRunHook):
    """At the end of training: the accuracy over the whole validation set (every rank's shard,
    weighted by the shard sizes), and a checksum of the weights, equal on every rank."""

    def __init__(self, accuracy, feed_dict):
        self.accuracy, self.feed_dict = accuracy, feed_dict
        self.checksum = tf.add_n([tf.reduce_sum(tf.abs(v)) for v in tf.trainable_variables()])

    def end(self, session):
        self.value, self.weights = session.run([self.accuracy, self.checksum],
                                               feed_dict=self.feed_dict)


def main(argv=None) -> None:
    args = parse_args(argv)
    tf.disable_v2_behavior()
    hvd.init()

    # Pin one GPU per process (no effect on a CPU-only machine).
    config = tf.ConfigProto()
    config.gpu_options.allow_growth = True
    config.gpu_options.visible_device_list = str(hvd.local_rank())

    digits = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(
        (digits.data / 16.0).astype(np.float32), digits.target, test_size=0.2, random_state=0)
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    x_val, y_val = x_val[hvd.rank()::hvd.size()], y_val[hvd.rank()::hvd.size()]

    images = tf.placeholder(tf.float32, [None, 64])
    labels = tf.placeholder(tf.int64, [None])
    logits = dense(tf.nn.relu(dense(images, 64, "hidden")), 10, "logits")
    loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
    correct = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))
    val_accuracy = hvd.weighted_average(correct, tf.size(labels))

    global_step = tf.train.get_or_create_global_step()
    opt = tf.train.AdamOptimizer(args.lr * hvd.size())
    opt = hvd.DistributedOptimizer(opt)
    train_op = opt.minimize(loss, global_step=global_step)

    validation = ValidationHook(val_accuracy, {images: x_val, labels: y_val})
    hooks = [hvd.BroadcastGlobalVariablesHook(0),
             tf.train.StopAtStepHook(last_step=args.steps // hvd.size()), validation]
    checkpoint_dir = args.checkpoint_dir if hvd.rank() == 0 else None

    rng = np.random.RandomState(hvd.rank())
    with tf.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, config=config,
                                           hooks=hooks) as sess:
        while not sess.should_stop():
            batch = rng.randint(0, len(x_train), size=args.batch_size)
            _, step, value = sess.run([train_op, global_step, loss],
                                      feed_dict={images: x_train[batch], labels: y_train[batch]})
            if step % 50 == 0 and hvd.rank() == 0:
                print(f"step {step}: loss {value:.4f}", flush=True)

    print(f"FINAL rank={hvd.rank()} val_accuracy={validation.value:.4f} "
          f"weights={validation.weights:.6f}", flush=True)


if __name__ == "__main__":
    main()
