/* Public functions whose common case is C (see entry.h).
 *
 * `hvd.allreduce_async_(x, name=..., op=hvd.Sum)` on a numpy array, then `hvd.synchronize(h)`:
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

enum { ALLREDUCE, ALLREDUCE_IN_PLACE, SYNCHRONIZE };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback;    /* the Python function */
    PyObject *namespace;   /* a dict whose "lane" is the engine's Lane while initialized */
    PyObject *process_set; /* the default process set */
    PyObject *dict;        /* __dict__ */
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
    PyObject *handle = hh_lane_allreduce(
        lane, values[0], values[2] ? values[2] : Py_None, values[3] ? values[3] : Py_None,
        values[4] ? values[4] : one, values[5] ? values[5] : one,
        values[6] ? values[6] : self->process_set, self->kind == ALLREDUCE_IN_PLACE);
    Py_DECREF(lane);
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

static PyObject *entry_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"kind", "fallback", "namespace", "process_set", NULL};
    const char *kind;
    PyObject *fallback, *namespace, *process_set = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sOO!|O:Entry", keywords, &kind, &fallback,
                                     &PyDict_Type, &namespace, &process_set))
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
    Entry *self = (Entry *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->kind = which;
    self->vectorcall = (vectorcallfunc)(which == SYNCHRONIZE ? synchronize_call : allreduce_call);
    self->fallback = Py_NewRef(fallback);
    self->namespace = Py_NewRef(namespace);
    self->process_set = Py_NewRef(process_set);
    return (PyObject *)self;
}

static int entry_traverse(Entry *self, visitproc visit, void *arg) {
    Py_VISIT(self->fallback);
    Py_VISIT(self->namespace);
    Py_VISIT(self->process_set);
    Py_VISIT(self->dict);
    return 0;
}

static int entry_clear(Entry *self) {
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->namespace);
    Py_CLEAR(self->process_set);
    Py_CLEAR(self->dict);
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
    .tp_doc = "Entry(kind, fallback, namespace, process_set=None)\n\n"
              "The public function ``fallback`` ('allreduce_async', 'allreduce_async_' or "
              "'synchronize') with its common case in C: numpy arrays go straight to "
              "``namespace['lane']``; anything else calls ``fallback`` with the same arguments.",
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
