/* The local prefix index's lookup in C: how many leading blocks of a prompt's chain each live engine holds
 * (tessera/routing/local_index.py, LocalPrefixIndex.longest_prefixes, holds the Python twin and says why the
 * search is exact; this must agree with it dict for dict).
 *
 * longest_prefixes(holders, chain, alive, names) -> dict[str, int]
 *
 *   holders  the index's table: block hash -> int bitmask of the slots holding it
 *   chain    the prompt's block hashes, in order (a list or tuple of ints)
 *   alive    the slots to answer for (an int bitmask; the caller has taken the retired slots out)
 *   names    slot -> engine id (a list; None for a slot no engine holds)
 *
 * Why C: a lookup is a handful of dict probes and big-int ANDs; in CPython its bytecode is most of its time
 * (p50 ~8 us at 1,000 engines and a million blocks on a 2-vCPU VM), and on such a VM, which pauses a busy
 * thread a few hundred times a second for ~20 us, a p99 is a pause's once the p50 nears 20 us. The masks stay
 * Python ints (the index shares them between blocks), so the ANDs go through the number protocol.
 *
 * Nothing here calls back into Python code (int and str operations only), so the table cannot change during a
 * lookup and the references borrowed from it stay valid. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* (mask & held) == held, where mask may be NULL (the block is not in the table): 1, 0, or -1 with an
 * exception set. The same object is the common case: a block held by one engine points at its slot's bit. */
static int holds_all(PyObject *mask, PyObject *held) {
    if (mask == NULL) return 0;
    if (mask == held) return 1;
    PyObject *both = PyNumber_And(mask, held);
    if (both == NULL) return -1;
    int equal = PyObject_RichCompareBool(both, held, Py_EQ);
    Py_DECREF(both);
    return equal;
}

/* out[names[slot]] = depth for every slot set in mask: 0, or -1 with an exception set. */
static int record(PyObject *out, PyObject *names, PyObject *mask, Py_ssize_t depth) {
    int nonzero = PyObject_IsTrue(mask);
    if (nonzero <= 0) return nonzero;
    PyObject *value = PyLong_FromSsize_t(depth);
    if (value == NULL) return -1;
    PyObject *rest = mask;
    Py_INCREF(rest);
    int result = -1;
    while (1) {
        nonzero = PyObject_IsTrue(rest);
        if (nonzero < 0) goto done;
        if (!nonzero) break;
        PyObject *negative = PyNumber_Negative(rest);
        if (negative == NULL) goto done;
        PyObject *low = PyNumber_And(rest, negative);  /* the lowest set bit */
        Py_DECREF(negative);
        if (low == NULL) goto done;
        size_t bits = _PyLong_NumBits(low);
        PyObject *next = PyNumber_Xor(rest, low);
        Py_DECREF(low);
        if (bits == (size_t)-1 || next == NULL) {
            Py_XDECREF(next);
            goto done;
        }
        Py_SETREF(rest, next);
        Py_ssize_t slot = (Py_ssize_t)bits - 1;
        PyObject *name = slot < PyList_GET_SIZE(names) ? PyList_GET_ITEM(names, slot) : Py_None;
        if (name == Py_None) {
            PyErr_SetString(PyExc_AssertionError, "a live mask names a slot no engine holds");
            goto done;
        }
        if (PyDict_SetItem(out, name, value) < 0) goto done;
    }
    result = 0;
done:
    Py_DECREF(rest);
    Py_DECREF(value);
    return result;
}

/* holders.get(chain[i]) as a borrowed reference; NULL when absent (check PyErr_Occurred). */
static PyObject *probe_at(PyObject *holders, PyObject *const *blocks, Py_ssize_t i) {
    return PyDict_GetItemWithError(holders, blocks[i]);
}

static PyObject *longest_prefixes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "longest_prefixes(holders, chain, alive, names) takes 4 arguments");
        return NULL;
    }
    PyObject *holders = args[0], *alive = args[2], *names = args[3];
    if (!PyDict_Check(holders) || !PyList_Check(names) || !PyLong_Check(alive)) {
        PyErr_SetString(PyExc_TypeError, "longest_prefixes: holders must be a dict, alive an int, names a list");
        return NULL;
    }
    PyObject *sequence = PySequence_Fast(args[1], "longest_prefixes: chain must be a sequence of ints");
    if (sequence == NULL) return NULL;
    PyObject *out = PyDict_New();
    PyObject *held = NULL;
    if (out == NULL) goto fail;
    Py_ssize_t num = PySequence_Fast_GET_SIZE(sequence);
    PyObject *const *blocks = PySequence_Fast_ITEMS(sequence);
    int any = PyObject_IsTrue(alive);
    if (any < 0) goto fail;
    if (num == 0 || !any) goto finish;
    PyObject *first = probe_at(holders, blocks, 0);
    if (first == NULL) {
        if (PyErr_Occurred()) goto fail;
        goto finish;
    }
    held = PyNumber_And(first, alive);
    if (held == NULL) goto fail;
    /* Invariant: every slot in `held` holds blocks 0..held_to (see the Python twin). */
    Py_ssize_t held_to = 0;
    while (1) {
        int nonzero = PyObject_IsTrue(held);
        if (nonzero < 0) goto fail;
        if (!nonzero) break;
        /* Gallop: double the stride while every holder still holds the probed block. */
        Py_ssize_t stride = 1, probe;
        PyObject *mask;
        while (1) {
            probe = held_to + stride;
            if (probe >= num) {
                probe = num - 1;
                if (probe == held_to) {  /* held to the chain's end */
                    if (record(out, names, held, num) < 0) goto fail;
                    goto finish;
                }
            }
            mask = probe_at(holders, blocks, probe);
            if (mask == NULL && PyErr_Occurred()) goto fail;
            int all = holds_all(mask, held);
            if (all < 0) goto fail;
            if (!all) break;
            held_to = probe;
            stride <<= 1;
        }
        /* Bisect (held_to, probe): the first block not every holder holds. */
        while (probe - held_to > 1) {
            Py_ssize_t middle = (held_to + probe) >> 1;
            PyObject *middle_mask = probe_at(holders, blocks, middle);
            if (middle_mask == NULL && PyErr_Occurred()) goto fail;
            int all = holds_all(middle_mask, held);
            if (all < 0) goto fail;
            if (all) {
                held_to = middle;
            } else {
                probe = middle;
                mask = middle_mask;
            }
        }
        PyObject *staying = mask != NULL ? PyNumber_And(mask, held) : PyLong_FromLong(0);
        if (staying == NULL) goto fail;
        PyObject *kept = PyNumber_Invert(staying);
        PyObject *leaving = kept != NULL ? PyNumber_And(held, kept) : NULL;
        Py_XDECREF(kept);
        int recorded = leaving != NULL ? record(out, names, leaving, probe) : -1;
        Py_XDECREF(leaving);
        Py_SETREF(held, staying);
        if (recorded < 0) goto fail;
        held_to = probe;
    }
finish:
    Py_XDECREF(held);
    Py_DECREF(sequence);
    return out;
fail:
    Py_XDECREF(held);
    Py_XDECREF(out);
    Py_DECREF(sequence);
    return NULL;
}

static PyMethodDef methods[] = {
    {"longest_prefixes", (PyCFunction)(void (*)(void))longest_prefixes, METH_FASTCALL,
     "longest_prefixes(holders, chain, alive, names) -> dict: engine id -> leading blocks of chain it holds."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain_lookup", NULL, 0, methods};

PyMODINIT_FUNC PyInit__chain_lookup(void) { return PyModule_Create(&module); }
