#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* top_k(row, k): the k largest floats of a row of native float32 and their ids, sorted by
   value descending, the lower id first among equals, as two lists (ids, floats); None where
   the row holds a NaN or fewer than k values above -inf (the caller's numpy path decides
   those rows).

   Why C: right after a decode the caches hold the model's weights, and each distinct numpy
   call of the fused top-k (localrun/sampling/fused.py) costs ~10-15 us cold, ~270 us a token
   on a 262k row in the engine loop; this is one call and one pass over the row.

   One pass: a heap of the k best so far (its root the worst: the lowest value, of equal
   values the highest id, so the lower id wins a tie as ids arrive in ascending order), and
   a test per block of BLOCK floats, "any above the root (or NaN)", that the compiler turns
   into a few vector compares: once the heap holds good values almost every block is read
   once and left. */

#define BLOCK 32

typedef struct { float v; Py_ssize_t id; } entry;

/* a is worse than b: a lower value, or the same value at a higher id */
static inline int worse(const entry *a, const entry *b) {
    return a->v < b->v || (a->v == b->v && a->id > b->id);
}

static void sift_down(entry *h, Py_ssize_t k, Py_ssize_t i) {
    entry e = h[i];
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= k) break;
        if (c + 1 < k && worse(&h[c + 1], &h[c])) c++;
        if (!worse(&h[c], &e)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = e;
}

static int better_first(const void *pa, const void *pb) {
    const entry *a = pa, *b = pb;
    if (a->v != b->v) return a->v > b->v ? -1 : 1;
    return a->id < b->id ? -1 : (a->id > b->id);
}

/* any value above t, or NaN: "not all <= t", which gcc -O3 and clang vectorize as a
   chain of independent compares and ANDs (an OR of "> t or unordered" compiled to a
   serial mask chain here, ~1.5x slower on a 262k row) */
static inline int block_hits(const float *p, float t) {
    int all = 1;
    for (int j = 0; j < BLOCK; j++) all &= p[j] <= t;
    return !all;
}

static PyObject *top_k(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "top_k(row, k)");
        return NULL;
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[1]);
    if (k == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    PyObject *result = NULL;
    const char *fmt = view.format ? view.format : "B";
    const unsigned probe = 1;
    const char foreign = *(const char *)&probe ? '>' : '<';  /* the byte order that is not ours */
    if (view.itemsize != 4 || fmt[strlen(fmt) - 1] != 'f' || fmt[0] == foreign || (fmt[0] == '!' && foreign == '>')) {
        PyErr_SetString(PyExc_TypeError, "top_k needs a contiguous row of native float32");
        goto done;
    }
    const float *row = view.buf;
    Py_ssize_t n = view.len / 4;
    if (k <= 0 || k > n) {
        PyErr_SetString(PyExc_ValueError, "top_k needs 0 < k <= len(row)");
        goto done;
    }
    entry *h = PyMem_Malloc(k * sizeof(entry));
    if (!h) { PyErr_NoMemory(); goto done; }
    int nan = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        h[i].v = row[i];
        h[i].id = i;
        nan |= row[i] != row[i];
    }
    for (Py_ssize_t i = k / 2; i-- > 0;) sift_down(h, k, i);
    float t = h[0].v;
    Py_ssize_t i = k;
    for (; !nan && i < n && i % BLOCK; i++) {
        float x = row[i];
        if (!(x <= t)) {
            if (x != x) { nan = 1; break; }
            h[0].v = x; h[0].id = i; sift_down(h, k, 0); t = h[0].v;
        }
    }
    for (; !nan && i + BLOCK <= n; i += BLOCK) {
        if (!block_hits(row + i, t)) continue;
        for (Py_ssize_t j = i; j < i + BLOCK; j++) {
            float x = row[j];
            if (!(x <= t)) {
                if (x != x) { nan = 1; break; }
                h[0].v = x; h[0].id = j; sift_down(h, k, 0); t = h[0].v;
            }
        }
    }
    for (; !nan && i < n; i++) {
        float x = row[i];
        if (!(x <= t)) {
            if (x != x) { nan = 1; break; }
            h[0].v = x; h[0].id = i; sift_down(h, k, 0); t = h[0].v;
        }
    }
    if (nan || !(t > -INFINITY)) {
        result = Py_None;
        Py_INCREF(result);
    } else {
        qsort(h, k, sizeof(entry), better_first);
        PyObject *ids = PyList_New(k), *vals = PyList_New(k);
        if (ids && vals) {
            for (Py_ssize_t j = 0; j < k; j++) {
                PyObject *a = PyLong_FromSsize_t(h[j].id), *b = PyFloat_FromDouble(h[j].v);
                if (!a || !b) { Py_XDECREF(a); Py_XDECREF(b); Py_CLEAR(ids); break; }
                PyList_SET_ITEM(ids, j, a);
                PyList_SET_ITEM(vals, j, b);
            }
        }
        if (ids && vals) result = PyTuple_Pack(2, ids, vals);
        Py_XDECREF(ids);
        Py_XDECREF(vals);
    }
    PyMem_Free(h);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"top_k", (PyCFunction)(void (*)(void))top_k, METH_FASTCALL, "top_k(row, k)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_topk", NULL, -1, methods};

PyMODINIT_FUNC PyInit__topk(void) { return PyModule_Create(&module); }
