/* The per-tensor path of a submission, in C (see lane.c). */
#ifndef HH_LANE_H
#define HH_LANE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Add the types Request and Lane to `module`; 0, or -1 with an exception set. */
int hh_lane_register(PyObject *module);

#endif
