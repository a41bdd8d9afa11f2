"""``hpc_horovod.keras.callbacks``: the callbacks of ``hpc_horovod.tensorflow.keras.callbacks``."""

from ..tensorflow.keras.callbacks import *  # noqa: F403 - the alias re-exports that API
from ..tensorflow.keras.callbacks import __all__  # noqa: F401
