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

/* The k best of row[0..n) into h, sorted best first; 0, or 1 where the row holds a NaN or
   fewer than k values above -inf. */
static int heap_top(const float *row, Py_ssize_t n, Py_ssize_t k, entry *h) {
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
    if (nan || !(t > -INFINITY)) return 1;
    qsort(h, k, sizeof(entry), better_first);
    return 0;
}

/* The row argument as native float32 (a TypeError otherwise) and k checked against it. */
static const float *float_row(PyObject *arg, Py_buffer *view, Py_ssize_t k, Py_ssize_t *n) {
    if (PyObject_GetBuffer(arg, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    const char *fmt = view->format ? view->format : "B";
    const unsigned probe = 1;
    const char foreign = *(const char *)&probe ? '>' : '<';  /* the byte order that is not ours */
    if (view->itemsize != 4 || fmt[strlen(fmt) - 1] != 'f' || fmt[0] == foreign || (fmt[0] == '!' && foreign == '>')) {
        PyErr_SetString(PyExc_TypeError, "top_k needs a contiguous row of native float32");
        PyBuffer_Release(view);
        return NULL;
    }
    *n = view->len / 4;
    if (k <= 0 || k > *n) {
        PyErr_SetString(PyExc_ValueError, "top_k needs 0 < k <= len(row)");
        PyBuffer_Release(view);
        return NULL;
    }
    return view->buf;
}

/* The k best of the row argument, sorted, in a new array the caller frees; NULL with an
   exception set where the row or k is refused. *none: the row holds a NaN or fewer than
   k values above -inf. */
static entry *best_of(PyObject *arg, Py_ssize_t k, int *none) {
    Py_buffer view;
    Py_ssize_t n;
    const float *row = float_row(arg, &view, k, &n);
    if (!row) return NULL;
    entry *h = PyMem_Malloc(k * sizeof(entry));
    if (h) *none = heap_top(row, n, k, h);
    else PyErr_NoMemory();
    PyBuffer_Release(&view);
    return h;
}

static PyObject *top_k(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "top_k(row, k)");
        return NULL;
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[1]);
    if (k == -1 && PyErr_Occurred()) return NULL;
    int none;
    entry *h = best_of(args[0], k, &none);
    if (!h) return NULL;
    PyObject *result = NULL;
    if (none) {
        result = Py_None;
        Py_INCREF(result);
    } else {
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
    return result;
}

/* The correctly rounded sum of n doubles, as Python's math.fsum gives it: exact partial
   sums that never overlap (Shewchuk), added from the largest, with the last rounding
   made half-even on the exact remainder. The draw below must divide by the very total
   fused.py's lists divide by. Finite values only. */
static double exact_sum(const double *x, Py_ssize_t n) {
    double part[64];  /* the partials of finite doubles never exceed ~40 */
    int m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double v = x[i];
        int j = 0;
        for (int q = 0; q < m; q++) {
            double y = part[q];
            if (fabs(v) < fabs(y)) { double swap = v; v = y; y = swap; }
            double hi = v + y, lo = y - (hi - v);
            if (lo != 0.0) part[j++] = lo;
            v = hi;
        }
        m = j;
        part[m++] = v;
    }
    if (m == 0) return 0.0;
    double hi = part[--m], lo = 0.0;
    while (m > 0) {
        double v = hi, y = part[--m];
        hi = v + y;
        lo = y - (hi - v);
        if (lo != 0.0) break;
    }
    /* what is left below rounds hi half-way to even: move it to the side it lies on */
    if (m > 0 && ((lo < 0.0 && part[m - 1] < 0.0) || (lo > 0.0 && part[m - 1] > 0.0))) {
        double y = lo * 2.0, v = hi + y;
        if (y == v - hi) hi = v;
    }
    return hi;
}

enum { OP_TOP_P = 1, OP_MIN_P = 2, OP_TEMPERATURE = 3 };

/* top_k_draw(row, k, tail, random): fused.py's whole chain after the penalties in one
   call: the top k (as top_k), then each (op, value, min_keep) of `tail` (top-p, min-p,
   temperature: FusedChain.truncate's arithmetic step for step, in doubles holding
   float32 logits), the final probabilities, and the draw with u = random(): the id at
   the first running total of the probabilities above u times their sum (bisect_right).
   The same id as those lists and Sampler.sample's draw give, bit for bit. None, with
   random() not called, where top_k gives None.

   Why: the lists cost more than the pass. Right after a decode each Python object is a
   miss to memory; 2k Python floats and ints, their lists and a dozen passes over them
   took ~110-170 us a token in the engine loop. */
static PyObject *top_k_draw(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "top_k_draw(row, k, tail: tuple, random)");
        return NULL;
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[1]);
    if (k == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n_ops = PyTuple_GET_SIZE(args[2]);
    int ops[8];
    double values[8];
    Py_ssize_t keeps[8];
    if (n_ops > 8) {
        PyErr_SetString(PyExc_ValueError, "top_k_draw: at most 8 tail stages");
        return NULL;
    }
    for (Py_ssize_t q = 0; q < n_ops; q++) {
        PyObject *op = PyTuple_GET_ITEM(args[2], q);
        if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) != 3) {
            PyErr_SetString(PyExc_TypeError, "top_k_draw: a tail stage is (op, value, min_keep)");
            return NULL;
        }
        ops[q] = (int)PyLong_AsLong(PyTuple_GET_ITEM(op, 0));
        values[q] = PyFloat_AsDouble(PyTuple_GET_ITEM(op, 1));
        keeps[q] = PyLong_AsSsize_t(PyTuple_GET_ITEM(op, 2));
        if (PyErr_Occurred()) return NULL;
        if (ops[q] < OP_TOP_P || ops[q] > OP_TEMPERATURE) {
            PyErr_SetString(PyExc_ValueError, "top_k_draw: unknown tail stage");
            return NULL;
        }
    }
    int none;
    entry *h = best_of(args[0], k, &none);
    if (!h) return NULL;
    PyObject *result = NULL;
    double *x = PyMem_Malloc(k * sizeof(double)), *e = PyMem_Malloc(k * sizeof(double));
    if (!x || !e) { PyErr_NoMemory(); goto done; }
    if (none) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    Py_ssize_t len = k;
    for (Py_ssize_t j = 0; j < k; j++) x[j] = h[j].v;
    for (Py_ssize_t q = 0; q < n_ops; q++) {
        if (ops[q] == OP_TEMPERATURE) {
            for (Py_ssize_t j = 0; j < len; j++) x[j] = (float)(x[j] / values[q]);  /* one float32 rounding */
            continue;
        }
        if (len <= 1) continue;
        Py_ssize_t keep;
        if (ops[q] == OP_TOP_P) {
            double cum = 0.0;
            for (Py_ssize_t j = 0; j < len; j++) e[j] = cum += exp(x[j] - x[0]);
            double reach = values[q] * cum;
            keep = len;
            for (Py_ssize_t j = 0; j < len; j++) if (e[j] >= reach) { keep = j + 1; break; }
            if (keep < keeps[q]) keep = keeps[q];
        } else {  /* min-p: a float32 threshold; the kept logits are a prefix */
            double threshold = (float)((float)x[0] + (float)values[q]);
            keep = 0;
            for (Py_ssize_t j = 0; j < len; j++) keep += x[j] >= threshold;
            if (keep < (keeps[q] > 1 ? keeps[q] : 1)) keep = keeps[q];
        }
        if (keep < len) len = keep;
    }
    for (Py_ssize_t j = 0; j < len; j++) e[j] = exp(x[j] - x[0]);
    double total = exact_sum(e, len);
    PyObject *u_obj = PyObject_CallNoArgs(args[3]);
    if (!u_obj) goto done;
    double u = PyFloat_AsDouble(u_obj);
    Py_DECREF(u_obj);
    if (u == -1.0 && PyErr_Occurred()) goto done;
    double cum = 0.0;
    for (Py_ssize_t j = 0; j < len; j++) cum += x[j] = e[j] / total;  /* x: the running totals' terms */
    double reach = u * cum;
    Py_ssize_t at = len - 1;
    double run = 0.0;
    for (Py_ssize_t j = 0; j < len; j++) {
        run += x[j];
        if (run > reach) { at = j; break; }
    }
    result = PyLong_FromSsize_t(h[at].id);
done:
    PyMem_Free(h);
    PyMem_Free(x);
    PyMem_Free(e);
    return result;
}

static PyMethodDef methods[] = {
    {"top_k", (PyCFunction)(void (*)(void))top_k, METH_FASTCALL, "top_k(row, k)"},
    {"top_k_draw", (PyCFunction)(void (*)(void))top_k_draw, METH_FASTCALL, "top_k_draw(row, k, tail, random)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_topk", NULL, -1, methods};

PyMODINIT_FUNC PyInit__topk(void) { return PyModule_Create(&module); }
