/* The node's shared window as a Python object: what hh_window_reduce needs that outlives one
 * reduction (the memory, the ranks' counters, which of the slots comes next, a table reused
 * by every group), so that a fused group costs one call.
 *
 *   Window(memory, flags, rank, size, slots)
 *     .sum(table, dtype, factor, timeout_s, yield_s)  one group, described by a peer_table
 *     .take_slot() -> int                             the slot a staged (numpy) reduction uses
 *     .close()                                        before the memory goes
 *     .sums, .tensors                                 groups and tensors summed so far
 *
 * Native sums and staged reductions alternate through the same slots, so the slot counter
 * lives here, and Lane.sum_in_window (lane.c) fills the table straight from its requests.
 */
#include "window_object.h"

#include <string.h>
#include <structmember.h>

#include "window.h"

typedef struct {
    PyObject_HEAD
    Py_buffer memory, flags; /* held while open */
    int open;
    int n, rank, slots, slot; /* slot: the next reduction's */
    size_t capacity;          /* bytes of one segment */
    uint64_t *rows;           /* the reused table */
    size_t rows_capacity;
    unsigned long long sums, tensors;
} Window;

static PyTypeObject WindowType;

hh_kind hh_summed_kind(const char *dtype) {
    return strcmp(dtype, "float32") == 0    ? HH_F32
           : strcmp(dtype, "float64") == 0  ? HH_F64
           : strcmp(dtype, "float16") == 0  ? HH_F16
           : strcmp(dtype, "bfloat16") == 0 ? HH_BF16
                                            : HH_RAW;
}

static void release(Window *self) {
    if (self->open) {
        PyBuffer_Release(&self->memory);
        PyBuffer_Release(&self->flags);
        self->open = 0;
    }
}

static void window_dealloc(Window *self) {
    release(self);
    PyMem_Free(self->rows);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *window_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"memory", "flags", "rank", "size", "slots", NULL};
    Py_buffer memory, flags;
    int rank, size, slots;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "w*w*iii:Window", kwlist, &memory, &flags,
                                     &rank, &size, &slots))
        return NULL;
    if (size < 1 || rank < 0 || rank >= size || slots < 1
        || memory.len % ((Py_ssize_t)slots * (size + 1)) != 0
        || flags.len < (Py_ssize_t)(size * HH_WINDOW_FLAG_STRIDE * sizeof(int64_t))
        || ((uintptr_t)flags.buf % sizeof(int64_t)) != 0) {
        PyErr_Format(PyExc_ValueError, "Window: rank %d of %d, %d slots in %zd bytes, %zd bytes "
                     "of flags", rank, size, slots, memory.len, flags.len);
        PyBuffer_Release(&memory);
        PyBuffer_Release(&flags);
        return NULL;
    }
    Window *self = (Window *)type->tp_alloc(type, 0);
    if (self == NULL) {
        PyBuffer_Release(&memory);
        PyBuffer_Release(&flags);
        return NULL;
    }
    self->memory = memory;
    self->flags = flags;
    self->open = 1;
    self->n = size;
    self->rank = rank;
    self->slots = slots;
    self->capacity = (size_t)memory.len / ((size_t)slots * (size_t)(size + 1));
    return (PyObject *)self;
}

static Window *open_window(PyObject *obj) {
    if (Py_TYPE(obj) != &WindowType) {
        PyErr_SetString(PyExc_TypeError, "expected a hpc_horovod._native.Window");
        return NULL;
    }
    Window *self = (Window *)obj;
    if (!self->open) {
        PyErr_SetString(PyExc_ValueError, "the shared window was closed");
        return NULL;
    }
    return self;
}

uint64_t *hh_window_rows(PyObject *window, size_t count) {
    Window *self = open_window(window);
    if (self == NULL)
        return NULL;
    if (count > self->rows_capacity) {
        size_t grown = count > 2 * self->rows_capacity ? count : 2 * self->rows_capacity;
        uint64_t *rows = PyMem_Realloc(self->rows, grown * 3 * sizeof(uint64_t));
        if (rows == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        self->rows = rows;
        self->rows_capacity = grown;
    }
    return self->rows;
}

/* While a reduction waits for a peer: run the signal handlers (KeyboardInterrupt). */
static int interrupted(void *context) {
    PyThreadState **saved = context;
    PyEval_RestoreThread(*saved);
    int raised = PyErr_CheckSignals() != 0;
    *saved = PyEval_SaveThread();
    return raised;
}

static int run(Window *self, const uint64_t *rows, size_t count, hh_kind kind, double factor,
               double timeout_s, double yield_s) {
    size_t total = 0;
    for (size_t i = 0; i < count; i++)
        total += (size_t)rows[i * 3 + 2];
    if (total > self->capacity) {
        PyErr_Format(PyExc_ValueError, "a group of %zu bytes is more than the %zu bytes of a "
                     "segment of the shared window", total, self->capacity);
        return -1;
    }
    size_t slot_bytes = (size_t)(self->n + 1) * self->capacity;
    hh_window_job job = {self->n, self->rank, rows, count,
                         (char *)self->memory.buf + (size_t)self->slot * slot_bytes,
                         self->capacity, self->flags.buf, kind, factor, timeout_s, yield_s,
                         interrupted, NULL};
    self->slot = (self->slot + 1) % self->slots;
    char error[512];
    PyThreadState *saved = PyEval_SaveThread();
    job.context = &saved;
    int status = hh_window_reduce(&job, error, sizeof error);
    PyEval_RestoreThread(saved);
    if (status == -1)
        PyErr_SetString(PyExc_TimeoutError, error);
    if (status != 0)
        return -1;
    self->sums++;
    self->tensors += count;
    return 0;
}

int hh_window_sum(PyObject *window, size_t count, hh_kind kind, double factor, double timeout_s,
                  double yield_s) {
    Window *self = open_window(window);
    return self == NULL ? -1 : run(self, self->rows, count, kind, factor, timeout_s, yield_s);
}

static PyObject *window_sum(Window *self, PyObject *args) {
    Py_buffer table;
    const char *dtype;
    double factor, timeout_s, yield_s;
    if (!PyArg_ParseTuple(args, "y*sddd:sum", &table, &dtype, &factor, &timeout_s, &yield_s))
        return NULL;
    int status = -1;
    hh_kind kind = hh_summed_kind(dtype);
    size_t row_bytes = 3 * sizeof(uint64_t);
    if (kind == HH_RAW)
        PyErr_Format(PyExc_TypeError, "Window.sum: no sum of %s (float16, bfloat16, float32 or "
                     "float64)", dtype);
    else if (table.len % (Py_ssize_t)row_bytes != 0 || (uintptr_t)table.buf % sizeof(uint64_t))
        PyErr_Format(PyExc_ValueError, "Window.sum: a table of %zd bytes is not rows of 3 "
                     "aligned uint64", table.len);
    else if (open_window((PyObject *)self) != NULL)
        status = run(self, table.buf, (size_t)table.len / row_bytes, kind, factor, timeout_s,
                     yield_s);
    PyBuffer_Release(&table);
    return status == 0 ? Py_NewRef(Py_None) : NULL;
}

static PyObject *window_take_slot(Window *self, PyObject *unused) {
    if (open_window((PyObject *)self) == NULL)
        return NULL;
    int slot = self->slot;
    self->slot = (slot + 1) % self->slots;
    return PyLong_FromLong(slot);
}

static PyObject *window_close(Window *self, PyObject *unused) {
    release(self);
    Py_RETURN_NONE;
}

static PyMethodDef window_methods[] = {
    {"sum", (PyCFunction)window_sum, METH_VARARGS,
     "sum(table, dtype, factor, timeout_s, yield_s) -> None\n\n"
     "A Sum over the ranks of one node of the group that ``table`` (a peer_table of this rank's "
     "inputs and outputs, at most ``capacity`` bytes) describes, through the next slot: "
     "outputs[i] = factor x (sum over ranks of inputs[i]), in rank order (float16/bfloat16 in "
     "float32, rounded once). Every rank calls it with its own table. ``dtype``: 'float16', "
     "'bfloat16', 'float32' or 'float64'. Raises TimeoutError naming the ranks that did not "
     "come within ``timeout_s`` (0: no limit); a signal's exception stops the wait. Waits "
     "yield the core for ``yield_s`` seconds before they sleep."},
    {"take_slot", (PyCFunction)window_take_slot, METH_NOARGS,
     "take_slot() -> int\n\nThe slot the next reduction uses, which the one after will not."},
    {"close", (PyCFunction)window_close, METH_NOARGS,
     "close() -> None\n\nLet go of the memory (before it is freed); later calls raise."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef window_members[] = {
    {"capacity", T_PYSSIZET, offsetof(Window, capacity), READONLY, "Bytes of one segment."},
    {"slots", T_INT, offsetof(Window, slots), READONLY, "Slots the reductions alternate."},
    {"sums", T_ULONGLONG, offsetof(Window, sums), READONLY, "Groups summed so far."},
    {"tensors", T_ULONGLONG, offsetof(Window, tensors), READONLY, "Tensors summed so far."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject WindowType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpc_horovod._native.Window",
    .tp_doc = "Window(memory, flags, rank, size, slots)\n\n"
              "Float sums through memory every rank of the node maps: ``memory`` holds "
              "``slots`` slots of ``size`` segments then the result, ``flags`` the ranks' int64 "
              "counters, a cache line (8) apart, zero at first (see src_native/window.h).",
    .tp_basicsize = sizeof(Window),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = window_new,
    .tp_dealloc = (destructor)window_dealloc,
    .tp_methods = window_methods,
    .tp_members = window_members,
};

int hh_window_register(PyObject *module) {
    if (PyType_Ready(&WindowType) < 0)
        return -1;
    return PyModule_AddObjectRef(module, "Window", (PyObject *)&WindowType);
}
