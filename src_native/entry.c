/* Public functions whose common case is C (see entry.h).
 *
 * `hvd.allreduce_async_(x, name=..., op=hvd.Sum)` on a numpy array (or a torch CPU tensor,
 * through hpc_horovod.torch), then `hvd.synchronize(h)`:
 * written in Python, each is a function frame around one call into the engine's Lane, and those
 * frames were a third of what a tensor costs on its way in and out. An Entry is such a function
 * with its frame in C: it takes the same arguments, hands the common case straight to the Lane
 * (lane.h), and calls the Python function, which keeps every rule and every error message, for
 * anything else: no Lane (not initialized), an `average=`, arguments it does not recognise, or
 * a case the Lane declines. functools.update_wrapper gives it the Python function's name,
 * docstring and signature (through __wrapped__).
 */
#include "entry.h"

#include <stddef.h>
#include <string.h>

#include "lane.h"
#include "torch_view.h"

enum { ALLREDUCE, ALLREDUCE_IN_PLACE, SYNCHRONIZE };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback;    /* the Python function */
    PyObject *namespace;   /* a dict whose "lane" is the engine's Lane while initialized */
    PyObject *process_set; /* the default process set */
    PyObject *dict;        /* __dict__ */
    /* hpc_horovod.torch's functions (NULL for numpy's): torch.Tensor, torch dtype -> numpy
     * dtype, the Python step that turns a result into the op's tensor (torch_view.h), and the
     * module's handle -> ([engine handles], finish) map */
    PyObject *tensor_type, *dtypes, *finish, *handle_map;
    int kind;
} Entry;

#define PARAMS 7
static const char *const param_names[PARAMS] = {
    "tensor", "average", "name", "op", "prescale_factor", "postscale_factor", "process_set"};
static PyObject *params[PARAMS]; /* the same, interned */
static PyObject *s_lane, *one;   /* "lane", 1.0 */

static PyObject *call_fallback(Entry *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

/* The engine's Lane (a new reference), or NULL without an exception when there is none. */
static PyObject *current_lane(Entry *self) {
    PyObject *lane = PyDict_GetItemWithError(self->namespace, s_lane);
    if (lane == NULL) {
        PyErr_Clear(); /* the Python function says what is wrong */
        return NULL;
    }
    return hh_lane_check(lane) ? Py_NewRef(lane) : NULL;
}

/* Position of keyword `key` among the parameters, or -1. */
static int param_index(PyObject *key) {
    for (int i = 0; i < PARAMS; i++)
        if (key == params[i])
            return i;
    for (int i = 0; i < PARAMS; i++)
        if (PyUnicode_Check(key) && PyUnicode_Compare(key, params[i]) == 0)
            return i;
    return -1;
}

/* handle_map[handle] = finish, as hpc_horovod.torch.mpi_ops._register does for an op of one
 * engine handle (the handle itself). */
static int register_torch(Entry *self, PyObject *handle, PyObject *tensor, PyObject *array,
                          int in_place) {
    PyObject *finish = hh_torch_result(tensor, array, self->finish, in_place);
    if (finish == NULL)
        return -1;
    int status = PyDict_SetItem(self->handle_map, handle, finish);
    Py_DECREF(finish);
    return status;
}

static PyObject *allreduce_call(Entry *self, PyObject *const *args, size_t nargsf,
                                PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *values[PARAMS] = {NULL};
    if (nargs > PARAMS)
        return call_fallback(self, args, nargsf, kwnames);
    for (Py_ssize_t i = 0; i < nargs; i++)
        values[i] = args[i];
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        int i = param_index(PyTuple_GET_ITEM(kwnames, k));
        if (i < 0 || values[i] != NULL)
            return call_fallback(self, args, nargsf, kwnames);
        values[i] = args[nargs + k];
    }
    if (values[0] == NULL || (values[1] != NULL && values[1] != Py_None))
        return call_fallback(self, args, nargsf, kwnames);
    PyObject *lane = current_lane(self);
    if (lane == NULL)
        return call_fallback(self, args, nargsf, kwnames);
    PyObject *array = values[0];
    if (self->tensor_type != NULL) { /* a torch tensor: the engine gets a view of its memory */
        array = hh_torch_view(values[0], self->tensor_type, self->dtypes);
        if (array == NULL) {
            Py_DECREF(lane);
            return PyErr_Occurred() ? NULL : call_fallback(self, args, nargsf, kwnames);
        }
    }
    int in_place = self->kind == ALLREDUCE_IN_PLACE;
    PyObject *handle = hh_lane_allreduce(
        lane, array, values[2] ? values[2] : Py_None, values[3] ? values[3] : Py_None,
        values[4] ? values[4] : one, values[5] ? values[5] : one,
        values[6] ? values[6] : self->process_set, in_place);
    Py_DECREF(lane);
    if (handle != NULL && handle != Py_None && self->tensor_type != NULL &&
        register_torch(self, handle, values[0], array, in_place) < 0)
        Py_CLEAR(handle); /* out of memory: the request stays with the engine, unreachable */
    if (array != values[0])
        Py_DECREF(array);
    if (handle != Py_None)
        return handle; /* or NULL: the Lane raised the engine's error */
    Py_DECREF(handle);
    return call_fallback(self, args, nargsf, kwnames);
}

static PyObject *synchronize_call(Entry *self, PyObject *const *args, size_t nargsf,
                                  PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL)
        return call_fallback(self, args, nargsf, kwnames);
    PyObject *lane = current_lane(self);
    if (lane == NULL)
        return call_fallback(self, args, nargsf, kwnames);
    PyObject *req = hh_lane_wait(lane, args[0]);
    Py_DECREF(lane);
    if (req == NULL)
        return NULL;
    PyObject *result = hh_request_result(req);
    Py_DECREF(req);
    return result;
}

/* hpc_horovod.torch.synchronize of a handle registered by register_torch; anything else (a
 * grouped op, a GPU tensor, an unknown handle) runs the Python function. */
static PyObject *torch_synchronize_call(Entry *self, PyObject *const *args, size_t nargsf,
                                        PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL)
        return call_fallback(self, args, nargsf, kwnames);
    PyObject *finish = PyDict_GetItemWithError(self->handle_map, args[0]);
    if (finish == NULL) {
        PyErr_Clear(); /* unhashable or unknown: the Python function says so */
        return call_fallback(self, args, nargsf, kwnames);
    }
    if (!hh_torch_result_check(finish))
        return call_fallback(self, args, nargsf, kwnames);
    PyObject *lane = current_lane(self);
    if (lane == NULL)
        return call_fallback(self, args, nargsf, kwnames);
    Py_INCREF(finish);
    PyObject *req = NULL, *result = NULL, *out = NULL;
    if (PyDict_DelItem(self->handle_map, args[0]) == 0)
        req = hh_lane_wait(lane, args[0]);
    if (req != NULL)
        result = hh_request_result(req);
    if (result != NULL)
        out = hh_torch_finish(finish, result);
    Py_XDECREF(result);
    Py_XDECREF(req);
    Py_DECREF(finish);
    Py_DECREF(lane);
    return out;
}

static PyObject *entry_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"kind",        "fallback", "namespace", "process_set",
                               "tensor_type", "dtypes",   "finish",    "handle_map", NULL};
    const char *kind;
    PyObject *fallback, *namespace, *process_set = Py_None, *tensor_type = NULL,
                                    *dtypes = NULL, *finish = NULL, *handle_map = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sOO!|O$O!O!OO!:Entry", keywords, &kind,
                                     &fallback, &PyDict_Type, &namespace, &process_set,
                                     &PyType_Type, &tensor_type, &PyDict_Type, &dtypes, &finish,
                                     &PyDict_Type, &handle_map))
        return NULL;
    int which = strcmp(kind, "allreduce_async") == 0    ? ALLREDUCE
                : strcmp(kind, "allreduce_async_") == 0 ? ALLREDUCE_IN_PLACE
                : strcmp(kind, "synchronize") == 0      ? SYNCHRONIZE
                                                        : -1;
    if (which < 0) {
        PyErr_Format(PyExc_ValueError, "Entry: no entry %s (allreduce_async, allreduce_async_ "
                     "or synchronize)", kind);
        return NULL;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "Entry: the fallback must be callable");
        return NULL;
    }
    /* torch: the allreduces need all four, synchronize the handle map alone */
    int torch = which == SYNCHRONIZE ? handle_map != NULL : tensor_type != NULL;
    int complete = which == SYNCHRONIZE
                       ? tensor_type == NULL && dtypes == NULL && finish == NULL
                       : (tensor_type != NULL && dtypes != NULL && finish != NULL &&
                          handle_map != NULL && PyCallable_Check(finish)) ||
                             (tensor_type == NULL && dtypes == NULL && finish == NULL &&
                              handle_map == NULL);
    if (!complete) {
        PyErr_SetString(PyExc_TypeError, "Entry: a torch allreduce takes tensor_type, dtypes, "
                        "a callable finish and handle_map; a torch synchronize handle_map only");
        return NULL;
    }
    Entry *self = (Entry *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->kind = which;
    self->vectorcall = (vectorcallfunc)(which != SYNCHRONIZE ? allreduce_call
                                        : torch             ? torch_synchronize_call
                                                            : synchronize_call);
    self->fallback = Py_NewRef(fallback);
    self->namespace = Py_NewRef(namespace);
    self->process_set = Py_NewRef(process_set);
    self->tensor_type = Py_XNewRef(tensor_type);
    self->dtypes = Py_XNewRef(dtypes);
    self->finish = Py_XNewRef(finish);
    self->handle_map = Py_XNewRef(handle_map);
    return (PyObject *)self;
}

static int entry_traverse(Entry *self, visitproc visit, void *arg) {
    Py_VISIT(self->fallback);
    Py_VISIT(self->namespace);
    Py_VISIT(self->process_set);
    Py_VISIT(self->dict);
    Py_VISIT(self->tensor_type);
    Py_VISIT(self->dtypes);
    Py_VISIT(self->finish);
    Py_VISIT(self->handle_map);
    return 0;
}

static int entry_clear(Entry *self) {
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->namespace);
    Py_CLEAR(self->process_set);
    Py_CLEAR(self->dict);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->dtypes);
    Py_CLEAR(self->finish);
    Py_CLEAR(self->handle_map);
    return 0;
}

static void entry_dealloc(Entry *self) {
    PyObject_GC_UnTrack(self);
    entry_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *entry_repr(Entry *self) {
    return PyObject_Repr(self->fallback);
}

static PyGetSetDef entry_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpc_horovod._native.Entry",
    .tp_doc = "Entry(kind, fallback, namespace, process_set=None, *, tensor_type=None, "
              "dtypes=None, finish=None, handle_map=None)\n\n"
              "The public function ``fallback`` ('allreduce_async', 'allreduce_async_' or "
              "'synchronize') with its common case in C: numpy arrays go straight to "
              "``namespace['lane']``; anything else calls ``fallback`` with the same arguments. "
              "With ``tensor_type`` (torch.Tensor), ``dtypes`` (torch dtype -> numpy dtype), "
              "``finish`` (the Python step from a result to the op's tensor) and "
              "``handle_map`` (hpc_horovod.torch's handles), the function of hpc_horovod.torch: "
              "CPU tensors go to the lane as views of their memory; a torch synchronize takes "
              "``handle_map`` only.",
    .tp_basicsize = sizeof(Entry),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = entry_new,
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_traverse = (traverseproc)entry_traverse,
    .tp_clear = (inquiry)entry_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Entry, vectorcall),
    .tp_dictoffset = offsetof(Entry, dict),
    .tp_getset = entry_getset,
    .tp_repr = (reprfunc)entry_repr,
};

int hh_entry_register(PyObject *module) {
    for (int i = 0; i < PARAMS; i++)
        if ((params[i] = PyUnicode_InternFromString(param_names[i])) == NULL)
            return -1;
    if ((s_lane = PyUnicode_InternFromString("lane")) == NULL ||
        (one = PyFloat_FromDouble(1.0)) == NULL)
        return -1;
    if (PyType_Ready(&EntryType) < 0)
        return -1;
    return PyModule_AddObjectRef(module, "Entry", (PyObject *)&EntryType);
}
