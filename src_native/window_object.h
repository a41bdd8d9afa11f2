/* The node's shared window as a Python object (see window_object.c). */
#ifndef HH_WINDOW_OBJECT_H
#define HH_WINDOW_OBJECT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "convert.h"

/* Add the type Window to `module`; 0, or -1 with an exception set. */
int hh_window_register(PyObject *module);

/* HH_F16, HH_BF16, HH_F32 or HH_F64 for the dtype names the window and the peers sum
 * ('float16', 'bfloat16', 'float32', 'float64'); HH_RAW for any other. */
hh_kind hh_summed_kind(const char *dtype);

/* Room for `count` rows (input address, output address, bytes) in `window`'s own table, which
 * hh_window_sum then reads; NULL with an exception set when `window` is not an open Window. */
uint64_t *hh_window_rows(PyObject *window, size_t count);

/* Sum every rank's group described by the first `count` rows of `window`'s table into this
 * rank's outputs (see window.h), through the window's next slot, without the GIL; 0, or -1
 * with an exception set (TimeoutError naming the ranks that did not come; a signal's). */
int hh_window_sum(PyObject *window, size_t count, hh_kind kind, double factor, double timeout_s,
                  double yield_s);

#endif
