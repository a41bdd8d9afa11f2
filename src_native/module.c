/* hpc_horovod._native: what numpy and MPI do not give us fast enough.
 *
 *   has_half_sum()              True once MPI is initialized: float16/bfloat16 sums can stay
 *                               16-bit on the wire
 *   half_sum_op(dtype)          the MPI_Op handle (an int for MPI.Op.fromhandle) summing 'float16'
 *                               or 'bfloat16' elements sent as a 2-byte datatype
 *   reduce_sum(src, inout, out) one reduction step on local buffers, as the MPI_Op does it
 *   pack(arrays, out, factor)   copy arrays back to back into out, times factor, casting
 *   unpack(buf, outputs, factor) the reverse
 *   reduce_slices(inputs, outputs, op, prescale, postscale)  one pass: the inputs reduced
 *                               (scaled) into every output (the hierarchical backend's node stage)
 *   kernels(), available_kernels(), use_kernels(name)  which SIMD flavour runs the loops
 *
 * The buffer protocol reads arrays. bfloat16 arrays (ml_dtypes) export no buffer format, so they
 * are recognised by their dtype's name.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "convert.h"
#include "kernels.h"
#include "mpi_ops.h"
#include "slices.h"

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

/* The slice type of an array, from its kind or its buffer format; HH_S_NONE for others. */
static hh_slice_type slice_type(const array_view *a) {
    switch (a->kind) {
    case HH_F16: return HH_S_F16;
    case HH_BF16: return HH_S_BF16;
    case HH_F32: return HH_S_F32;
    case HH_F64: return HH_S_F64;
    default: break;
    }
    const char *f = a->view.format;
    if (f == NULL)
        return HH_S_NONE;
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (f[0] == '\0' || f[1] != '\0')
        return HH_S_NONE;
    Py_ssize_t size = a->view.itemsize;
    switch (f[0]) {
    case '?': return HH_S_BOOL;
    case 'B': return HH_S_U8;
    case 'b': return HH_S_I8;
    case 'h': return HH_S_I16;
    case 'i': case 'l': case 'q':
        return size == 4 ? HH_S_I32 : size == 8 ? HH_S_I64 : HH_S_NONE;
    default: return HH_S_NONE;
    }
}

#define MAX_SLICES 256

PyDoc_STRVAR(reduce_slices_doc,
"reduce_slices(inputs, outputs, op, prescale=1.0, postscale=1.0) -> None\n\n"
"One pass over C-contiguous arrays of one dtype and size: ``inputs[0] op inputs[1] op ...``,\n"
"each input multiplied by ``prescale`` first and the result by ``postscale``, written into\n"
"every array of ``outputs``. ``op``: Horovod's Sum (1), Min (3), Max (4) or Product (5);\n"
"float16 and bfloat16 take Sum only, bool Min and Max. Inputs are combined in their order with\n"
"one rounding per step, as one MPI reduction step rounds; scaling is numpy's\n"
"(``np.multiply(x, factor, out=x, casting='unsafe')``). An output may be one of the inputs.");

static PyObject *py_reduce_slices(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"inputs", "outputs", "op", "prescale", "postscale", NULL};
    PyObject *inputs_obj, *outputs_obj;
    int op;
    double pre = 1.0, post = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOi|dd:reduce_slices", keywords,
                                     &inputs_obj, &outputs_obj, &op, &pre, &post))
        return NULL;
    PyObject *inputs = PySequence_Fast(inputs_obj, "reduce_slices: inputs must be a sequence");
    if (inputs == NULL)
        return NULL;
    PyObject *outputs = PySequence_Fast(outputs_obj, "reduce_slices: outputs must be a sequence");
    if (outputs == NULL) {
        Py_DECREF(inputs);
        return NULL;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(inputs), m = PySequence_Fast_GET_SIZE(outputs);
    PyObject *result = NULL;
    array_view views[2 * MAX_SLICES];
    const void *in[MAX_SLICES];
    void *out[MAX_SLICES];
    Py_ssize_t got = 0;
    if (k < 1 || m < 1 || k > MAX_SLICES || m > MAX_SLICES) {
        PyErr_Format(PyExc_ValueError, "reduce_slices: 1 to %d inputs and outputs, not %zd and "
                     "%zd", MAX_SLICES, k, m);
        goto done;
    }
    hh_slice_type type = HH_S_NONE;
    for (; got < k + m; got++) {
        int is_out = got >= k;
        Py_ssize_t index = is_out ? got - k : got;
        PyObject *obj = PySequence_Fast_GET_ITEM(is_out ? outputs : inputs, index);
        if (get_array(obj, is_out, &views[got], "reduce_slices", is_out ? "outputs" : "inputs",
                      index) != 0)
            goto done;
        hh_slice_type t = slice_type(&views[got]);
        if (got == 0) {
            type = t;
            if (!hh_slices_supported(type, op)) {
                PyErr_Format(PyExc_TypeError, "reduce_slices: op %d on %s elements is not "
                             "supported", op, format_name(&views[0]));
                got++;
                goto done;
            }
        } else if (t != type || views[got].count != views[0].count) {
            PyErr_Format(PyExc_ValueError, "reduce_slices: %s[%zd] is %zd elements of %s, not "
                         "%zd of %s like inputs[0]", is_out ? "outputs" : "inputs", index,
                         views[got].count, format_name(&views[got]), views[0].count,
                         format_name(&views[0]));
            got++;
            goto done;
        }
        if (is_out)
            out[index] = views[got].view.buf;
        else
            in[index] = views[got].view.buf;
    }
    {
        size_t n = (size_t)views[0].count;
        int release = n * (size_t)views[0].view.itemsize * (size_t)(k + m) >= GIL_RELEASE_BYTES;
        PyThreadState *state = release ? PyEval_SaveThread() : NULL;
        hh_reduce_slices(type, op, in, (int)k, out, (int)m, n, pre, post);
        if (release)
            PyEval_RestoreThread(state);
    }
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i].view);
    Py_DECREF(inputs);
    Py_DECREF(outputs);
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
static PyMethodDef methods[] = {
    {"has_half_sum", py_has_half_sum, METH_NOARGS, has_half_sum_doc},
    {"half_sum_op", py_half_sum_op, METH_O, half_sum_op_doc},
    {"reduce_slices", (PyCFunction)(void (*)(void))py_reduce_slices,
     METH_VARARGS | METH_KEYWORDS, reduce_slices_doc},
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
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hpc_horovod._native",
    .m_doc = "Native kernels: float16/bfloat16 MPI sums, fused pack/unpack with scaling.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    hh_kernels_init();
    str_dtype = PyUnicode_InternFromString("dtype");
    str_name = PyUnicode_InternFromString("name");
    if (str_dtype == NULL || str_name == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    return m;
}
