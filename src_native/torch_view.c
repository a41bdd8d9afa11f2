/* Torch CPU tensors as the engine's numpy arrays, and their results back (see torch_view.h).
 *
 * `hvd.allreduce_async_(grad)` on a torch tensor spent most of its time outside the engine:
 * `tensor.numpy()` alone is 1.2 us, the checks around it (adapter.engine_array) as much again,
 * and the closure that later turns the result back into a tensor, with its frames, about
 * 1 us more, on a path a training step takes once per gradient. Here the array is built with
 * numpy's C API over the tensor's memory, from the few attributes that decide it (dtype,
 * device, contiguity, address, shape), and the finishing step is a small C object. Anything
 * uncommon (another device, a view, a non-contiguous or empty tensor, a dtype the engine does
 * not reduce) is left to the Python path, which keeps every rule and every message.
 */
#include "torch_view.h"

#include <stddef.h>

#include "numpy_api.h"

/* numpy 1.x allows 32 dimensions, numpy 2 64: the smaller is enough for a tensor */
#define MAX_DIMS 32

static PyObject *s_dtype, *s_is_cpu, *s_is_contiguous, *s_is_view, *s_data_ptr, *s_shape;

/* 1 when `value` is `expected`, 0 otherwise (an exception is cleared: the Python path will
 * meet it again and report it). Steals `value`. */
static int is(PyObject *value, PyObject *expected) {
    if (value == NULL) {
        PyErr_Clear();
        return 0;
    }
    int same = value == expected;
    Py_DECREF(value);
    return same;
}

PyObject *hh_torch_view(PyObject *tensor, PyObject *tensor_type, PyObject *dtypes) {
    if (!PyType_Check(tensor_type) || !PyObject_TypeCheck(tensor, (PyTypeObject *)tensor_type))
        return NULL;
    PyObject *dtype = PyObject_GetAttr(tensor, s_dtype);
    if (dtype == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *descr = PyDict_GetItemWithError(dtypes, dtype); /* borrowed */
    Py_DECREF(dtype);
    if (descr == NULL || !PyArray_DescrCheck(descr)) {
        PyErr_Clear();
        return NULL;
    }
    /* Views go the Python way: one may be a negative view (`z.conj().imag`, torch._neg_view),
     * whose memory holds the values of the other sign and which tensor.numpy() refuses.
     * `is_neg()` would say it directly, but lets go of the GIL, and the engine thread then
     * runs a cycle between two submissions of one step (a cycle per few gradients, and both
     * ranks out of step: 2.6 ms for 200 x 16 KiB instead of 1.3). A gradient is no view. */
    if (!is(PyObject_GetAttr(tensor, s_is_cpu), Py_True) ||
        !is(PyObject_CallMethodNoArgs(tensor, s_is_contiguous), Py_True) ||
        !is(PyObject_CallMethodNoArgs(tensor, s_is_view), Py_False))
        return NULL;
    PyObject *address = PyObject_CallMethodNoArgs(tensor, s_data_ptr);
    PyObject *shape = address != NULL ? PyObject_GetAttr(tensor, s_shape) : NULL;
    void *data = address != NULL ? PyLong_AsVoidPtr(address) : NULL;
    Py_XDECREF(address);
    if (shape == NULL || !PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > MAX_DIMS ||
        data == NULL) {
        Py_XDECREF(shape);
        PyErr_Clear();
        return NULL;
    }
    npy_intp dims[MAX_DIMS];
    int nd = (int)PyTuple_GET_SIZE(shape);
    for (int i = 0; i < nd; i++) {
        dims[i] = (npy_intp)PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (dims[i] <= 0) { /* empty (its address may be anything), or not an int */
            Py_DECREF(shape);
            PyErr_Clear();
            return NULL;
        }
    }
    Py_DECREF(shape);
    Py_INCREF(descr); /* stolen by the constructor */
    PyObject *array = PyArray_NewFromDescr(&PyArray_Type, (PyArray_Descr *)descr, nd, dims, NULL,
                                           data, NPY_ARRAY_CARRAY, NULL);
    if (array == NULL)
        return NULL;
    Py_INCREF(tensor); /* stolen: the array keeps the tensor, hence its memory, alive */
    if (PyArray_SetBaseObject((PyArrayObject *)array, tensor) < 0) {
        Py_DECREF(array);
        return NULL;
    }
    return array;
}

/* ---- TorchResult -------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *tensor, *view, *fallback;
    int in_place;
} TorchResult;

static PyTypeObject TorchResultType;

PyObject *hh_torch_result(PyObject *tensor, PyObject *view, PyObject *fallback, int in_place) {
    TorchResult *self = PyObject_GC_New(TorchResult, &TorchResultType);
    if (self == NULL)
        return NULL;
    self->tensor = Py_NewRef(tensor);
    self->view = Py_NewRef(view);
    self->fallback = Py_NewRef(fallback);
    self->in_place = in_place;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

int hh_torch_result_check(PyObject *obj) {
    return Py_TYPE(obj) == &TorchResultType;
}

PyObject *hh_torch_finish(PyObject *finish, PyObject *result) {
    TorchResult *self = (TorchResult *)finish;
    if (!self->in_place)
        return PyObject_CallOneArg(self->fallback, result);
    if (result == self->view) /* the engine wrote into the tensor's own memory */
        return Py_NewRef(self->tensor);
    return PyObject_CallFunctionObjArgs(self->fallback, result, self->tensor, self->view, NULL);
}

static PyObject *torch_result_call(TorchResult *self, PyObject *args, PyObject *kwargs) {
    PyObject *results;
    if (!PyArg_ParseTuple(args, "O:TorchResult", &results))
        return NULL;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "TorchResult takes no keyword arguments");
        return NULL;
    }
    PyObject *result = PySequence_GetItem(results, 0);
    if (result == NULL)
        return NULL;
    PyObject *out = hh_torch_finish((PyObject *)self, result);
    Py_DECREF(result);
    return out;
}

static int torch_result_traverse(TorchResult *self, visitproc visit, void *arg) {
    Py_VISIT(self->tensor);
    Py_VISIT(self->view);
    Py_VISIT(self->fallback);
    return 0;
}

static int torch_result_clear(TorchResult *self) {
    Py_CLEAR(self->tensor);
    Py_CLEAR(self->view);
    Py_CLEAR(self->fallback);
    return 0;
}

static void torch_result_dealloc(TorchResult *self) {
    PyObject_GC_UnTrack(self);
    torch_result_clear(self);
    PyObject_GC_Del(self);
}

static PyTypeObject TorchResultType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpc_horovod._native.TorchResult",
    .tp_doc = "finish(results) of an async op on a torch CPU tensor: the tensor itself when the "
              "engine wrote the result into its memory, else what the Python fallback makes.",
    .tp_basicsize = sizeof(TorchResult),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)torch_result_dealloc,
    .tp_traverse = (traverseproc)torch_result_traverse,
    .tp_clear = (inquiry)torch_result_clear,
    .tp_call = (ternaryfunc)torch_result_call,
};

int hh_torch_register(PyObject *module) {
    if ((s_dtype = PyUnicode_InternFromString("dtype")) == NULL ||
        (s_is_cpu = PyUnicode_InternFromString("is_cpu")) == NULL ||
        (s_is_contiguous = PyUnicode_InternFromString("is_contiguous")) == NULL ||
        (s_is_view = PyUnicode_InternFromString("_is_view")) == NULL ||
        (s_data_ptr = PyUnicode_InternFromString("data_ptr")) == NULL ||
        (s_shape = PyUnicode_InternFromString("shape")) == NULL)
        return -1;
    if (PyType_Ready(&TorchResultType) < 0)
        return -1;
    return PyModule_AddObjectRef(module, "TorchResult", (PyObject *)&TorchResultType);
}
