/* Torch CPU tensors as the engine's numpy arrays, and their results back, in C (see
 * torch_view.c). Used by the torch kinds of entry.c. */
#ifndef HH_TORCH_VIEW_H
#define HH_TORCH_VIEW_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Add the type TorchResult to `module`; 0, or -1 with an exception set. */
int hh_torch_register(PyObject *module);

/* A writable numpy array over the memory of `tensor` (new reference), which it keeps alive, or
 * NULL without an exception when the tensor is not a non-empty contiguous CPU tensor of
 * `tensor_type`, not a view, whose dtype is a key of `dtypes` (torch dtype -> numpy dtype): the
 * Python path
 * (hpc_horovod.torch.adapter.engine_array) decides then. NULL with an exception: out of
 * memory. */
PyObject *hh_torch_view(PyObject *tensor, PyObject *tensor_type, PyObject *dtypes);

/* What an async op on `tensor` returns when the engine's result is ready: a callable
 * `finish(results)`, as hpc_horovod.torch.mpi_ops keeps beside its handles. In place, the
 * tensor itself when the result is `view` (the engine wrote into its memory), otherwise
 * `fallback(result, tensor, view)`; out of place, `fallback(result)`. New reference. */
PyObject *hh_torch_result(PyObject *tensor, PyObject *view, PyObject *fallback, int in_place);

/* Whether `obj` is a TorchResult. */
int hh_torch_result_check(PyObject *obj);

/* `finish([result])` of a TorchResult, without the list (new reference). */
PyObject *hh_torch_finish(PyObject *finish, PyObject *result);

#endif
