"""``hpc_horovod.keras``: the same module as ``hpc_horovod.tensorflow.keras`` (Keras 3 on the
TensorFlow backend), under the name Horovod's ``horovod.keras`` scripts import."""

from ..tensorflow.keras import *  # noqa: F403 - the alias re-exports that API
from ..tensorflow.keras import __all__, callbacks, elastic  # noqa: F401
