/* Public functions whose common case is C: `hvd.allreduce_async`, `hvd.allreduce_async_` and
 * `hvd.synchronize` on numpy arrays, and the same functions of hpc_horovod.torch on CPU tensors
 * (see entry.c). */
#ifndef HH_ENTRY_H
#define HH_ENTRY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Add the type Entry to `module`; 0, or -1 with an exception set. */
int hh_entry_register(PyObject *module);

#endif
