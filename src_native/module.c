/* hpc_horovod._native: what numpy and MPI do not give us fast enough.
 *
 *   has_half_sum()              True once MPI is initialized: float16/bfloat16 sums can stay
 *                               16-bit on the wire
 *   half_sum_op(dtype)          the MPI_Op handle (an int for MPI.Op.fromhandle) summing 'float16'
 *                               or 'bfloat16' elements sent as a 2-byte datatype
 *   reduce_sum(src, inout, out) one reduction step on local buffers, as the MPI_Op does it
 *   pack(arrays, out, factor)   copy arrays back to back into out, times factor, casting
 *   unpack(buf, outputs, factor) the reverse
 *   kernels(), available_kernels(), use_kernels(name)  which SIMD flavour runs the loops
 *   peer_allow(), peer_read(pid, address, out), peer_write(pid, address, data),
 *   peer_table(inputs, outputs, table),
 *   peer_reduce(pids, tables, rank, lo, hi, dtype, factor, scratch)
 *                               a fused allreduce through the peers' own memory (peer.h)
 *   Window                      fused allreduces through the node's shared window
 *                               (window_object.h, window.h)
 *   Request, Lane               the per-tensor path of submissions (lane.h)
 *   Entry                       public functions with their common case in C (entry.h)
 *
 *   TorchResult                 how an async op on a torch CPU tensor ends (torch_view.h)
 *
 * The buffer protocol reads arrays; numpy's C API builds the views of torch tensors and reads
 * the submissions' arrays (numpy_api.h). bfloat16 arrays (ml_dtypes) export no buffer format,
 * so they are recognised by their dtype's name.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define HH_NUMPY_IMPORT /* this file loads numpy's C API */
#include "numpy_api.h"

#include "convert.h"
#include "entry.h"
#include "kernels.h"
#include "mpi_ops.h"
#include "lane.h"
#include "peer.h"
#include "torch_view.h"
#include "window_object.h"

/* Below this many bytes a copy is faster than handing the GIL to another thread and waiting to
 * get it back (up to the 5 ms switch interval when that thread is busy). */
#define GIL_RELEASE_BYTES (64 * 1024)

typedef struct {
    Py_buffer view;
    hh_kind kind;
    Py_ssize_t count;
} array_view;

static hh_kind kind_of_format(const char *format) {
    if (format == NULL)
        return HH_RAW;
    if (*format == '@' || *format == '=' || *format == '<')
        format++;
    if (format[0] == '\0' || format[1] != '\0')
        return HH_RAW;
    switch (format[0]) {
    case 'e': return HH_F16;
    case 'f': return HH_F32;
    case 'd': return HH_F64;
    default: return HH_RAW;
    }
}

static PyObject *str_dtype, *str_name; /* interned "dtype", "name" */

/* The bfloat16 dtype object last recognised: arrays of it skip the doomed request for a format,
 * whose exception costs microseconds per array. */
static PyObject *bf16_dtype = NULL;

/* 1 if obj.dtype is `dtype` (identity), 0 otherwise; never raises. */
static int has_dtype(PyObject *obj, PyObject *dtype) {
    PyObject *own = PyObject_GetAttr(obj, str_dtype);
    if (own == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(own);
    return own == dtype;
}

/* 1 if obj.dtype.name == "bfloat16" (and remember that dtype), 0 otherwise; never raises. */
static int is_bfloat16(PyObject *obj) {
    int match = 0;
    PyObject *dtype = PyObject_GetAttr(obj, str_dtype);
    if (dtype != NULL) {
        PyObject *name = PyObject_GetAttr(dtype, str_name);
        match = name != NULL && PyUnicode_Check(name) &&
                PyUnicode_CompareWithASCIIString(name, "bfloat16") == 0;
        Py_XDECREF(name);
        if (match) {
            Py_XDECREF(bf16_dtype);
            bf16_dtype = Py_NewRef(dtype);
        }
        Py_DECREF(dtype);
    }
    PyErr_Clear();
    return match;
}

/* Re-raise the pending exception with "func: what: " in front of its message. */
static void prefix_error(const char *func, const char *what, Py_ssize_t index, int writable) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *msg = value != NULL ? PyObject_Str(value) : NULL;
    if (msg == NULL) {
        PyErr_Restore(type, value, tb);
        return;
    }
    const char *need = writable ? "a writable C-contiguous array" : "a C-contiguous array";
    if (index >= 0)
        PyErr_Format(type, "%s: %s[%zd] must be %s (np.ascontiguousarray): %U", func, what, index,
                     need, msg);
    else
        PyErr_Format(type, "%s: %s must be %s (np.ascontiguousarray): %U", func, what, need, msg);
    Py_DECREF(msg);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

static int get_array(PyObject *obj, int writable, array_view *out, const char *func,
                     const char *what, Py_ssize_t index) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    int bf16 = bf16_dtype != NULL && has_dtype(obj, bf16_dtype);
    if (!bf16) {
        if (PyObject_GetBuffer(obj, &out->view, flags | PyBUF_FORMAT) == 0) {
            out->kind = kind_of_format(out->view.format);
            out->count = out->view.itemsize > 0 ? out->view.len / out->view.itemsize : 0;
            return 0;
        }
        /* bfloat16 arrays refuse to name a format */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (!is_bfloat16(obj)) {
            PyErr_Restore(type, value, tb);
            prefix_error(func, what, index, writable);
            return -1;
        }
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
    if (PyObject_GetBuffer(obj, &out->view, flags) != 0) {
        prefix_error(func, what, index, writable);
        return -1;
    }
    out->kind = HH_BF16;
    out->count = out->view.len / 2;
    return 0;
}

static const char *format_name(const array_view *a) {
    if (a->kind != HH_RAW)
        return hh_kind_name(a->kind);
    return a->view.format != NULL ? a->view.format : "untyped";
}

static int same_raw_format(const array_view *a, const array_view *b) {
    return a->view.itemsize == b->view.itemsize && a->view.format != NULL &&
           b->view.format != NULL && strcmp(a->view.format, b->view.format) == 0;
}

/* pack and unpack: copy `flat` <-> `parts`, scaled. */
static PyObject *copy_parts(PyObject *parts_obj, PyObject *flat_obj, double factor, int packing) {
    const char *func = packing ? "pack" : "unpack";
    const char *parts_name = packing ? "arrays" : "outputs";
    const char *flat_name = packing ? "out" : "buf";
    PyObject *parts = PySequence_Fast(parts_obj,
                                      packing ? "pack: arrays must be a sequence of arrays"
                                              : "unpack: outputs must be a sequence of arrays");
    if (parts == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(parts);
    array_view flat;
    array_view *views = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(array_view));
    Py_ssize_t got = 0, total = 0;
    PyObject *result = NULL;
    if (views == NULL) {
        PyErr_NoMemory();
        Py_DECREF(parts);
        return NULL;
    }
    if (get_array(flat_obj, packing, &flat, func, flat_name, -1) != 0)
        goto done_parts;
    int scaled = factor != 1.0;
    for (; got < n; got++) {
        array_view *v = &views[got];
        PyObject *part = PySequence_Fast_GET_ITEM(parts, got);
        if (get_array(part, !packing, v, func, parts_name, got) != 0)
            goto done;
        hh_kind src = packing ? v->kind : flat.kind, dst = packing ? flat.kind : v->kind;
        int compatible = hh_convert_supported(src, dst, scaled) &&
                         (src != HH_RAW || same_raw_format(v, &flat));
        if (!compatible) {
            const char *reason = (src == HH_RAW || dst == HH_RAW) && scaled
                ? " (scaling needs float16, bfloat16, float32 or float64 elements)"
                : " (float16, bfloat16 and float32 convert among themselves; other types only "
                  "copy to the same type)";
            PyErr_Format(PyExc_TypeError, "%s: cannot copy %s[%zd] (%s) %s %s (%s)%s", func,
                         parts_name, got, format_name(v), packing ? "into" : "from", flat_name,
                         format_name(&flat), reason);
            got++;
            goto done;
        }
        total += v->count;
    }
    if (total > flat.count) {
        PyErr_Format(PyExc_ValueError, "%s: %s holds %zd elements but the %s hold %zd", func,
                     flat_name, flat.count, parts_name, total);
        goto done;
    }
    {
        int release = (size_t)total * (size_t)(flat.view.itemsize) >= GIL_RELEASE_BYTES;
        PyThreadState *state = release ? PyEval_SaveThread() : NULL;
        char *cursor = (char *)flat.view.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            array_view *v = &views[i];
            if (packing)
                hh_convert(v->kind, v->view.buf, flat.kind, cursor, (size_t)v->count,
                           (size_t)v->view.itemsize, factor);
            else
                hh_convert(flat.kind, cursor, v->kind, v->view.buf, (size_t)v->count,
                           (size_t)v->view.itemsize, factor);
            cursor += v->count * flat.view.itemsize;
        }
        if (release)
            PyEval_RestoreThread(state);
    }
    result = PyLong_FromSsize_t(total);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i].view);
    PyBuffer_Release(&flat.view);
done_parts:
    PyMem_Free(views);
    Py_DECREF(parts);
    return result;
}

PyDoc_STRVAR(pack_doc,
"pack(arrays, out, factor=1.0) -> int\n\n"
"Copy the C-contiguous ``arrays`` back to back into the flat buffer ``out``, multiplied by\n"
"``factor`` in float32 (float64 for float64) and cast to ``out``'s type among float16,\n"
"bfloat16 and float32; other types copy unscaled to the same type. Returns the number of\n"
"elements written. Bit for bit what numpy's\n"
"``np.multiply(a, factor, out=segment, dtype=float32, casting='unsafe')`` gives per array.");

static PyObject *py_pack(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"arrays", "out", "factor", NULL};
    PyObject *arrays, *out;
    double factor = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|d:pack", keywords, &arrays, &out, &factor))
        return NULL;
    return copy_parts(arrays, out, factor, 1);
}

PyDoc_STRVAR(unpack_doc,
"unpack(buf, outputs, factor=1.0) -> int\n\n"
"The reverse of pack: fill each of ``outputs`` from consecutive elements of ``buf``,\n"
"multiplied by ``factor`` and cast to the output's type. Returns the number of elements read.");

static PyObject *py_unpack(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"buf", "outputs", "factor", NULL};
    PyObject *buf, *outputs;
    double factor = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|d:unpack", keywords, &buf, &outputs,
                                     &factor))
        return NULL;
    return copy_parts(outputs, buf, factor, 0);
}

PyDoc_STRVAR(reduce_sum_doc,
"reduce_sum(src, inout, out=None) -> None\n\n"
"``out[i] = round(float32(src[i]) + float32(inout[i]))`` for float16 or bfloat16 arrays of\n"
"the same type and size: one step of the MPI reduction, on local memory. Without ``out`` the\n"
"sum replaces ``inout``; with it, ``inout`` is only read.");

static PyObject *py_reduce_sum(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"src", "inout", "out", NULL};
    PyObject *src_obj, *inout_obj, *out_obj = Py_None;
    array_view src, inout, out;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:reduce_sum", keywords, &src_obj,
                                     &inout_obj, &out_obj))
        return NULL;
    int separate = out_obj != Py_None;
    if (get_array(src_obj, 0, &src, "reduce_sum", "src", -1) != 0)
        return NULL;
    if (get_array(inout_obj, !separate, &inout, "reduce_sum", "inout", -1) != 0) {
        PyBuffer_Release(&src.view);
        return NULL;
    }
    if (separate && get_array(out_obj, 1, &out, "reduce_sum", "out", -1) != 0) {
        PyBuffer_Release(&src.view);
        PyBuffer_Release(&inout.view);
        return NULL;
    }
    const array_view *dst = separate ? &out : &inout;
    PyObject *result = NULL;
    if (src.kind != inout.kind || (src.kind != HH_F16 && src.kind != HH_BF16)) {
        PyErr_Format(PyExc_TypeError, "reduce_sum: src and inout must both be float16 or both "
                     "bfloat16, not %s and %s", format_name(&src), format_name(&inout));
    } else if (src.count != inout.count) {
        PyErr_Format(PyExc_ValueError, "reduce_sum: src has %zd elements but inout has %zd",
                     src.count, inout.count);
    } else if (separate && (out.kind != src.kind || out.count != src.count)) {
        PyErr_Format(PyExc_ValueError, "reduce_sum: out must be %zd elements of %s, not %zd of %s",
                     src.count, format_name(&src), out.count, format_name(&out));
    } else {
        Py_BEGIN_ALLOW_THREADS
        if (src.kind == HH_F16)
            hh_active->sum_f16(src.view.buf, inout.view.buf, dst->view.buf, (size_t)src.count);
        else
            hh_active->sum_bf16(src.view.buf, inout.view.buf, dst->view.buf, (size_t)src.count);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src.view);
    PyBuffer_Release(&inout.view);
    if (separate)
        PyBuffer_Release(&out.view);
    return result;
}

PyDoc_STRVAR(has_half_sum_doc,
"has_half_sum() -> bool\n\n"
"True when the float16/bfloat16 sum operations are usable: MPI is initialized (and not\n"
"finalized) in this process. Creates them on the first True.");

static PyObject *py_has_half_sum(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(hh_ops_ready());
}

/* MPI_Op is an int (MPICH) or a pointer (Open MPI); mpi4py's handle is that value as an int. */
#define HH_HANDLE_TO_PY(h)                                    \
    _Generic((h), int: PyLong_FromLong((long)(intptr_t)(h)), \
             default: PyLong_FromVoidPtr((void *)(intptr_t)(h)))

PyDoc_STRVAR(half_sum_op_doc,
"half_sum_op(dtype) -> int\n\n"
"The MPI_Op handle summing ``dtype`` ('float16' or 'bfloat16', or a numpy dtype) elements,\n"
"for ``mpi4py.MPI.Op.fromhandle``; pair it with a 2-byte datatype such as MPI.UINT16_T.\n"
"The operation lives until MPI is finalized.");

static PyObject *py_half_sum_op(PyObject *self, PyObject *dtype) {
    PyObject *name = PyObject_Str(dtype);
    if (name == NULL)
        return NULL;
    hh_op_id id;
    if (PyUnicode_CompareWithASCIIString(name, "float16") == 0)
        id = HH_OP_SUM_F16;
    else if (PyUnicode_CompareWithASCIIString(name, "bfloat16") == 0)
        id = HH_OP_SUM_BF16;
    else {
        PyErr_Format(PyExc_ValueError, "half_sum_op: dtype must be float16 or bfloat16, not %U",
                     name);
        Py_DECREF(name);
        return NULL;
    }
    Py_DECREF(name);
    if (!hh_ops_ready()) {
        PyErr_SetString(PyExc_RuntimeError, "half_sum_op: MPI is not initialized in this process "
                        "(call hpc_horovod.init() under a launcher, or import mpi4py.MPI, first)");
        return NULL;
    }
    return HH_HANDLE_TO_PY(hh_op(id));
}

static PyObject *py_kernels(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(hh_active->name);
}

static PyObject *py_available_kernels(PyObject *self, PyObject *unused) {
    const hh_kernels *const *all = hh_kernels_available();
    PyObject *names = PyList_New(0);
    for (int i = 0; names != NULL && all[i] != NULL; i++) {
        PyObject *name = PyUnicode_FromString(all[i]->name);
        if (name == NULL || PyList_Append(names, name) != 0)
            Py_CLEAR(names);
        Py_XDECREF(name);
    }
    if (names == NULL)
        return NULL;
    PyObject *tuple = PyList_AsTuple(names);
    Py_DECREF(names);
    return tuple;
}

static PyObject *py_use_kernels(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL)
        return NULL;
    PyObject *previous = PyUnicode_FromString(hh_active->name);
    if (previous != NULL && hh_kernels_use(name) != 0) {
        PyObject *available = py_available_kernels(self, NULL);
        if (available != NULL)
            PyErr_Format(PyExc_ValueError, "use_kernels: this CPU cannot run %R; available: %R",
                         arg, available);
        Py_XDECREF(available);
        Py_CLEAR(previous);
    }
    return previous;
}

/* The kind the native sums take for a dtype name, or HH_RAW for none. */
/* ---- cross-memory reduction (peer.h) ------------------------------------------------------- */

PyDoc_STRVAR(peer_allow_doc,
"peer_allow() -> None\n\n"
"Let processes of this user read and write this one's memory with process_vm_readv/writev,\n"
"also where the Yama module limits that to descendants (as Open MPI's shared-memory transport\n"
"does for its single-copy transfers). Raises OSError when refused.");

static PyObject *py_peer_allow(PyObject *self, PyObject *unused) {
    if (hh_peer_allow() != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(peer_read_doc,
"peer_read(pid, address, out) -> None\n\n"
"Fill the writable buffer ``out`` with the bytes at ``address`` in process ``pid``.\n"
"Raises OSError (EPERM where cross-memory attach is not allowed, ESRCH for no such process).");

PyDoc_STRVAR(peer_write_doc,
"peer_write(pid, address, data) -> None\n\n"
"Write the bytes of the buffer ``data`` at ``address`` in process ``pid``. Raises OSError as\n"
"peer_read does.");

static PyObject *peer_copy(PyObject *args, int write) {
    long pid;
    unsigned long long address;
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, write ? "lKy*:peer_write" : "lKw*:peer_read", &pid, &address,
                          &buf))
        return NULL;
    int status = hh_peer_copy(pid, (uint64_t)address, buf.buf, (size_t)buf.len, write);
    PyBuffer_Release(&buf);
    if (status != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *py_peer_read(PyObject *self, PyObject *args) {
    return peer_copy(args, 0);
}

static PyObject *py_peer_write(PyObject *self, PyObject *args) {
    return peer_copy(args, 1);
}

PyDoc_STRVAR(peer_table_doc,
"peer_table(inputs, outputs, table) -> int\n\n"
"Describe a group for peer_reduce: row i of ``table`` (uint64, at least 3 x len(inputs)\n"
"elements) becomes (address of inputs[i], address of outputs[i], bytes). Inputs and outputs are\n"
"C-contiguous, outputs writable, each the size of its input (it may be the input itself).\n"
"Returns the group's bytes. The arrays must outlive every peer's use of the table.");

static PyObject *py_peer_table(PyObject *self, PyObject *args) {
    PyObject *inputs_obj, *outputs_obj;
    Py_buffer table;
    if (!PyArg_ParseTuple(args, "OOw*:peer_table", &inputs_obj, &outputs_obj, &table))
        return NULL;
    PyObject *inputs = PySequence_Fast(inputs_obj, "peer_table: inputs must be a sequence");
    PyObject *outputs = inputs == NULL ? NULL
        : PySequence_Fast(outputs_obj, "peer_table: outputs must be a sequence");
    PyObject *result = NULL;
    if (outputs == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(inputs);
    if (PySequence_Fast_GET_SIZE(outputs) != n) {
        PyErr_Format(PyExc_ValueError, "peer_table: %zd inputs but %zd outputs", n,
                     PySequence_Fast_GET_SIZE(outputs));
        goto done;
    }
    if (table.len < n * 3 * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_Format(PyExc_ValueError, "peer_table: the table holds %zd bytes, %zd rows need %zd",
                     table.len, n, n * 3 * (Py_ssize_t)sizeof(uint64_t));
        goto done;
    }
    uint64_t *rows = table.buf;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer in, out;
        PyObject *in_obj = PySequence_Fast_GET_ITEM(inputs, i);
        PyObject *out_obj = PySequence_Fast_GET_ITEM(outputs, i);
        if (out_obj == in_obj) { /* in place: one view, writable (half the cost of two) */
            if (PyObject_GetBuffer(in_obj, &in, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
                prefix_error("peer_table", "outputs", i, 1);
                goto done;
            }
            rows[i * 3] = rows[i * 3 + 1] = (uint64_t)(uintptr_t)in.buf;
            rows[i * 3 + 2] = (uint64_t)in.len;
            total += in.len;
            PyBuffer_Release(&in);
            continue;
        }
        if (PyObject_GetBuffer(in_obj, &in, PyBUF_C_CONTIGUOUS) != 0) {
            prefix_error("peer_table", "inputs", i, 0);
            goto done;
        }
        if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
            PyBuffer_Release(&in);
            prefix_error("peer_table", "outputs", i, 1);
            goto done;
        }
        rows[i * 3] = (uint64_t)(uintptr_t)in.buf;
        rows[i * 3 + 1] = (uint64_t)(uintptr_t)out.buf;
        rows[i * 3 + 2] = (uint64_t)in.len;
        Py_ssize_t in_len = in.len, out_len = out.len;
        PyBuffer_Release(&in);
        PyBuffer_Release(&out);
        if (in_len != out_len) {
            PyErr_Format(PyExc_ValueError, "peer_table: outputs[%zd] has %zd bytes, its input %zd",
                         i, out_len, in_len);
            goto done;
        }
        total += in_len;
    }
    result = PyLong_FromSsize_t(total);
done:
    Py_XDECREF(inputs);
    Py_XDECREF(outputs);
    PyBuffer_Release(&table);
    return result;
}

PyDoc_STRVAR(peer_reduce_doc,
"peer_reduce(pids, tables, rank, lo, hi, dtype, factor, scratch) -> None\n\n"
"This rank's share of a Sum over the ranks of one node: bytes [lo, hi) of the group that\n"
"``tables`` (uint64, one peer_table per rank, in rank order) describe are read from every\n"
"peer's inputs, summed with this rank's in rank order (float16/bfloat16 in float32, rounded\n"
"once), multiplied by ``factor`` and written into this rank's outputs and every peer's.\n"
"``dtype``: 'float16', 'bfloat16', 'float32' or 'float64'; ``scratch``: a writable buffer of\n"
"at least (ranks - 1) x peer_chunk() bytes. Raises OSError naming the peer that could not be\n"
"read or written.");

static PyObject *py_peer_reduce(PyObject *self, PyObject *args) {
    PyObject *pids_obj;
    Py_buffer tables, scratch;
    int rank;
    Py_ssize_t lo, hi;
    const char *dtype;
    double factor;
    if (!PyArg_ParseTuple(args, "Oy*innsdw*:peer_reduce", &pids_obj, &tables, &rank, &lo, &hi,
                          &dtype, &factor, &scratch))
        return NULL;
    PyObject *result = NULL;
    long *pids = NULL;
    PyObject *seq = PySequence_Fast(pids_obj, "peer_reduce: pids must be a sequence");
    if (seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    hh_kind kind = hh_summed_kind(dtype);
    size_t row_bytes = 3 * sizeof(uint64_t);
    if (kind == HH_RAW) {
        PyErr_Format(PyExc_TypeError, "peer_reduce: no sum of %s (float16, bfloat16, float32 or "
                     "float64)", dtype);
        goto done;
    }
    if (n < 1 || rank < 0 || rank >= n || tables.len % ((Py_ssize_t)row_bytes * n) != 0) {
        PyErr_Format(PyExc_ValueError, "peer_reduce: rank %d of %zd ranks, tables of %zd bytes",
                     rank, n, tables.len);
        goto done;
    }
    size_t count = (size_t)tables.len / (row_bytes * (size_t)n);
    const uint64_t *own = (const uint64_t *)tables.buf + (size_t)rank * count * 3;
    size_t total = 0, item = kind == HH_F64 ? 8 : kind == HH_F32 ? 4 : 2;
    for (size_t i = 0; i < count; i++)
        total += (size_t)own[i * 3 + 2];
    if (lo < 0 || lo > hi || (size_t)hi > total || lo % (Py_ssize_t)item || hi % (Py_ssize_t)item) {
        PyErr_Format(PyExc_ValueError, "peer_reduce: bytes [%zd, %zd) of a group of %zu bytes of "
                     "%s", lo, hi, total, dtype);
        goto done;
    }
    if ((size_t)scratch.len < (size_t)(n - 1) * HH_PEER_CHUNK) {
        PyErr_Format(PyExc_ValueError, "peer_reduce: scratch holds %zd bytes, %zd ranks need %zu",
                     scratch.len, n, (size_t)(n - 1) * HH_PEER_CHUNK);
        goto done;
    }
    pids = PyMem_Malloc((size_t)n * sizeof(long));
    if (pids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t q = 0; q < n; q++) {
        pids[q] = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, q));
        if (pids[q] == -1 && PyErr_Occurred())
            goto done;
    }
    hh_peer_job job = {(int)n, rank, pids, tables.buf, count, (size_t)lo, (size_t)hi, kind,
                       factor, scratch.buf};
    char error[256];
    int status;
    if (hi - lo >= GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        status = hh_peer_reduce(&job, error, sizeof error);
        Py_END_ALLOW_THREADS
    } else {
        status = hh_peer_reduce(&job, error, sizeof error);
    }
    if (status != 0)
        PyErr_Format(PyExc_OSError, "peer_reduce: %s", error);
    else
        result = Py_NewRef(Py_None);
done:
    PyMem_Free(pids);
    Py_XDECREF(seq);
    PyBuffer_Release(&tables);
    PyBuffer_Release(&scratch);
    return result;
}

static PyObject *py_peer_chunk(PyObject *self, PyObject *unused) {
    return PyLong_FromSize_t(HH_PEER_CHUNK);
}

static PyMethodDef methods[] = {
    {"has_half_sum", py_has_half_sum, METH_NOARGS, has_half_sum_doc},
    {"half_sum_op", py_half_sum_op, METH_O, half_sum_op_doc},
    {"reduce_sum", (PyCFunction)(void (*)(void))py_reduce_sum, METH_VARARGS | METH_KEYWORDS,
     reduce_sum_doc},
    {"pack", (PyCFunction)(void (*)(void))py_pack, METH_VARARGS | METH_KEYWORDS, pack_doc},
    {"unpack", (PyCFunction)(void (*)(void))py_unpack, METH_VARARGS | METH_KEYWORDS, unpack_doc},
    {"kernels", py_kernels, METH_NOARGS,
     "kernels() -> str\n\nThe SIMD flavour the loops use ('avx2+f16c' or 'scalar')."},
    {"available_kernels", py_available_kernels, METH_NOARGS,
     "available_kernels() -> tuple[str, ...]\n\nThe flavours this CPU can run, best last."},
    {"use_kernels", py_use_kernels, METH_O,
     "use_kernels(name) -> str\n\nRun the loops with flavour ``name``; returns the previous one."},
    {"peer_allow", py_peer_allow, METH_NOARGS, peer_allow_doc},
    {"peer_read", py_peer_read, METH_VARARGS, peer_read_doc},
    {"peer_write", py_peer_write, METH_VARARGS, peer_write_doc},
    {"peer_table", py_peer_table, METH_VARARGS, peer_table_doc},
    {"peer_reduce", py_peer_reduce, METH_VARARGS, peer_reduce_doc},
    {"peer_chunk", py_peer_chunk, METH_NOARGS,
     "peer_chunk() -> int\n\nBytes of scratch peer_reduce needs per peer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hpc_horovod._native",
    .m_doc = "Native fast paths: float16/bfloat16 MPI sums, fused pack/unpack with scaling, and "
             "fused sums through the memory of the node's other ranks.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    import_array();
    hh_kernels_init();
    str_dtype = PyUnicode_InternFromString("dtype");
    str_name = PyUnicode_InternFromString("name");
    if (str_dtype == NULL || str_name == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (hh_lane_register(m) < 0 || hh_entry_register(m) < 0 ||
                      hh_torch_register(m) < 0 ||
                      hh_window_register(m) < 0))
        Py_CLEAR(m);
    return m;
}
