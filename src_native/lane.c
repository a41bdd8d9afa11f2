/* The per-tensor path of a submission, in C.
 *
 * A training step submits a few hundred gradients and waits for each: in Python, building the
 * request, claiming its name, queueing it and later taking its result cost about 1.5 us per
 * tensor, as long as the whole allreduce of a 16 KiB gradient. Here:
 *
 *   Request    what hpc_horovod.common.request.Request is in Python, with the same fields
 *   Lane(engine, signatures, signature_of, ndarray)
 *     .push(request) -> handle           Engine.submit: claim the name, queue, wake the engine
 *     .allreduce(tensor, name, op, prescale, postscale, process_set, in_place) -> handle | None
 *                                        allreduce_async(_) of a C-contiguous numpy array with
 *                                        a name; None where the Python path must decide
 *     .wait(handle) -> request           Engine.wait: a completed request, or what the Python
 *                                        method gives (it runs the cycles)
 *     .admit(now) -> list                the engine's admission of its queue into the process
 *                                        sets' pending dicts; returns what Python must admit
 *     .cache_bits(pending, entries) -> (bits, uncached, writes_back)
 *                                        the response cache's bits of the pending requests
 *     .complete(group)                   mark a group's requests done, forget their names
 *     .sum_in_window(window, group, start, stop, dtype, factor, timeout_s, yield_s, fresh)
 *                                        a fused float sum of group[start:stop] through the
 *                                        node's window (window_object.h), completed
 *
 * Whatever is uncommon (errors, a closed or sleeping engine, a signature not seen before) calls
 * back into the engine's Python, so the messages and the rules stay in one place.
 */
#include "lane.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

#include "numpy_api.h"
#include "window_object.h"

/* ---- Request ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *name, *tensor, *signature, *process_set_id, *output, *splits, *key, *handle,
        *result, *error, *submitted_at, *ready_event, *done_event;
    char done;
} Request;

#define REQUEST_FIELDS(X)                                                                        \
    X(name) X(tensor) X(signature) X(process_set_id) X(output) X(splits) X(key) X(handle)        \
    X(result) X(error) X(submitted_at) X(ready_event) X(done_event)

static PyMemberDef request_members[] = {
#define MEMBER(f) {#f, T_OBJECT, offsetof(Request, f), 0, NULL},
    REQUEST_FIELDS(MEMBER)
#undef MEMBER
    {"done", T_BOOL, offsetof(Request, done), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static int request_traverse(Request *self, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(self->f);
    REQUEST_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int request_clear(Request *self) {
#define CLEAR(f) Py_CLEAR(self->f);
    REQUEST_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void request_dealloc(Request *self) {
    PyObject_GC_UnTrack(self);
    request_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject RequestType;
static PyTypeObject LaneType;

/* A new request; `output` and `splits` may be None. */
static Request *make_request(PyObject *name, PyObject *tensor, PyObject *signature,
                             PyObject *process_set_id, PyObject *output, PyObject *splits) {
    PyObject *key = PyTuple_Pack(2, process_set_id, name);
    if (key == NULL)
        return NULL;
    Request *req = (Request *)RequestType.tp_alloc(&RequestType, 0);
    if (req == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    req->name = Py_NewRef(name);
    req->tensor = Py_NewRef(tensor);
    req->signature = Py_NewRef(signature);
    req->process_set_id = Py_NewRef(process_set_id);
    req->output = Py_NewRef(output);
    req->splits = Py_NewRef(splits);
    req->key = key;
    /* An op with an output returns it: its result is known from the start (read once done). */
    req->result = output != Py_None ? Py_NewRef(output) : NULL;
    return req;
}

static PyObject *request_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"name", "tensor", "signature", "process_set_id", "output", "splits",
                             NULL};
    PyObject *name, *tensor, *signature, *ps = NULL, *output = Py_None, *splits = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|OOO:Request", kwlist, &name, &tensor,
                                     &signature, &ps, &output, &splits))
        return NULL;
    PyObject *zero = NULL;
    if (ps == NULL && (ps = zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    Request *req = make_request(name, tensor, signature, ps, output, splits);
    Py_XDECREF(zero);
    return (PyObject *)req;
}

static PyObject *request_kind(Request *self, void *closure) {
    if (self->signature == NULL || !PyTuple_Check(self->signature) ||
        PyTuple_GET_SIZE(self->signature) == 0) {
        PyErr_SetString(PyExc_AttributeError, "kind: the request has no signature");
        return NULL;
    }
    return Py_NewRef(PyTuple_GET_ITEM(self->signature, 0));
}

static PyGetSetDef request_getset[] = {
    {"kind", (getter)request_kind, NULL, "The signature's kind ('allreduce', ...).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RequestType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpc_horovod._native.Request",
    .tp_doc = "Request(name, tensor, signature, process_set_id=0, output=None, splits=None)\n\n"
              "A pending collective on this rank: its inputs, its agreed signature and, once "
              "done, its result or error. Completed by the engine, read by the caller.",
    .tp_basicsize = sizeof(Request),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = request_new,
    .tp_dealloc = (destructor)request_dealloc,
    .tp_traverse = (traverseproc)request_traverse,
    .tp_clear = (inquiry)request_clear,
    .tp_members = request_members,
    .tp_getset = request_getset,
};

/* ---- Lane ---------------------------------------------------------------------------------- */

/* One remembered allreduce signature: what request.signature_of was given, and what it gave.
 * A training step submits the same few hundred shapes every time; this spares building and
 * hashing its 8-field dict key (a third of a submission's time). */
typedef struct {
    PyObject *dtype, *shape, *signature; /* strong references; NULL: an empty slot */
    PyTypeObject *type;                  /* held through `signature`'s creation, see store */
    long op;
    double prescale, postscale;
} remembered;

#define REMEMBERED 512 /* slots, a power of two */

typedef struct {
    PyObject_HEAD
    PyObject *engine, *state; /* the engine and its __dict__ (its flags are read there) */
    PyObject *inflight, *handles, *members, *sets, *queue, *counter, *append;
    PyObject *signatures, *signature_of, *ndarray, *wait;
    remembered *remembered; /* REMEMBERED slots, direct-mapped */
} Lane;

#define LANE_FIELDS(X)                                                                           \
    X(engine) X(state) X(inflight) X(handles) X(members) X(sets) X(queue) X(counter) X(append)   \
    X(signatures) X(signature_of) X(ndarray) X(wait)

static PyObject *s_closed, *s_sleeping, *s_stopped, *s_raise_if_stopped, *s_claim,
    *s_on_sleeping_engine, *s_fail_leftovers, *s_wait, *s_allreduce, *s_shape, *s_process_set_id,
    *s_dict, *s_pending, *s_clear;
static PyObject *average_op, *no_root; /* 0 and -1 */

static int lane_traverse(Lane *self, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(self->f);
    LANE_FIELDS(VISIT)
#undef VISIT
    if (self->remembered != NULL)
        for (int i = 0; i < REMEMBERED; i++) {
            Py_VISIT(self->remembered[i].dtype);
            Py_VISIT(self->remembered[i].shape);
            Py_VISIT(self->remembered[i].signature);
        }
    return 0;
}

static void forget_slot(remembered *slot) {
    Py_CLEAR(slot->dtype);
    Py_CLEAR(slot->shape);
    Py_CLEAR(slot->signature);
}

static int lane_clear(Lane *self) {
#define CLEAR(f) Py_CLEAR(self->f);
    LANE_FIELDS(CLEAR)
#undef CLEAR
    if (self->remembered != NULL)
        for (int i = 0; i < REMEMBERED; i++)
            forget_slot(&self->remembered[i]);
    return 0;
}

static void lane_dealloc(Lane *self) {
    PyObject_GC_UnTrack(self);
    lane_clear(self);
    PyMem_Free(self->remembered);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The engine attribute `name` from its __dict__ (borrowed), or NULL with an exception set. */
static PyObject *engine_attribute(PyObject *state, PyObject *name) {
    PyObject *value = PyDict_GetItemWithError(state, name);
    if (value == NULL && !PyErr_Occurred())
        PyErr_Format(PyExc_AttributeError, "the engine has no attribute %R", name);
    return value;
}

static PyObject *lane_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"engine", "signatures", "signature_of", "ndarray", NULL};
    PyObject *engine, *signatures, *signature_of, *ndarray;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!OO!:Lane", kwlist, &engine, &PyDict_Type,
                                     &signatures, &signature_of, &PyType_Type, &ndarray))
        return NULL;
    Lane *self = (Lane *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->engine = Py_NewRef(engine);
    self->signatures = Py_NewRef(signatures);
    self->signature_of = Py_NewRef(signature_of);
    self->ndarray = Py_NewRef(ndarray);
    if ((self->remembered = PyMem_Calloc(REMEMBERED, sizeof(remembered))) == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if ((self->state = PyObject_GetAttr(engine, s_dict)) == NULL || !PyDict_Check(self->state))
        goto fail;
    /* The containers are created once with the engine and never replaced. */
    static const char *names[] = {"_inflight", "_handles", "_members", "_sets", "_queue",
                                  "_handle_counter"};
    PyObject **fields[] = {&self->inflight, &self->handles, &self->members, &self->sets,
                           &self->queue, &self->counter};
    for (int i = 0; i < 6; i++) {
        PyObject *value = PyDict_GetItemString(self->state, names[i]);
        if (value == NULL || (i < 4 && !PyDict_CheckExact(value))) {
            PyErr_Format(PyExc_TypeError, "Lane: the engine has no %s%s", i < 4 ? "dict " : "",
                         names[i]);
            goto fail;
        }
        *fields[i] = Py_NewRef(value);
    }
    if ((self->append = PyObject_GetAttrString(self->queue, "append")) == NULL)
        goto fail;
    /* the class's function: the instance's `wait` may be this lane's */
    if ((self->wait = PyObject_GetAttr((PyObject *)Py_TYPE(engine), s_wait)) == NULL)
        goto fail;
    return (PyObject *)self;
fail:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "Lane: the engine must keep its state in a __dict__");
    Py_DECREF(self);
    return NULL;
}

/* 1 if the engine's flag `name` is set, 0 if not, -1 on error. */
static int flag(Lane *self, PyObject *name) {
    PyObject *value = engine_attribute(self->state, name);
    return value == NULL ? -1 : value == Py_True ? 1 : PyObject_IsTrue(value);
}

/* Call the engine's method `name` with `arg` (or none) and drop its result; 0 or -1. */
static int call_engine(Lane *self, PyObject *name, PyObject *arg) {
    PyObject *result = arg == NULL ? PyObject_CallMethodNoArgs(self->engine, name)
                                   : PyObject_CallMethodOneArg(self->engine, name, arg);
    Py_XDECREF(result);
    return result == NULL ? -1 : 0;
}

/* Engine.submit: claim the request's name, give it a handle, queue it. */
static PyObject *push(Lane *self, Request *req) {
    int closed = flag(self, s_closed);
    if (closed < 0 || (closed && call_engine(self, s_raise_if_stopped, NULL) < 0))
        return NULL;
    int member = PyDict_Contains(self->members, req->process_set_id);
    if (member < 0)
        return NULL;
    PyObject *claimed = member ? PyDict_SetDefault(self->inflight, req->key, (PyObject *)req)
                               : NULL;
    if (member && claimed == NULL)
        return NULL;
    if (claimed != (PyObject *)req) {
        /* Not a member, or a duplicate name: the engine's own claim raises the error. */
        if (call_engine(self, s_claim, (PyObject *)req) < 0)
            return NULL;
        PyErr_Format(PyExc_RuntimeError, "Lane: the engine accepted %R twice", req->name);
        return NULL;
    }
    PyObject *handle = PyIter_Next(self->counter);
    if (handle == NULL) {
        PyDict_DelItem(self->inflight, req->key);
        return NULL;
    }
    Py_XSETREF(req->handle, Py_NewRef(handle));
    if (PyDict_SetItem(self->handles, handle, (PyObject *)req) < 0)
        goto fail;
    PyObject *queued = PyObject_CallOneArg(self->append, (PyObject *)req);
    if (queued == NULL) {
        PyDict_DelItem(self->handles, handle);
        goto fail;
    }
    Py_DECREF(queued);
    int sleeping = flag(self, s_sleeping), stopped;
    if (sleeping < 0 || (sleeping && call_engine(self, s_on_sleeping_engine, NULL) < 0))
        goto queued;
    /* stopped meanwhile: nobody else will complete it */
    stopped = flag(self, s_stopped);
    if (stopped < 0 || (stopped && call_engine(self, s_fail_leftovers, NULL) < 0))
        goto queued;
    return handle;
fail:
    Py_DECREF(handle);
    PyDict_DelItem(self->inflight, req->key);
    return NULL;
queued: /* queued, but waking the engine failed: the request stays the engine's to complete */
    Py_DECREF(handle);
    return NULL;
}

static PyObject *lane_push(Lane *self, PyObject *req) {
    if (!PyObject_TypeCheck(req, &RequestType)) {
        PyErr_Format(PyExc_TypeError, "Lane.push: expected a Request, not %.100s",
                     Py_TYPE(req)->tp_name);
        return NULL;
    }
    return push(self, (Request *)req);
}

/* The slot of (dtype, shape, type, op, scales). */
static remembered *slot_of(Lane *self, PyObject *dtype, int nd, const npy_intp *dims,
                           PyTypeObject *type, long op, double prescale, double postscale) {
    uint64_t h = (uint64_t)(uintptr_t)dtype * 0x9E3779B97F4A7C15ull;
    h ^= (uint64_t)(uintptr_t)type + (uint64_t)op * 0x100000001B3ull;
    uint64_t bits[2];
    memcpy(&bits[0], &prescale, sizeof(double));
    memcpy(&bits[1], &postscale, sizeof(double));
    h = (h ^ bits[0]) * 0x9E3779B97F4A7C15ull;
    h = (h ^ bits[1]) * 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < nd; i++)
        h = (h ^ (uint64_t)dims[i]) * 0x9E3779B97F4A7C15ull;
    return &self->remembered[(h >> 32) & (REMEMBERED - 1)];
}

/* Whether the tuple `shape` holds `dims`. */
static int same_shape(PyObject *shape, int nd, const npy_intp *dims) {
    if (PyTuple_GET_SIZE(shape) != nd)
        return 0;
    for (int i = 0; i < nd; i++)
        if (PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i)) != (Py_ssize_t)dims[i])
            return 0; /* (a stored shape holds ints: no error to clear) */
    return 1;
}

/* The signature `slot` remembers for these arguments (borrowed), or NULL (none, no error). */
static PyObject *recall(remembered *slot, PyObject *dtype, int nd, const npy_intp *dims,
                        PyTypeObject *type, long op, double prescale, double postscale) {
    if (slot->signature == NULL || slot->dtype != dtype || slot->type != type || slot->op != op ||
        memcmp(&slot->prescale, &prescale, sizeof(double)) != 0 ||
        memcmp(&slot->postscale, &postscale, sizeof(double)) != 0 ||
        !same_shape(slot->shape, nd, dims))
        return NULL;
    return slot->signature;
}

static void store(remembered *slot, PyObject *dtype, PyObject *shape, PyTypeObject *type, long op,
                  double prescale, double postscale, PyObject *signature) {
    forget_slot(slot);
    slot->dtype = Py_NewRef(dtype);
    slot->shape = Py_NewRef(shape);
    slot->signature = Py_NewRef(signature);
    slot->type = type; /* an ndarray type: the lane holds it (`ndarray`) */
    slot->op = op;
    slot->prescale = prescale;
    slot->postscale = postscale;
}

int hh_lane_check(PyObject *obj) {
    return Py_TYPE(obj) == &LaneType;
}

PyObject *hh_lane_allreduce(PyObject *lane, PyObject *tensor, PyObject *name, PyObject *op,
                            PyObject *prescale, PyObject *postscale, PyObject *process_set,
                            int in_place) {
    Lane *self = (Lane *)lane;
    if (op == Py_None)
        op = average_op;
    /* Anything else (other arrays, generated names, other scales) takes the Python path. */
    if (Py_TYPE(tensor) != (PyTypeObject *)self->ndarray || !PyUnicode_CheckExact(name) ||
        !PyLong_CheckExact(op) || !PyFloat_CheckExact(prescale) ||
        !PyFloat_CheckExact(postscale))
        Py_RETURN_NONE;
    PyObject *ps_id = PyObject_GetAttr(process_set, s_process_set_id);
    if (ps_id == NULL)
        return NULL;
    PyObject *result = NULL, *shape = NULL, *key = NULL, *signature = NULL;
    Request *req = NULL;
    if (ps_id == Py_None)
        goto python;
    /* Read through numpy's C API: the attributes `flags` and `shape` build objects each time. */
    PyArrayObject *array = (PyArrayObject *)tensor;
    int flags = PyArray_FLAGS(array);
    if (!(flags & NPY_ARRAY_C_CONTIGUOUS) || (in_place && !(flags & NPY_ARRAY_WRITEABLE)))
        goto python;
    PyObject *dtype = (PyObject *)PyArray_DESCR(array); /* borrowed */
    int nd = PyArray_NDIM(array);
    const npy_intp *dims = PyArray_DIMS(array);
    long op_value = PyLong_AsLong(op);
    if (op_value == -1 && PyErr_Occurred()) {
        PyErr_Clear(); /* no such op: the Python path names it */
        goto python;
    }
    double pre = PyFloat_AS_DOUBLE(prescale), post = PyFloat_AS_DOUBLE(postscale);
    remembered *slot = slot_of(self, dtype, nd, dims, Py_TYPE(tensor), op_value, pre, post);
    signature = recall(slot, dtype, nd, dims, Py_TYPE(tensor), op_value, pre, post);
    if (signature != NULL) {
        Py_INCREF(signature);
    } else {
        /* request.signature_of's interned signatures: its key, then the function itself */
        if ((shape = PyObject_GetAttr(tensor, s_shape)) == NULL)
            goto done;
        key = PyTuple_Pack(8, s_allreduce, dtype, shape, op, no_root, prescale, postscale,
                           (PyObject *)Py_TYPE(tensor));
        if (key == NULL)
            goto done;
        signature = PyDict_GetItemWithError(self->signatures, key);
        if (signature != NULL)
            Py_INCREF(signature);
        else if (PyErr_Occurred() ||
                 (signature = PyObject_CallFunctionObjArgs(self->signature_of, s_allreduce,
                                                           tensor, op, no_root, prescale,
                                                           postscale, NULL)) == NULL)
            goto done;
        store(slot, dtype, shape, Py_TYPE(tensor), op_value, pre, post, signature);
    }
    req = make_request(name, tensor, signature, ps_id, in_place ? tensor : Py_None, Py_None);
    if (req != NULL)
        result = push(self, req);
    goto done;
python:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(req);
    Py_XDECREF(signature);
    Py_XDECREF(key);
    Py_XDECREF(shape);
    Py_DECREF(ps_id);
    return result;
}

static PyObject *lane_allreduce(Lane *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "Lane.allreduce takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    int in_place = PyObject_IsTrue(args[6]);
    if (in_place < 0)
        return NULL;
    return hh_lane_allreduce((PyObject *)self, args[0], args[1], args[2], args[3], args[4],
                             args[5], in_place);
}

PyObject *hh_request_result(PyObject *req) {
    if (Py_TYPE(req) == &RequestType) {
        PyObject *result = ((Request *)req)->result;
        return Py_NewRef(result != NULL ? result : Py_None);
    }
    return PyObject_GetAttrString(req, "result");
}

PyObject *hh_lane_wait(PyObject *lane, PyObject *handle) {
    Lane *self = (Lane *)lane;
    PyObject *found = PyDict_GetItemWithError(self->handles, handle);
    if (found != NULL && Py_TYPE(found) == &RequestType) {
        Request *req = (Request *)found;
        if (req->done && (req->error == NULL || req->error == Py_None)) {
            Py_INCREF(found);
            if (PyDict_DelItem(self->handles, handle) < 0)
                Py_CLEAR(found);
            return found;
        }
    } else if (PyErr_Occurred()) {
        return NULL;
    }
    /* not done yet, failed, or unknown: the engine's own wait runs the cycles and raises */
    return PyObject_CallFunctionObjArgs(self->wait, self->engine, handle, NULL);
}

/* The signature's kind of a request (borrowed), or NULL. */
static PyObject *kind_of(Request *req) {
    PyObject *sig = req->signature;
    return sig != NULL && PyTuple_Check(sig) && PyTuple_GET_SIZE(sig) > 0 ? PyTuple_GET_ITEM(sig, 0)
                                                                           : NULL;
}

static PyObject *lane_admit(Lane *self, PyObject *now) {
    PyObject *queue = self->queue, *sets = self->sets;
    PyObject *leftovers = PyList_New(0), *iterator = NULL, *item = NULL;
    PyObject *last_set = NULL, *pending = NULL; /* the set of the previous request, its dict */
    if (leftovers == NULL || (iterator = PyObject_GetIter(queue)) == NULL)
        goto fail;
    /* Nothing below runs Python code, so no other thread appends meanwhile (GIL). */
    while ((item = PyIter_Next(iterator)) != NULL) {
        PyObject *ps = NULL, *kind = NULL;
        if (Py_TYPE(item) == &RequestType) {
            Request *req = (Request *)item;
            Py_XSETREF(req->submitted_at, Py_NewRef(now));
            ps = PyDict_GetItemWithError(sets, req->process_set_id);
            kind = kind_of(req);
        }
        if (ps == NULL && PyErr_Occurred())
            goto fail;
        int join = kind == NULL || (kind != s_allreduce && PyUnicode_Check(kind) &&
                                    PyUnicode_CompareWithASCIIString(kind, "join") == 0);
        if (ps == NULL || join) {
            if (PyList_Append(leftovers, item) < 0)
                goto fail;
        } else {
            if (ps != last_set) {
                Py_XDECREF(pending);
                if ((pending = PyObject_GetAttr(ps, s_pending)) == NULL)
                    goto fail;
                last_set = ps;
            }
            if (PyDict_SetItem(pending, ((Request *)item)->name, item) < 0)
                goto fail;
        }
        Py_CLEAR(item);
    }
    if (PyErr_Occurred())
        goto fail;
    Py_DECREF(iterator);
    Py_XDECREF(pending);
    PyObject *cleared = PyObject_CallMethodNoArgs(queue, s_clear);
    if (cleared == NULL) {
        Py_DECREF(leftovers);
        return NULL;
    }
    Py_DECREF(cleared);
    return leftovers;
fail:
    Py_XDECREF(item);
    Py_XDECREF(pending);
    Py_XDECREF(iterator);
    Py_XDECREF(leftovers);
    return NULL;
}

static PyObject *lane_cache_bits(Lane *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "Lane.cache_bits(pending: dict, entries: dict)");
        return NULL;
    }
    PyObject *pending = args[0], *entries = args[1], *name, *item, *bits = NULL;
    Py_ssize_t pos = 0, nwords = 0;
    uint64_t *words = NULL;
    int uncached = 0, writes_back = 1;
    while (PyDict_Next(pending, &pos, &name, &item)) {
        if (Py_TYPE(item) != &RequestType) {
            PyErr_SetString(PyExc_TypeError, "Lane.cache_bits: pending holds a non-Request");
            goto done;
        }
        Request *req = (Request *)item;
        if (req->output == NULL || req->output == Py_None)
            writes_back = 0;
        PyObject *entry = PyDict_GetItemWithError(entries, name);
        if (entry == NULL) {
            if (PyErr_Occurred())
                goto done;
            uncached = 1;
            continue;
        }
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
            PyErr_SetString(PyExc_TypeError, "Lane.cache_bits: entries must be (bit, signature)");
            goto done;
        }
        PyObject *cached = PyTuple_GET_ITEM(entry, 1);
        int same = cached == req->signature ? 1
                                            : PyObject_RichCompareBool(cached, req->signature, Py_EQ);
        if (same < 0)
            goto done;
        if (!same) {
            uncached = 1;
            continue;
        }
        Py_ssize_t bit = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 0));
        if (bit < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "Lane.cache_bits: a negative cache bit");
            goto done;
        }
        if (bit / 64 >= nwords) {
            Py_ssize_t grown = bit / 64 + 1 > 2 * nwords ? bit / 64 + 1 : 2 * nwords;
            uint64_t *more = PyMem_Realloc(words, (size_t)grown * sizeof(uint64_t));
            if (more == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            memset(more + nwords, 0, (size_t)(grown - nwords) * sizeof(uint64_t));
            words = more;
            nwords = grown;
        }
        words[bit / 64] |= (uint64_t)1 << (bit % 64);
    }
    /* the Python int of the words, most significant first */
    bits = PyLong_FromLong(0);
    for (Py_ssize_t w = nwords - 1; w >= 0 && bits != NULL; w--) {
        PyObject *shift = PyLong_FromLong(64), *word = PyLong_FromUnsignedLongLong(words[w]);
        PyObject *shifted = shift && word ? PyNumber_Lshift(bits, shift) : NULL;
        Py_XDECREF(shift);
        Py_SETREF(bits, shifted ? PyNumber_Or(shifted, word) : NULL);
        Py_XDECREF(shifted);
        Py_XDECREF(word);
    }
done:
    PyMem_Free(words);
    if (bits == NULL)
        return NULL;
    return Py_BuildValue("(NOO)", bits, uncached ? Py_True : Py_False,
                         writes_back ? Py_True : Py_False);
}

/* Mark `req` done and forget its name (already forgotten: fine); 0, or -1 with an exception. */
static int complete(Lane *self, Request *req) {
    if (PyDict_DelItem(self->inflight, req->key) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError))
            return -1;
        PyErr_Clear();
    }
    req->done = 1;
    return 0;
}

static PyObject *lane_complete(Lane *self, PyObject *group) {
    PyObject *items = PySequence_Fast(group, "Lane.complete: group must be a sequence");
    if (items == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        if (item == Py_None)
            continue;
        if (Py_TYPE(item) != &RequestType) {
            PyErr_SetString(PyExc_TypeError, "Lane.complete: the group holds a non-Request");
            Py_DECREF(items);
            return NULL;
        }
        if (complete(self, (Request *)item) < 0) {
            Py_DECREF(items);
            return NULL;
        }
    }
    Py_DECREF(items);
    Py_RETURN_NONE;
}

/* Row (input, output, bytes) of request `item` when the window can sum it: a Request whose
 * tensor is a C-contiguous numpy array and whose output, if it has one (its tensor, in place),
 * is a writable one of the same size. 1 with the output's address set, 2 without an output
 * (its row's output is set later, in the fresh buffer), 0 when the window cannot take it. */
static int window_row(PyObject *item, uint64_t *row) {
    if (Py_TYPE(item) != &RequestType)
        return 0;
    Request *req = (Request *)item;
    PyObject *in = req->tensor, *out = req->output;
    if (in == NULL || !PyArray_Check(in) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)in))
        return 0;
    PyArrayObject *a = (PyArrayObject *)in;
    row[0] = (uint64_t)(uintptr_t)PyArray_DATA(a);
    row[2] = (uint64_t)PyArray_NBYTES(a);
    if (out == NULL || out == Py_None)
        return 2;
    if (!PyArray_Check(out))
        return 0;
    PyArrayObject *b = (PyArrayObject *)out;
    if (!PyArray_IS_C_CONTIGUOUS(b) || !PyArray_ISWRITEABLE(b) ||
        PyArray_NBYTES(a) != PyArray_NBYTES(b))
        return 0;
    row[1] = (uint64_t)(uintptr_t)PyArray_DATA(b);
    return 1;
}

/* The result of a request without an output: bytes [offset, offset + its tensor's) of `fresh`,
 * shaped as its tensor. */
static PyObject *fresh_view(PyArrayObject *fresh, PyArrayObject *tensor, size_t offset) {
    PyArray_Descr *descr = PyArray_DESCR(fresh);
    Py_INCREF(descr);
    PyObject *view = PyArray_NewFromDescr(&PyArray_Type, descr, PyArray_NDIM(tensor),
                                          PyArray_DIMS(tensor), NULL,
                                          PyArray_BYTES(fresh) + offset, NPY_ARRAY_CARRAY, NULL);
    if (view != NULL && PyArray_SetBaseObject((PyArrayObject *)view, Py_NewRef(fresh)) < 0)
        Py_CLEAR(view);
    return view;
}

static PyObject *lane_sum_in_window(Lane *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9 || !PyList_CheckExact(args[1]) || !PyUnicode_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "Lane.sum_in_window(window, group: list, start, stop, "
                        "dtype: str, factor, timeout_s, yield_s, fresh)");
        return NULL;
    }
    PyObject *window = args[0], *group = args[1], *make_fresh = args[8];
    Py_ssize_t start = PyLong_AsSsize_t(args[2]), stop = PyLong_AsSsize_t(args[3]);
    double factor = PyFloat_AsDouble(args[5]), timeout_s = PyFloat_AsDouble(args[6]),
           yield_s = PyFloat_AsDouble(args[7]);
    const char *dtype = PyUnicode_AsUTF8(args[4]);
    if (PyErr_Occurred())
        return NULL;
    hh_kind kind = hh_summed_kind(dtype);
    if (kind == HH_RAW) {
        PyErr_Format(PyExc_TypeError, "Lane.sum_in_window: no sum of %s", dtype);
        return NULL;
    }
    if (start < 0 || stop > PyList_GET_SIZE(group) || stop <= start) {
        PyErr_Format(PyExc_IndexError, "Lane.sum_in_window: [%zd, %zd) of a group of %zd", start,
                     stop, PyList_GET_SIZE(group));
        return NULL;
    }
    uint64_t *rows = hh_window_rows(window, (size_t)(stop - start));
    if (rows == NULL)
        return NULL;
    size_t total = 0, without_output = 0;
    for (Py_ssize_t i = start; i < stop; i++) {
        int taken = window_row(PyList_GET_ITEM(group, i), rows + (i - start) * 3);
        if (!taken)
            Py_RETURN_FALSE; /* nothing done: the Python path takes the group */
        without_output += taken == 2;
        total += (size_t)rows[(i - start) * 3 + 2];
    }
    /* Outputs for the requests without one: views of one buffer, as the Python path gives. */
    PyArrayObject *fresh = NULL;
    if (without_output) {
        PyObject *made = PyObject_CallNoArgs(make_fresh);
        if (made == NULL)
            return NULL;
        fresh = (PyArrayObject *)made;
        if (!PyArray_Check(made) || !PyArray_IS_C_CONTIGUOUS(fresh) ||
            !PyArray_ISWRITEABLE(fresh) || (size_t)PyArray_NBYTES(fresh) < total) {
            PyErr_Format(PyExc_ValueError, "Lane.sum_in_window: fresh() must give a writable "
                         "C-contiguous numpy array of at least %zu bytes", total);
            Py_DECREF(made);
            return NULL;
        }
        size_t offset = 0;
        for (Py_ssize_t i = start; i < stop; i++) {
            uint64_t *row = rows + (i - start) * 3;
            Request *req = (Request *)PyList_GET_ITEM(group, i);
            if (req->output == NULL || req->output == Py_None)
                row[1] = (uint64_t)(uintptr_t)(PyArray_BYTES(fresh) + offset);
            offset += (size_t)row[2];
        }
    }
    if (hh_window_sum(window, (size_t)(stop - start), kind, factor, timeout_s, yield_s) < 0) {
        Py_XDECREF(fresh);
        return NULL; /* the requests stay in flight: the engine fails them as it stops */
    }
    size_t offset = 0;
    for (Py_ssize_t i = start; i < stop; i++) {
        Request *req = (Request *)PyList_GET_ITEM(group, i);
        PyArrayObject *tensor = (PyArrayObject *)req->tensor;
        if (req->output == NULL || req->output == Py_None) {
            PyObject *view = fresh_view(fresh, tensor, offset);
            if (view == NULL) {
                Py_DECREF(fresh);
                return NULL;
            }
            Py_XSETREF(req->result, view);
        }
        offset += (size_t)PyArray_NBYTES(tensor);
        if (complete(self, req) < 0) {
            Py_XDECREF(fresh);
            return NULL;
        }
    }
    Py_XDECREF(fresh);
    Py_RETURN_TRUE;
}

static PyMethodDef lane_methods[] = {
    {"push", (PyCFunction)lane_push, METH_O,
     "push(request) -> int\n\nEngine.submit: claim the name, queue the request, wake the "
     "engine thread if it sleeps; returns the handle."},
    {"allreduce", (PyCFunction)(void (*)(void))lane_allreduce, METH_FASTCALL,
     "allreduce(tensor, name, op, prescale, postscale, process_set, in_place) -> int | None\n\n"
     "Submit the allreduce of a C-contiguous numpy array (writable when in place) under "
     "``name``; None when it needs the Python path (another type, no name, a scale that is "
     "not a float, an unregistered process set)."},
    {"wait", (PyCFunction)hh_lane_wait, METH_O,
     "wait(handle) -> Request\n\nEngine.wait: a completed request (its handle is then "
     "forgotten); otherwise what the engine class's own wait gives or raises."},
    {"admit", (PyCFunction)lane_admit, METH_O,
     "admit(now) -> list\n\nMove the engine's queued requests into the pending dict of their "
     "process set (``_sets[id].pending``), stamping ``submitted_at`` with ``now``; returns the "
     "ones the engine must admit itself (joins, sets this rank is not in), in queue order."},
    {"cache_bits", (PyCFunction)(void (*)(void))lane_cache_bits, METH_FASTCALL,
     "cache_bits(pending, entries) -> (bits, uncached, writes_back)\n\nThe response cache's "
     "bits of the pending requests whose name and signature it holds (``entries``: name -> "
     "(bit, signature)); whether some request is not there; whether every request writes into "
     "an output."},
    {"complete", (PyCFunction)lane_complete, METH_O,
     "complete(group) -> None\n\nMark the group's requests done (None entries skipped) and "
     "forget their names."},
    {"sum_in_window", (PyCFunction)(void (*)(void))lane_sum_in_window, METH_FASTCALL,
     "sum_in_window(window, group, start, stop, dtype, factor, timeout_s, yield_s, fresh) -> "
     "bool\n\nSum group[start:stop] (requests of one agreed fused group) across the node "
     "through ``window`` (a Window) as Window.sum does, the requests' tensors in, their outputs "
     "out, then complete them. Requests without an output get views of one buffer, ``fresh()``, "
     "shaped as their tensors. False, having done nothing, when a request is not one the "
     "window takes (not a C-contiguous numpy array, an output that is not a writable one of "
     "its size, None for a joined rank)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpc_horovod._native.Lane",
    .tp_doc = "Lane(engine, signatures, signature_of, ndarray)\n\n"
              "The per-tensor path of submissions into ``engine``, which keeps every rule: "
              "errors and uncommon cases call back into it.",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = lane_new,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_traverse = (traverseproc)lane_traverse,
    .tp_clear = (inquiry)lane_clear,
    .tp_methods = lane_methods,
};

int hh_lane_register(PyObject *module) {
    struct {
        PyObject **slot;
        const char *text;
    } strings[] = {
        {&s_closed, "_closed"},
        {&s_sleeping, "_sleeping"},
        {&s_stopped, "_stopped"},
        {&s_raise_if_stopped, "_raise_if_stopped"},
        {&s_claim, "_claim"},
        {&s_on_sleeping_engine, "_on_sleeping_engine"},
        {&s_fail_leftovers, "_fail_leftovers"},
        {&s_wait, "wait"},
        {&s_allreduce, "allreduce"},
        {&s_shape, "shape"},
        {&s_process_set_id, "process_set_id"},
        {&s_dict, "__dict__"},
        {&s_pending, "pending"},
        {&s_clear, "clear"},
    };
    for (size_t i = 0; i < sizeof strings / sizeof strings[0]; i++)
        if ((*strings[i].slot = PyUnicode_InternFromString(strings[i].text)) == NULL)
            return -1;
    if ((average_op = PyLong_FromLong(0)) == NULL || (no_root = PyLong_FromLong(-1)) == NULL)
        return -1;
    if (PyType_Ready(&RequestType) < 0 || PyType_Ready(&LaneType) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "Request", (PyObject *)&RequestType) < 0 ||
        PyModule_AddObjectRef(module, "Lane", (PyObject *)&LaneType) < 0)
        return -1;
    return 0;
}
