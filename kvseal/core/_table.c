/* The page table's hot loops in C (kvseal.core.pages.NativePageTable): the same batch operations as the Python
 * PageTable, on the same arrays (array.array objects the Python class owns), one call per batch instead of a
 * Python loop per page. pages.py's Python methods are the reference: tests/test_table.py drives both with the same
 * operations and compares every array after each step.
 *
 * Arrays (as pages.py declares them): state int8, pins / prev / next / slab_of / ns_of / writers / slab_busy int32,
 * offset int64. Page ids come as any sequence of ints and are range-checked (IndexError): a caller bug raises, it
 * never writes outside an array. Values follow pages.py: FREE 0, INFLIGHT 1, SEALED 2.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { FREE = 0, INFLIGHT = 1, SEALED = 2 };

typedef struct {
    Py_buffer view;
    Py_ssize_t n;
} Arr;

static int get(PyObject *obj, Arr *a, Py_ssize_t itemsize, const char *name) {
    if (PyObject_GetBuffer(obj, &a->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (a->view.itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s must be an array of %zd-byte items", name, itemsize);
        PyBuffer_Release(&a->view);
        return -1;
    }
    a->n = a->view.len / itemsize;
    return 0;
}

/* Buffers of `count` arrays; returns how many it got (count, or fewer with an exception set: release those). */
static int get_all(PyObject *const *objs, Arr *a, const Py_ssize_t *sizes, const char *const *names, int count) {
    for (int i = 0; i < count; i++)
        if (get(objs[i], &a[i], sizes[i], names[i]) < 0) return i;
    return count;
}

static int check_sentinel(Py_ssize_t sentinel, Py_ssize_t pages) {
    if (sentinel >= 0 && sentinel < pages) return 0;
    PyErr_SetString(PyExc_IndexError, "sentinel is out of the table");
    return -1;
}

#define I32(a) ((int32_t *)(a).view.buf)
#define I8(a) ((int8_t *)(a).view.buf)
#define I64(a) ((int64_t *)(a).view.buf)

/* pids as C ints, each checked against `limit`; NULL with an exception set otherwise. Free with PyMem_Free. */
static Py_ssize_t *ids(PyObject *seq, Py_ssize_t limit, Py_ssize_t *count) {
    PyObject *fast = PySequence_Fast(seq, "page ids must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t *out = PyMem_Malloc((n ? n : 1) * sizeof(Py_ssize_t));
    if (out == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(items[i]);
        if (v == -1 && PyErr_Occurred()) goto fail;
        if (v < 0 || v >= limit) {
            PyErr_Format(PyExc_IndexError, "page id %zd is out of the table (%zd ids)", v, limit);
            goto fail;
        }
        out[i] = v;
    }
    Py_DECREF(fast);
    *count = n;
    return out;
fail:
    Py_DECREF(fast);
    PyMem_Free(out);
    return NULL;
}

static void release(Arr *arrs, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&arrs[i].view);
}

/* Puts pids at the most recently used end of the ring whose sentinel is given, in order (the last most recent). */
static void link_mru(int32_t *prev, int32_t *next, const Py_ssize_t *pids, Py_ssize_t n, Py_ssize_t sentinel) {
    int32_t first = next[sentinel];
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t pid = (int32_t)pids[i];
        prev[first] = pid;
        next[pid] = first;
        first = pid;
    }
    prev[first] = (int32_t)sentinel;
    next[sentinel] = first;
}

/* link_mru of the pages whose hot flag is `want` (hot == NULL: all of them) */
static void link_where(int32_t *prev, int32_t *next, const Py_ssize_t *pids, Py_ssize_t n, Py_ssize_t sentinel,
                       const int8_t *hot, int8_t want) {
    int32_t first = next[sentinel];
    Py_ssize_t linked = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t pid = (int32_t)pids[i];
        if (hot != NULL && hot[pid] != want) continue;
        prev[first] = pid;
        next[pid] = first;
        first = pid;
        linked++;
    }
    if (!linked) return;
    prev[first] = (int32_t)sentinel;
    next[sentinel] = first;
}

PyDoc_STRVAR(pin_doc, "pin(pins, prev, next, slab_busy, slab_of, pids) -> pages pinned for the first time");
static PyObject *pin(PyObject *self, PyObject *args) {
    PyObject *o[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5])) return NULL;
    Arr a[5];
    static const Py_ssize_t sizes[5] = {4, 4, 4, 4, 4};
    static const char *const names[5] = {"pins", "prev", "next", "slab_busy", "slab_of"};
    PyObject *result = NULL;
    Py_ssize_t n = 0, *pids = NULL;
    int got = get_all(o, a, sizes, names, 5);
    if (got < 5 || (pids = ids(o[5], a[0].n, &n)) == NULL) goto done;
    int32_t *pins = I32(a[0]), *prev = I32(a[1]), *next = I32(a[2]), *busy = I32(a[3]), *slab_of = I32(a[4]);
    Py_ssize_t newly = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t pid = pids[i];
        if (pins[pid] == 0) {
            int32_t p = prev[pid], q = next[pid];
            next[p] = q;
            prev[q] = p;
            busy[slab_of[pid]] += 1;
            newly++;
        }
        pins[pid] += 1;
    }
    result = PyLong_FromSsize_t(newly);
done:
    PyMem_Free(pids);
    release(a, got);
    return result;
}

PyDoc_STRVAR(unpin_doc,
             "unpin(pins, prev, next, slab_busy, slab_of, hot, pids, sentinel, hot_sentinel) -> pages left without\n"
             "pins, each linked, in order, at the most recently used end of its segment: after hot_sentinel when its\n"
             "hot flag is set, else after sentinel");
static PyObject *unpin(PyObject *self, PyObject *args) {
    PyObject *o[7];
    Py_ssize_t sentinel, hot_sentinel;
    if (!PyArg_ParseTuple(args, "OOOOOOOnn", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &sentinel,
                          &hot_sentinel))
        return NULL;
    Arr a[6];
    static const Py_ssize_t sizes[6] = {4, 4, 4, 4, 4, 1};
    static const char *const names[6] = {"pins", "prev", "next", "slab_busy", "slab_of", "hot"};
    PyObject *result = NULL;
    Py_ssize_t n = 0, *pids = NULL;
    int got = get_all(o, a, sizes, names, 6);
    if (got < 6 || (pids = ids(o[6], a[0].n, &n)) == NULL || check_sentinel(sentinel, a[0].n) < 0 ||
        check_sentinel(hot_sentinel, a[0].n) < 0)
        goto done;
    if (a[5].n != a[0].n) {
        PyErr_SetString(PyExc_ValueError, "hot must have one entry per page id");
        goto done;
    }
    int32_t *pins = I32(a[0]), *prev = I32(a[1]), *next = I32(a[2]), *busy = I32(a[3]), *slab_of = I32(a[4]);
    Py_ssize_t k = 0; /* the unpinned pages, compacted at the front of pids */
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t pid = pids[i];
        if (--pins[pid] == 0) {
            busy[slab_of[pid]] -= 1;
            pids[k++] = pid;
        }
    }
    if (k) {
        const int8_t *hot = I8(a[5]);
        link_where(prev, next, pids, k, sentinel, hot, 0);
        link_where(prev, next, pids, k, hot_sentinel, hot, 1);
    }
    result = PyLong_FromSsize_t(k);
done:
    PyMem_Free(pids);
    release(a, got);
    return result;
}

PyDoc_STRVAR(seal_doc, "seal(state, prev, next, slab_busy, slab_of, pids, sentinel): INFLIGHT -> SEALED, linked MRU");
static PyObject *seal(PyObject *self, PyObject *args) {
    PyObject *o[6];
    Py_ssize_t sentinel;
    if (!PyArg_ParseTuple(args, "OOOOOOn", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &sentinel)) return NULL;
    Arr a[5];
    static const Py_ssize_t sizes[5] = {1, 4, 4, 4, 4};
    static const char *const names[5] = {"state", "prev", "next", "slab_busy", "slab_of"};
    PyObject *result = NULL;
    Py_ssize_t n = 0, *pids = NULL;
    int got = get_all(o, a, sizes, names, 5);
    if (got < 5 || (pids = ids(o[5], a[0].n, &n)) == NULL || check_sentinel(sentinel, a[0].n) < 0) goto done;
    int8_t *state = I8(a[0]);
    int32_t *busy = I32(a[3]), *slab_of = I32(a[4]);
    for (Py_ssize_t i = 0; i < n; i++) {
        state[pids[i]] = SEALED;
        busy[slab_of[pids[i]]] -= 1;
    }
    link_mru(I32(a[1]), I32(a[2]), pids, n, sentinel);
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(pids);
    release(a, got);
    return result;
}

PyDoc_STRVAR(forget_doc,
             "forget(state, prev, next, block_hash, pids, lru_tail, reused): sealed pages leave their ring (run by\n"
             "run, or in one splice when lru_tail) and, unless reused, become FREE with no hash");
static PyObject *forget(PyObject *self, PyObject *args) {
    PyObject *o[3], *hashes, *pid_seq;
    int lru_tail, reused;
    if (!PyArg_ParseTuple(args, "OOOO!Opp", &o[0], &o[1], &o[2], &PyList_Type, &hashes, &pid_seq, &lru_tail,
                          &reused))
        return NULL;
    Arr a[3];
    static const Py_ssize_t sizes[3] = {1, 4, 4};
    static const char *const names[3] = {"state", "prev", "next"};
    PyObject *result = NULL;
    Py_ssize_t n = 0, *pids = NULL;
    int got = get_all(o, a, sizes, names, 3);
    if (got < 3 || (pids = ids(pid_seq, a[0].n, &n)) == NULL) goto done;
    if (PyList_GET_SIZE(hashes) != a[0].n) {
        PyErr_SetString(PyExc_ValueError, "block_hash must have one entry per page id");
        goto done;
    }
    int8_t *state = I8(a[0]);
    int32_t *prev = I32(a[1]), *next = I32(a[2]);
    if (n) {
        if (!reused) {
            for (Py_ssize_t i = 0; i < n; i++) {
                state[pids[i]] = FREE;
                PyObject *old = PyList_GET_ITEM(hashes, pids[i]);
                PyList_SET_ITEM(hashes, pids[i], Py_NewRef(Py_None));
                Py_XDECREF(old);
            }
        }
        int32_t first = (int32_t)pids[0], last = (int32_t)pids[0];
        if (lru_tail) {
            last = (int32_t)pids[n - 1];
        } else { /* pages that follow each other in the ring, less recent first, leave it run by run */
            for (Py_ssize_t i = 1; i < n; i++) {
                int32_t pid = (int32_t)pids[i];
                if (prev[last] == pid) {
                    last = pid;
                    continue;
                }
                int32_t p = prev[last], q = next[first];
                next[p] = q;
                prev[q] = p;
                first = last = pid;
            }
        }
        int32_t p = prev[last], q = next[first];
        next[p] = q;
        prev[q] = p;
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(pids);
    release(a, got);
    return result;
}

PyDoc_STRVAR(lru_victims_doc,
             "lru_victims(prev, sentinel, n, protected, skip) -> the n least recently used pages of the ring not in\n"
             "protected (a set, or None), least recent first, passing over `skip` (the ring's other sentinel); []\n"
             "when it has fewer");
static PyObject *lru_victims(PyObject *self, PyObject *args) {
    PyObject *prev_obj, *protected;
    Py_ssize_t sentinel, n, skip;
    if (!PyArg_ParseTuple(args, "OnnOn", &prev_obj, &sentinel, &n, &protected, &skip)) return NULL;
    Arr a;
    if (get(prev_obj, &a, 4, "prev") < 0) return NULL;
    PyObject *out = NULL;
    if (sentinel < 0 || sentinel >= a.n) {
        PyErr_SetString(PyExc_IndexError, "sentinel is out of the table");
        goto done;
    }
    if (protected != Py_None && !PyAnySet_Check(protected)) {
        PyErr_SetString(PyExc_TypeError, "protected must be a set or None");
        goto done;
    }
    if ((out = PyList_New(0)) == NULL) goto done;
    int32_t *prev = I32(a);
    int32_t pid = prev[sentinel];
    Py_ssize_t steps = 0;
    while (pid != sentinel && PyList_GET_SIZE(out) < n) {
        if (++steps > a.n || pid < 0 || pid >= a.n) {
            PyErr_SetString(PyExc_RuntimeError, "the LRU ring is broken");
            Py_CLEAR(out);
            goto done;
        }
        if (pid == skip) {
            pid = prev[pid];
            continue;
        }
        PyObject *v = PyLong_FromLong(pid);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        int held = protected != Py_None ? PySet_Contains(protected, v) : 0;
        if (held < 0 || (!held && PyList_Append(out, v) < 0)) {
            Py_DECREF(v);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(v);
        pid = prev[pid];
    }
    if (PyList_GET_SIZE(out) < n) PyList_SetSlice(out, 0, PyList_GET_SIZE(out), NULL);
done:
    PyBuffer_Release(&a.view);
    return out;
}

PyDoc_STRVAR(set_hot_doc, "set_hot(hot, pids, value) -> how many of the pages' hot flags changed to value");
static PyObject *set_hot(PyObject *self, PyObject *args) {
    PyObject *hot_obj, *pid_seq;
    int value;
    if (!PyArg_ParseTuple(args, "OOp", &hot_obj, &pid_seq, &value)) return NULL;
    Arr a;
    if (get(hot_obj, &a, 1, "hot") < 0) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = 0, *pids = NULL;
    if ((pids = ids(pid_seq, a.n, &n)) == NULL) goto done;
    int8_t *hot = I8(a);
    Py_ssize_t changed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (hot[pids[i]] != value) {
            hot[pids[i]] = (int8_t)value;
            changed++;
        }
    }
    result = PyLong_FromSsize_t(changed);
done:
    PyMem_Free(pids);
    PyBuffer_Release(&a.view);
    return result;
}

PyDoc_STRVAR(demote_doc,
             "demote(prev, next, hot, sentinel, probation, n) -> how many of the protected segment's least recently\n"
             "used pages (at most n) became probation's most recently used (the sentinel between the segments moves\n"
             "past each, which stops being hot)");
static PyObject *demote(PyObject *self, PyObject *args) {
    PyObject *o[3];
    Py_ssize_t sentinel, probation, n;
    if (!PyArg_ParseTuple(args, "OOOnnn", &o[0], &o[1], &o[2], &sentinel, &probation, &n)) return NULL;
    Arr a[3];
    static const Py_ssize_t sizes[3] = {4, 4, 1};
    static const char *const names[3] = {"prev", "next", "hot"};
    PyObject *result = NULL;
    int got = get_all(o, a, sizes, names, 3);
    if (got < 3 || check_sentinel(sentinel, a[0].n) < 0 || check_sentinel(probation, a[0].n) < 0) goto done;
    int32_t *prev = I32(a[0]), *next = I32(a[1]);
    int8_t *hot = I8(a[2]);
    Py_ssize_t moved = 0;
    while (moved < n) {
        int32_t pid = prev[probation];
        if (pid == sentinel) break;
        hot[pid] = 0;
        int32_t before = prev[pid], after = next[probation];
        next[pid] = after; /* the probation sentinel leaves its place */
        prev[after] = pid;
        next[before] = (int32_t)probation; /* and goes in before pid */
        prev[probation] = before;
        next[probation] = pid;
        prev[pid] = (int32_t)probation;
        moved++;
    }
    result = PyLong_FromSsize_t(moved);
done:
    release(a, got);
    return result;
}

PyDoc_STRVAR(open_doc,
             "open(state, ns_of, writers, slab_busy, slab_of, block_hash, pids, hashes, ns_id, writer_count):\n"
             "pages FREE -> INFLIGHT for hashes[k], each with writer_count open plans");
static PyObject *open_pages(PyObject *self, PyObject *args) {
    PyObject *o[5], *block_hash, *pid_seq, *hash_seq;
    int ns_id, writer_count;
    if (!PyArg_ParseTuple(args, "OOOOOO!OOii", &o[0], &o[1], &o[2], &o[3], &o[4], &PyList_Type, &block_hash,
                          &pid_seq, &hash_seq, &ns_id, &writer_count))
        return NULL;
    Arr a[5];
    static const Py_ssize_t sizes[5] = {1, 4, 4, 4, 4};
    static const char *const names[5] = {"state", "ns_of", "writers", "slab_busy", "slab_of"};
    PyObject *result = NULL, *fast = NULL;
    Py_ssize_t n = 0, *pids = NULL;
    int got = get_all(o, a, sizes, names, 5);
    if (got < 5 || (pids = ids(pid_seq, a[0].n, &n)) == NULL) goto done;
    if ((fast = PySequence_Fast(hash_seq, "hashes must be a sequence")) == NULL) goto done;
    if (PySequence_Fast_GET_SIZE(fast) != n || PyList_GET_SIZE(block_hash) != a[0].n) {
        PyErr_SetString(PyExc_ValueError, "one hash per page id, and one block_hash entry per page of the table");
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int8_t *state = I8(a[0]);
    int32_t *ns_of = I32(a[1]), *writers = I32(a[2]), *busy = I32(a[3]), *slab_of = I32(a[4]);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t pid = pids[i];
        state[pid] = INFLIGHT;
        ns_of[pid] = ns_id;
        writers[pid] = writer_count;
        busy[slab_of[pid]] += 1;
        PyObject *old = PyList_GET_ITEM(block_hash, pid);
        PyList_SET_ITEM(block_hash, pid, Py_NewRef(items[i]));
        Py_XDECREF(old);
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(fast);
    PyMem_Free(pids);
    release(a, got);
    return result;
}

PyDoc_STRVAR(gather_doc, "gather(offset, pids) -> [offset[pid] for pid in pids] (int64 array)");
static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *arr_obj, *pid_seq;
    if (!PyArg_ParseTuple(args, "OO", &arr_obj, &pid_seq)) return NULL;
    Arr a;
    if (get(arr_obj, &a, 8, "offset") < 0) return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = 0, *pids = ids(pid_seq, a.n, &n);
    if (pids == NULL) goto done;
    if ((out = PyList_New(n)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(I64(a)[pids[i]]);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    PyMem_Free(pids);
    PyBuffer_Release(&a.view);
    return out;
}

PyDoc_STRVAR(end_writes_doc,
             "end_writes(writers, cells, deadline, pids, written, full_mask) -> (complete, empty): one writer of\n"
             "each listed inflight page finished, having written `written`; the pages whose last writer that was\n"
             "leave the inflight dicts");
static PyObject *end_writes(PyObject *self, PyObject *args) {
    PyObject *writers_obj, *cells, *deadlines, *pid_seq, *written, *full_mask;
    if (!PyArg_ParseTuple(args, "OO!O!OOO", &writers_obj, &PyDict_Type, &cells, &PyDict_Type, &deadlines, &pid_seq,
                          &written, &full_mask))
        return NULL;
    Arr a;
    if (get(writers_obj, &a, 4, "writers") < 0) return NULL;
    PyObject *complete = PyList_New(0), *empty = PyList_New(0), *result = NULL;
    PyObject *fast = PySequence_Fast(pid_seq, "page ids must be a sequence");
    if (complete == NULL || empty == NULL || fast == NULL) goto done;
    int32_t *writers = I32(a);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        PyObject *mask = PyDict_GetItemWithError(cells, key); /* borrowed */
        if (mask == NULL) {
            if (PyErr_Occurred()) goto done;
            continue;
        }
        Py_ssize_t pid = PyLong_AsSsize_t(key);
        if (pid == -1 && PyErr_Occurred()) goto done;
        if (pid < 0 || pid >= a.n) {
            PyErr_Format(PyExc_IndexError, "page id %zd is out of the table", pid);
            goto done;
        }
        PyObject *now = PyNumber_Or(mask, written);
        if (now == NULL) goto done;
        int32_t left = --writers[pid];
        int full = left == 0 ? PyObject_RichCompareBool(now, full_mask, Py_EQ) : 0;
        int none = left == 0 && !full ? !PyObject_IsTrue(now) : 0;
        int rc = 0;
        if (full < 0 || none < 0) {
            rc = -1;
        } else if (full || none) {
            rc = PyList_Append(full ? complete : empty, key);
            if (rc == 0) rc = PyDict_DelItem(cells, key);
            if (rc == 0) rc = PyDict_DelItem(deadlines, key);
        } else {
            rc = PyDict_SetItem(cells, key, now);
        }
        Py_DECREF(now);
        if (rc < 0) goto done;
    }
    result = PyTuple_Pack(2, complete, empty);
done:
    Py_XDECREF(fast);
    Py_XDECREF(complete);
    Py_XDECREF(empty);
    PyBuffer_Release(&a.view);
    return result;
}


/* ------------------------------------------------------------------------------------------------ Index
 *
 * A namespace's block hash -> page id map (index.py's BlockIndex, in C). Like BlockIndex it is split into
 * INDEX_SHARDS shards by the key's Python hash (hash(key) & (INDEX_SHARDS - 1)), so a shard that grows copies
 * 1/INDEX_SHARDS of the index; each shard keeps its entries in insertion order (an entries array and a table of
 * slots pointing into it, as CPython's dict does), so items() and values() come out in exactly BlockIndex's
 * order. Keys are bytes; the index holds a reference to each.
 */

#define INDEX_SHARDS 256

/* hash(bytes) of raw bytes, without a bytes object: so a key read from a lane frame lands where the same key as
 * bytes does (CPython exports this function; 3.14 names it Py_HashBuffer, 3.13 only declares it internally). */
#if PY_VERSION_HEX >= 0x030E0000
#define hash_raw Py_HashBuffer
#else
#if PY_VERSION_HEX >= 0x030D0000
PyAPI_FUNC(Py_hash_t) _Py_HashBytes(const void *, Py_ssize_t);
#endif
#define hash_raw _Py_HashBytes
#endif
#define EMPTY (-1)
#define DUMMY (-2)
/* A slot holds an entry's index in its low 32 bits and 32 bits of the key's hash above them (a tag), so a probe
 * past a slot of another key mostly ends in the slot array, without reading that entry (a cache miss each once the
 * index is large and cold). */
#define SLOT(tag, ix) ((int64_t)(((uint64_t)(tag) << 32) | (uint32_t)(ix)))
#define SLOT_INDEX(slot) ((int32_t)(uint32_t)(slot))
#define TAG(hash) ((uint32_t)((uint64_t)(hash) >> 32))
#define SLOT_TAG(slot) ((uint32_t)((uint64_t)(slot) >> 32))

typedef struct {
    PyObject *key; /* NULL: deleted */
    Py_hash_t hash;
    int32_t pid;
} Entry;

typedef struct {
    Entry *entries;
    int64_t *slots; /* EMPTY, DUMMY or SLOT(tag, entry index) */
    Py_ssize_t n_entries; /* appended so far, deleted ones included (each holds a slot, live or DUMMY) */
    Py_ssize_t used;      /* live */
    Py_ssize_t mask;      /* slots - 1 (0: no table yet) */
} Shard;

typedef struct {
    PyObject_HEAD Shard shards[INDEX_SHARDS];
    Py_ssize_t used;
} IndexObject;

static Py_ssize_t usable(Py_ssize_t mask) { return mask ? (mask + 1) * 2 / 3 : 0; }

static int key_hash(PyObject *key, Py_hash_t *hash) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "a block hash must be bytes, not %.50s", Py_TYPE(key)->tp_name);
        return -1;
    }
    *hash = PyObject_Hash(key);
    return *hash == -1 && PyErr_Occurred() ? -1 : 0;
}

static inline int same_key(const Entry *e, const char *key, Py_ssize_t size, Py_hash_t hash) {
    if (e->key == NULL || e->hash != hash) return 0;
    return PyBytes_GET_SIZE(e->key) == size && memcmp(PyBytes_AS_STRING(e->key), key, size) == 0;
}

/* The slot holding the key (size bytes at `key`), or the negative of (1 + the first free slot met) when absent. */
static Py_ssize_t find_raw(const Shard *sh, const char *key, Py_ssize_t size, Py_hash_t hash) {
    if (!sh->mask) return -1;
    Py_ssize_t i = (Py_ssize_t)((size_t)hash >> 8) & sh->mask, free_slot = -1;
    uint32_t tag = TAG(hash);
    for (;;) {
        int64_t slot = sh->slots[i];
        if (slot == EMPTY) return -(1 + (free_slot >= 0 ? free_slot : i));
        if (slot == DUMMY) {
            if (free_slot < 0) free_slot = i;
        } else if (SLOT_TAG(slot) == tag && same_key(&sh->entries[SLOT_INDEX(slot)], key, size, hash)) {
            return i;
        }
        i = (i + 1) & sh->mask;
    }
}

static Py_ssize_t find(const Shard *sh, PyObject *key, Py_hash_t hash) {
    return find_raw(sh, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), hash);
}

/* The page id of a raw key, or -1 when absent. */
static int32_t lookup_raw(IndexObject *self, const char *key, Py_ssize_t size) {
    Py_hash_t hash = hash_raw(key, size);
    Shard *sh = &self->shards[hash & (INDEX_SHARDS - 1)];
    Py_ssize_t at = find_raw(sh, key, size, hash);
    return at >= 0 ? sh->entries[SLOT_INDEX(sh->slots[at])].pid : -1;
}

/* A HashArray (kvseal.wire.lane: n keys of `size` bytes back to back in `buffer` from `offset`) as a raw view: 1
 * when keys is one (view filled: release it), 0 when it is not (no exception), -1 on error. */
static int raw_keys(PyObject *keys, Py_buffer *view, const char **first, Py_ssize_t *n, Py_ssize_t *size) {
    if (PyList_CheckExact(keys) || PyTuple_CheckExact(keys)) return 0;
    PyObject *buffer = PyObject_GetAttrString(keys, "buffer");
    if (buffer == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    Py_ssize_t numbers[3];
    const char *names[3] = {"offset", "size", "n"};
    for (int i = 0; i < 3; i++) {
        PyObject *v = PyObject_GetAttrString(keys, names[i]);
        numbers[i] = v != NULL ? PyLong_AsSsize_t(v) : -1;
        Py_XDECREF(v);
        if (numbers[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(buffer);
            return -1;
        }
    }
    int got = PyObject_GetBuffer(buffer, view, PyBUF_SIMPLE);
    Py_DECREF(buffer);
    if (got < 0) return -1;
    if (numbers[0] < 0 || numbers[1] <= 0 || numbers[2] < 0 || numbers[0] + numbers[1] * numbers[2] > view->len) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "a hash array runs past its buffer");
        return -1;
    }
    *first = (const char *)view->buf + numbers[0];
    *size = numbers[1];
    *n = numbers[2];
    return 1;
}

/* Rebuilds the shard's table for `want` live entries at most 2/3 full, dropping deleted entries (order kept). */
static int rebuild(Shard *sh, Py_ssize_t want) {
    Py_ssize_t size = 8;
    while (size * 2 / 3 < want + 1) size <<= 1;
    Entry *entries = PyMem_Malloc(size * 2 / 3 * sizeof(Entry));
    int64_t *slots = PyMem_Malloc(size * sizeof(int64_t));
    if (entries == NULL || slots == NULL) {
        PyMem_Free(entries);
        PyMem_Free(slots);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < size; i++) slots[i] = EMPTY;
    Py_ssize_t n = 0, mask = size - 1;
    for (Py_ssize_t k = 0; k < sh->n_entries; k++) {
        if (sh->entries[k].key == NULL) continue;
        entries[n] = sh->entries[k];
        Py_ssize_t i = (Py_ssize_t)((size_t)entries[n].hash >> 8) & mask;
        while (slots[i] != EMPTY) i = (i + 1) & mask;
        slots[i] = SLOT(TAG(entries[n].hash), n);
        n++;
    }
    PyMem_Free(sh->entries);
    PyMem_Free(sh->slots);
    sh->entries = entries;
    sh->slots = slots;
    sh->n_entries = sh->used = n;
    sh->mask = mask;
    return 0;
}

static int index_set(IndexObject *self, PyObject *key, int32_t pid) {
    Py_hash_t hash;
    if (key_hash(key, &hash) < 0) return -1;
    Shard *sh = &self->shards[hash & (INDEX_SHARDS - 1)];
    Py_ssize_t at = find(sh, key, hash);
    if (at >= 0) {
        sh->entries[SLOT_INDEX(sh->slots[at])].pid = pid;
        return 0;
    }
    if (sh->n_entries >= usable(sh->mask)) {
        if (rebuild(sh, sh->used * 2 + 1) < 0) return -1;
        at = find(sh, key, hash);
    }
    Py_ssize_t slot = -at - 1;
    sh->entries[sh->n_entries] = (Entry){Py_NewRef(key), hash, pid};
    sh->slots[slot] = SLOT(TAG(hash), sh->n_entries);
    sh->n_entries++;
    sh->used++;
    self->used++;
    return 0;
}

/* The entry of key, NULL when absent (no exception) or on error (exception set). */
static Entry *index_find(IndexObject *self, PyObject *key) {
    Py_hash_t hash;
    if (key_hash(key, &hash) < 0) return NULL;
    Shard *sh = &self->shards[hash & (INDEX_SHARDS - 1)];
    Py_ssize_t at = find(sh, key, hash);
    return at >= 0 ? &sh->entries[SLOT_INDEX(sh->slots[at])] : NULL;
}

static int index_del(IndexObject *self, PyObject *key) {
    Py_hash_t hash;
    if (key_hash(key, &hash) < 0) return -1;
    Shard *sh = &self->shards[hash & (INDEX_SHARDS - 1)];
    Py_ssize_t at = find(sh, key, hash);
    if (at < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    Entry *e = &sh->entries[SLOT_INDEX(sh->slots[at])];
    Py_CLEAR(e->key);
    sh->slots[at] = DUMMY;
    sh->used--;
    self->used--;
    return 0;
}

static PyObject *Index_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Index() takes no arguments");
        return NULL;
    }
    return type->tp_alloc(type, 0); /* zeroed: every shard empty */
}

static void Index_dealloc(IndexObject *self) {
    for (int s = 0; s < INDEX_SHARDS; s++) {
        Shard *sh = &self->shards[s];
        for (Py_ssize_t k = 0; k < sh->n_entries; k++) Py_XDECREF(sh->entries[k].key);
        PyMem_Free(sh->entries);
        PyMem_Free(sh->slots);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t Index_len(IndexObject *self) { return self->used; }

static PyObject *Index_getitem(IndexObject *self, PyObject *key) {
    Entry *e = index_find(self, key);
    if (e == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return PyLong_FromLong(e->pid);
}

static int Index_ass_subscript(IndexObject *self, PyObject *key, PyObject *value) {
    if (value == NULL) return index_del(self, key);
    long pid = PyLong_AsLong(value);
    if (pid == -1 && PyErr_Occurred()) return -1;
    if (pid < 0 || pid > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a page id is 0..2**31-1");
        return -1;
    }
    return index_set(self, key, (int32_t)pid);
}

static int Index_contains(IndexObject *self, PyObject *key) {
    Entry *e = index_find(self, key);
    return e != NULL ? 1 : (PyErr_Occurred() ? -1 : 0);
}

static PyObject *Index_get(IndexObject *self, PyObject *key) {
    Entry *e = index_find(self, key);
    if (e == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    return PyLong_FromLong(e->pid);
}

static PyObject *Index_get_many(IndexObject *self, PyObject *keys) {
    Py_buffer view;
    const char *first;
    Py_ssize_t count, size;
    int raw = raw_keys(keys, &view, &first, &count, &size);
    if (raw < 0) return NULL;
    if (raw) {
        PyObject *out = PyList_New(count);
        for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
            int32_t pid = lookup_raw(self, first + i * size, size);
            PyObject *v = pid >= 0 ? PyLong_FromLong(pid) : Py_NewRef(Py_None);
            if (v == NULL) Py_CLEAR(out);
            else PyList_SET_ITEM(out, i, v);
        }
        PyBuffer_Release(&view);
        return out;
    }
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        Entry *e = index_find(self, items[i]);
        PyObject *v = e != NULL ? PyLong_FromLong(e->pid) : (PyErr_Occurred() ? NULL : Py_NewRef(Py_None));
        if (v == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, v);
    }
    Py_DECREF(fast);
    return out;
}

static PyObject *Index_update(IndexObject *self, PyObject *args) {
    PyObject *keys, *pids;
    if (!PyArg_ParseTuple(args, "OO", &keys, &pids)) return NULL;
    PyObject *k = PySequence_Fast(keys, "keys must be a sequence");
    if (k == NULL) return NULL;
    PyObject *p = PySequence_Fast(pids, "page ids must be a sequence");
    if (p == NULL) {
        Py_DECREF(k);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(k);
    if (PySequence_Fast_GET_SIZE(p) < n) n = PySequence_Fast_GET_SIZE(p); /* as map() over both: the shorter */
    for (Py_ssize_t i = 0; i < n; i++)
        if (Index_ass_subscript(self, PySequence_Fast_GET_ITEM(k, i), PySequence_Fast_GET_ITEM(p, i)) < 0) goto done;
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(k);
    Py_DECREF(p);
    return result;
}

static PyObject *Index_remove(IndexObject *self, PyObject *keys) {
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (index_del(self, PySequence_Fast_GET_ITEM(fast, i)) < 0) {
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

/* items (pairs) or values, shard by shard in insertion order: BlockIndex's order. */
static PyObject *index_list(IndexObject *self, int pairs) {
    PyObject *out = PyList_New(self->used);
    Py_ssize_t at = 0;
    for (int s = 0; out != NULL && s < INDEX_SHARDS; s++) {
        Shard *sh = &self->shards[s];
        for (Py_ssize_t k = 0; k < sh->n_entries; k++) {
            Entry *e = &sh->entries[k];
            if (e->key == NULL) continue;
            PyObject *v = pairs ? Py_BuildValue("(Ol)", e->key, (long)e->pid) : PyLong_FromLong(e->pid);
            if (v == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, at++, v);
        }
    }
    return out;
}

static PyObject *Index_items(IndexObject *self, PyObject *unused) { return index_list(self, 1); }
static PyObject *Index_values(IndexObject *self, PyObject *unused) { return index_list(self, 0); }

/* Whether page `pid` of the page table holds the key (its hash, in namespace ns_id): the next key of a prompt
 * saved in one batch mostly sits on the next page id, and checking that page costs less than a lookup. */
static int page_holds(PyObject *hashes, const int32_t *ns_of, Py_ssize_t pages, int32_t ns_id, Py_ssize_t pid,
                      const char *key, Py_ssize_t size) {
    if (pid >= pages || ns_of[pid] != ns_id) return 0;
    PyObject *held = PyList_GET_ITEM(hashes, pid);
    return PyBytes_Check(held) && PyBytes_GET_SIZE(held) == size && memcmp(PyBytes_AS_STRING(held), key, size) == 0;
}

static PyObject *Index_sealed_prefix(IndexObject *self, PyObject *args) {
    PyObject *keys, *state_obj, *hashes, *ns_obj;
    int ns_id;
    if (!PyArg_ParseTuple(args, "OOO!Oi", &keys, &state_obj, &PyList_Type, &hashes, &ns_obj, &ns_id)) return NULL;
    Arr state, ns_of;
    if (get(state_obj, &state, 1, "state") < 0) return NULL;
    if (get(ns_obj, &ns_of, 4, "ns_of") < 0) {
        PyBuffer_Release(&state.view);
        return NULL;
    }
    Py_ssize_t pages = state.n;
    if (ns_of.n < pages) pages = ns_of.n;
    if (PyList_GET_SIZE(hashes) < pages) pages = PyList_GET_SIZE(hashes);
    Py_buffer view;
    const char *first = NULL;
    Py_ssize_t count = 0, size = 0;
    PyObject *fast = NULL, *out = NULL;
    int raw = raw_keys(keys, &view, &first, &count, &size);
    if (raw < 0) goto done;
    if (!raw) {
        if ((fast = PySequence_Fast(keys, "keys must be a sequence")) == NULL) goto done;
        count = PySequence_Fast_GET_SIZE(fast);
    }
    if ((out = PyList_New(0)) == NULL) goto release;
    int32_t pid = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        const char *key;
        Py_ssize_t key_size;
        if (raw) {
            key = first + i * size, key_size = size;
        } else {
            PyObject *k = PySequence_Fast_GET_ITEM(fast, i);
            if (!PyBytes_Check(k)) {
                PyErr_Format(PyExc_TypeError, "a block hash must be bytes, not %.50s", Py_TYPE(k)->tp_name);
                Py_CLEAR(out);
                goto release;
            }
            key = PyBytes_AS_STRING(k), key_size = PyBytes_GET_SIZE(k);
        }
        if (pid >= 0 && page_holds(hashes, I32(ns_of), pages, ns_id, pid + 1, key, key_size))
            pid += 1;
        else
            pid = lookup_raw(self, key, key_size);
        if (pid < 0 || pid >= state.n || I8(state)[pid] != SEALED) break;
        PyObject *v = PyLong_FromLong(pid);
        if (v == NULL || PyList_Append(out, v) < 0) {
            Py_XDECREF(v);
            Py_CLEAR(out);
            goto release;
        }
        Py_DECREF(v);
    }
release:
    if (raw) PyBuffer_Release(&view);
done:
    Py_XDECREF(fast);
    PyBuffer_Release(&state.view);
    PyBuffer_Release(&ns_of.view);
    return out;
}

static PyMethodDef Index_methods[] = {
    {"sealed_prefix", (PyCFunction)Index_sealed_prefix, METH_VARARGS,
     "sealed_prefix(keys, state, block_hash, ns_of, ns_id) -> page ids of the leading keys whose pages are\n"
     "SEALED (the page after the last one found is checked first: block_hash and ns_of say whether it holds the\n"
     "next key in namespace ns_id)"},
    {"get", (PyCFunction)Index_get, METH_O, "get(key) -> page id or None"},
    {"get_many", (PyCFunction)Index_get_many, METH_O, "get_many(keys) -> [page id or None per key]"},
    {"update", (PyCFunction)Index_update, METH_VARARGS, "update(keys, pids): index[keys[k]] = pids[k]"},
    {"remove", (PyCFunction)Index_remove, METH_O, "remove(keys): deletes keys that are all present"},
    {"items", (PyCFunction)Index_items, METH_NOARGS, "[(key, page id)], in BlockIndex's order"},
    {"values", (PyCFunction)Index_values, METH_NOARGS, "[page id], in BlockIndex's order"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods Index_mapping = {
    .mp_length = (lenfunc)Index_len,
    .mp_subscript = (binaryfunc)Index_getitem,
    .mp_ass_subscript = (objobjargproc)Index_ass_subscript,
};

static PySequenceMethods Index_sequence = {.sq_contains = (objobjproc)Index_contains};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvseal.core._table.Index",
    .tp_doc = "A namespace's block hash -> page id map (kvseal.core.index.BlockIndex in C).",
    .tp_basicsize = sizeof(IndexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Index_new,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_as_mapping = &Index_mapping,
    .tp_as_sequence = &Index_sequence,
    .tp_methods = Index_methods,
};

static PyMethodDef methods[] = {
    {"pin", pin, METH_VARARGS, pin_doc},
    {"unpin", unpin, METH_VARARGS, unpin_doc},
    {"seal", seal, METH_VARARGS, seal_doc},
    {"forget", forget, METH_VARARGS, forget_doc},
    {"lru_victims", lru_victims, METH_VARARGS, lru_victims_doc},
    {"open", open_pages, METH_VARARGS, open_doc},
    {"gather", gather, METH_VARARGS, gather_doc},
    {"end_writes", end_writes, METH_VARARGS, end_writes_doc},
    {"set_hot", set_hot, METH_VARARGS, set_hot_doc},
    {"demote", demote, METH_VARARGS, demote_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvseal.core._table", "The page table's batch operations in C (see _table.c).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__table(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Index", (PyObject *)&IndexType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
