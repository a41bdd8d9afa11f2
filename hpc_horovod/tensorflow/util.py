"""The helpers of ``horovod.tensorflow.util`` that scripts (and Horovod's own tests) import."""

from __future__ import annotations

import tensorflow as tf


def _executing_eagerly() -> bool:
    """Whether ops run eagerly here (False inside a ``tf.function`` or a TF1 graph)."""
    return tf.executing_eagerly()


def vars_to_refs(variables):
    """A hashable reference of a variable, or a tuple of them for a (nested) list."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs):
    """The variables of :func:`vars_to_refs`' references, as lists."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
