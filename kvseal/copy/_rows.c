/* kvseal's byte-moving kernel: copies a list of rows (dst, src, size) in one call, without the GIL.
 *
 * The engine computes every row's addresses in numpy (kvseal/copy/rows.py) from geometry it validated at
 * registration and pages the store handed out; this file only moves bytes. Large transfers go with non-temporal
 * stores: they bypass the cache, so a copy much larger than the last-level cache does not first read every
 * destination line in (measured on the project's machines: memcpy of 128 MiB with cached stores 7 GB/s, with
 * glibc's streaming stores past its threshold 12.8 GB/s). Small ones, and copies whose destination is read next,
 * use memcpy. Only x86-64 has the streaming path; elsewhere every row is a memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>

#define STREAMING 1

/* Copies the bytes before dst's next 64-byte boundary, so that the streaming stores that follow are aligned. */
static inline void copy_head(char **dst, const char **src, size_t *n) {
    size_t head = (64 - ((uintptr_t)*dst & 63)) & 63;
    if (head > *n) head = *n;
    memcpy(*dst, *src, head);
    *dst += head, *src += head, *n -= head;
}

/* 64 bytes a step (one cache line): loads unaligned, stores aligned and non-temporal. */
__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, size_t n) {
    copy_head(&dst, &src, &n);
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
    }
    memcpy(dst, src, n);
}

static void stream_sse2(char *dst, const char *src, size_t n) {
    copy_head(&dst, &src, &n);
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
}

static int has_avx2;
#else
#define STREAMING 0
#endif

static int as_words(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || view->len % 8) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous array of 8-byte integers", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_rows_doc,
             "copy_rows(dsts, srcs, sizes, streaming)\n\n"
             "Copies sizes[i] bytes from address srcs[i] to address dsts[i] for every i (uint64 arrays of one length),\n"
             "with non-temporal stores when streaming is true (and the machine has them). The caller guarantees that\n"
             "every row lies in memory it owns and that no destination overlaps another row. Releases the GIL.");

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    PyObject *dsts_obj, *srcs_obj, *sizes_obj;
    int streaming;
    if (!PyArg_ParseTuple(args, "OOOp", &dsts_obj, &srcs_obj, &sizes_obj, &streaming)) return NULL;
    Py_buffer dsts, srcs, sizes;
    if (as_words(dsts_obj, &dsts, "dsts") < 0) return NULL;
    if (as_words(srcs_obj, &srcs, "srcs") < 0) {
        PyBuffer_Release(&dsts);
        return NULL;
    }
    if (as_words(sizes_obj, &sizes, "sizes") < 0) {
        PyBuffer_Release(&dsts);
        PyBuffer_Release(&srcs);
        return NULL;
    }
    PyObject *result = NULL;
    if (dsts.len != srcs.len || dsts.len != sizes.len) {
        PyErr_SetString(PyExc_ValueError, "dsts, srcs and sizes must have one length");
    } else {
        const uint64_t *d = dsts.buf, *s = srcs.buf, *n = sizes.buf;
        Py_ssize_t rows = dsts.len / 8;
        Py_BEGIN_ALLOW_THREADS
#if STREAMING
        if (streaming) {
            for (Py_ssize_t i = 0; i < rows; i++) {
                if (has_avx2)
                    stream_avx2((char *)(uintptr_t)d[i], (const char *)(uintptr_t)s[i], (size_t)n[i]);
                else
                    stream_sse2((char *)(uintptr_t)d[i], (const char *)(uintptr_t)s[i], (size_t)n[i]);
            }
            _mm_sfence(); /* streaming stores are weakly ordered: visible to every reader once this returns */
        } else
#endif
        {
            for (Py_ssize_t i = 0; i < rows; i++)
                memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)n[i]);
        }
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&dsts);
    PyBuffer_Release(&srcs);
    PyBuffer_Release(&sizes);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS, copy_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvseal.copy._rows", "kvseal's byte-moving kernel (see _rows.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__rows(void) {
#if STREAMING
    __builtin_cpu_init();
    has_avx2 = __builtin_cpu_supports("avx2");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
