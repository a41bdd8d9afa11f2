"""``python -m hpc_horovod ...`` is ``hpc-horovod ...``: the command from any interpreter,
without a PATH lookup (a notebook kernel's ``sys.executable -m hpc_horovod run ...``)."""

import sys

from .cli import main

sys.exit(main())
