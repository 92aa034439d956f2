/* kvseal's byte-moving kernel: copies a batch of blocks' layer segments (copy_blocks), or a list of rows (dst, src,
 * size: copy_rows), in one call, without the GIL.
 *
 * The engine gives the addresses from geometry it validated at registration and pages the store handed out
 * (kvseal/copy/rows.py); this file only moves bytes. Large transfers go with non-temporal
 * stores: they bypass the cache, so a copy much larger than the last-level cache does not first read every
 * destination line in (measured on the project's machines: memcpy of 128 MiB with cached stores 7 GB/s, with
 * glibc's streaming stores past its threshold 12.8 GB/s). Small ones, and copies whose destination is read next,
 * use memcpy. Only x86-64 has the streaming path; elsewhere every row is a memcpy.
 *
 * It also checksums pages without the GIL (checksums): XXH3-64, called through the xxhash package's own compiled
 * library (load_xxh3 looks its exported XXH3_64bits up in the already-loaded module), so that a peer fetch's or an
 * SSD read's hashing runs beside the interpreter instead of holding it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
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

static void copy_one(char *dst, const char *src, size_t n, int streaming) {
#if STREAMING
    if (streaming) {
        if (has_avx2)
            stream_avx2(dst, src, n);
        else
            stream_sse2(dst, src, n);
        return;
    }
#endif
    (void)streaming;
    memcpy(dst, src, n);
}

PyDoc_STRVAR(copy_blocks_doc,
             "copy_blocks(address, pitch, width, page_offset, block_ids, pages, to_pool, streaming)\n\n"
             "Copies every segment s of every block k between a worker's memory and a pool page (int64 arrays:\n"
             "per segment its block 0 address, pitch and width and its offset in a page; per block its id and\n"
             "its page's address): worker address[s] + pitch[s] * block_ids[k] <-> pages[k] + page_offset[s],\n"
             "width[s] bytes, into the pool when to_pool is true, out of it otherwise, segment by segment. The\n"
             "caller guarantees every address is memory it owns and no destination overlaps another. Releases\n"
             "the GIL.");

static PyObject *copy_blocks(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    int to_pool, streaming;
    static const char *names[6] = {"address", "pitch", "width", "page_offset", "block_ids", "pages"};
    if (!PyArg_ParseTuple(args, "OOOOOOpp", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &to_pool,
                          &streaming))
        return NULL;
    Py_buffer v[6];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 6; got++)
        if (as_words(objs[got], &v[got], names[got]) < 0) goto done;
    Py_ssize_t segments = v[0].len / 8, blocks = v[4].len / 8;
    if (v[1].len != v[0].len || v[2].len != v[0].len || v[3].len != v[0].len || v[5].len != v[4].len) {
        PyErr_SetString(PyExc_ValueError, "the segment arrays must have one length, and block_ids and pages another");
        goto done;
    }
    const int64_t *address = v[0].buf, *pitch = v[1].buf, *width = v[2].buf, *offset = v[3].buf;
    const int64_t *ids = v[4].buf, *pages = v[5].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < segments; s++) {
        for (Py_ssize_t k = 0; k < blocks; k++) {
            char *worker = (char *)(uintptr_t)(address[s] + pitch[s] * ids[k]);
            char *pool = (char *)(uintptr_t)(pages[k] + offset[s]);
            if (to_pool)
                copy_one(pool, worker, (size_t)width[s], streaming);
            else
                copy_one(worker, pool, (size_t)width[s], streaming);
        }
    }
#if STREAMING
    if (streaming) _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    while (got-- > 0) PyBuffer_Release(&v[got]);
    return result;
}

typedef uint64_t (*xxh3_64_fn)(const void *, size_t);
static xxh3_64_fn xxh3_64 = NULL;

PyDoc_STRVAR(load_xxh3_doc,
             "load_xxh3(path) -> bool: finds XXH3_64bits in the shared library at `path`, which must already be loaded\n"
             "(the xxhash package's extension module); False when it is not loaded or does not export it.");

static PyObject *load_xxh3(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *library = dlopen(path, RTLD_NOW | RTLD_NOLOAD); /* kept open: the module stays loaded anyway */
    void *symbol = library ? dlsym(library, "XXH3_64bits") : NULL;
    if (symbol == NULL) Py_RETURN_FALSE;
    xxh3_64 = (xxh3_64_fn)symbol;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(checksums_doc,
             "checksums(buffers) -> list[int]: the XXH3-64 of each contiguous buffer, computed without the GIL\n"
             "(load_xxh3 first).");

static PyObject *checksums(PyObject *self, PyObject *arg) {
    if (xxh3_64 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "checksums: XXH3 is not loaded (load_xxh3)");
        return NULL;
    }
    PyObject *items = PySequence_Fast(arg, "checksums: a sequence of buffers");
    if (items == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items), got = 0;
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    uint64_t *sums = PyMem_Malloc((n ? n : 1) * sizeof(uint64_t));
    PyObject *result = NULL;
    if (views == NULL || sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(items, got), &views[got], PyBUF_SIMPLE) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) sums[i] = xxh3_64(views[i].buf, (size_t)views[i].len);
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *sum = PyLong_FromUnsignedLongLong(sums[i]);
        if (sum == NULL) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, sum);
    }
done:
    while (got-- > 0) PyBuffer_Release(&views[got]);
    PyMem_Free(views);
    PyMem_Free(sums);
    Py_DECREF(items);
    return result;
}

static PyMethodDef methods[] = {
    {"load_xxh3", load_xxh3, METH_VARARGS, load_xxh3_doc},
    {"checksums", checksums, METH_O, checksums_doc},
    {"copy_rows", copy_rows, METH_VARARGS, copy_rows_doc},
    {"copy_blocks", copy_blocks, METH_VARARGS, copy_blocks_doc},
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
