/* numpy's C API, shared by the files that build or read arrays directly (lane.c, torch_view.c).
 * The module's initialisation loads it (module.c defines HH_NUMPY_IMPORT); numpy 2's headers
 * build an extension that also runs with numpy 1.x. */
#ifndef HH_NUMPY_API_H
#define HH_NUMPY_API_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL hh_numpy_api
#ifndef HH_NUMPY_IMPORT
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#endif
