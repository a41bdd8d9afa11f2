/* The per-tensor path of a submission, in C (see lane.c). */
#ifndef HH_LANE_H
#define HH_LANE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Add the types Request and Lane to `module`; 0, or -1 with an exception set. */
int hh_lane_register(PyObject *module);

/* 1 if `obj` is a Lane. */
int hh_lane_check(PyObject *obj);

/* Lane.allreduce: the handle, None for the Python path, or NULL with an exception set. */
PyObject *hh_lane_allreduce(PyObject *lane, PyObject *tensor, PyObject *name, PyObject *op,
                            PyObject *prescale, PyObject *postscale, PyObject *process_set,
                            int in_place);

/* Lane.wait: the completed request, or NULL with its error set. */
PyObject *hh_lane_wait(PyObject *lane, PyObject *handle);

/* The `result` of a request (a new reference), or NULL. */
PyObject *hh_request_result(PyObject *req);

#endif
