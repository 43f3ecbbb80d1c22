/* A pod worker's per-decision step in C: another worker's change records since this reader's cursor, copied
 * out of that worker's ring and applied to this reader's sums (tessera/routing/pod_replay.py says why;
 * tessera/routing/pod_view.py holds the Python twin, PodView._replay_py and PodView.set, which this must agree
 * with dict for dict).
 *
 * replay(ints, log_at, log_records, written_at, cursor, behind, row, entries, state) -> bool
 *
 *   ints         the writer's row: a buffer of 32-bit ints (the pod table's shared mapping)
 *   log_at       where the ring of records starts in the row, in ints
 *   log_records  the ring's records (four ints each)
 *   written_at   where the row's count of records written (modulo 2**32) is, in ints
 *   cursor       the records written as this reader last applied them (0 <= cursor < 2**32)
 *   behind       how many came since (0 < behind < log_records)
 *   row          the writer's row number (the stamps' key)
 *   entries      PodView's mirror of that row: key -> (requests, tokens, prefilled at)
 *   state        PodView._replay_state: (requests, tokens, stamps, by_key, heartbeat, requests_above,
 *                tokens_by_id, waiting), the dicts PodView.set changes
 *
 * The records are copied first, then the written count is read again: if the writer has come round to the
 * first of them meanwhile the copy may be torn, and it returns False having applied none (the caller copies
 * the row instead). Else it applies each in order, as PodView.set would, and returns True. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define STACK_RECORDS 64  /* a decision usually finds a handful; more go to the heap */

enum { REQUESTS, TOKENS, STAMPS, BY_KEY, HEARTBEAT, REQUESTS_ABOVE, TOKENS_BY_ID, WAITING, STATE_SIZE };

/* dict.pop(key, None), its result dropped: 0, or -1 with an exception set. */
static int discard(PyObject *dict, PyObject *key) {
    int has = PyDict_Contains(dict, key);
    if (has <= 0) return has;
    return PyDict_DelItem(dict, key);
}

/* dict[key] = value as a new int: 0, or -1 with an exception set. */
static int set_long(PyObject *dict, PyObject *key, long long value) {
    PyObject *number = PyLong_FromLongLong(value);
    if (number == NULL) return -1;
    int failed = PyDict_SetItem(dict, key, number);
    Py_DECREF(number);
    return failed;
}

/* dict.get(key, 0) as a C integer: 0 if absent, -1 with an exception set on error (checked by PyErr_Occurred). */
static long long get_long(PyObject *dict, PyObject *key) {
    PyObject *value = PyDict_GetItemWithError(dict, key);
    if (value == NULL) return 0;
    return PyLong_AsLongLong(value);
}

/* One record, as PodView.set applies it: 0, or -1 with an exception set. */
static int apply_record(PyObject *const *state, PyObject *entries, PyObject *row, const int32_t *record) {
    long long requests = record[1], tokens = record[2], at = record[3];
    int nonzero = requests || tokens || at;
    PyObject *key = PyLong_FromLong(record[0]);
    if (key == NULL) return -1;
    int result = -1;
    long long old_requests = 0, old_tokens = 0, old_at = 0;

    PyObject *old = PyDict_GetItemWithError(entries, key);
    if (old == NULL) {
        if (PyErr_Occurred()) goto done;
        if (!nonzero) {
            result = 0;
            goto done;
        }
    } else {
        if (!PyTuple_Check(old) || PyTuple_GET_SIZE(old) != 3) {
            PyErr_SetString(PyExc_TypeError, "a row's entry is not a (requests, tokens, at) tuple");
            goto done;
        }
        old_requests = PyLong_AsLongLong(PyTuple_GET_ITEM(old, 0));
        old_tokens = PyLong_AsLongLong(PyTuple_GET_ITEM(old, 1));
        old_at = PyLong_AsLongLong(PyTuple_GET_ITEM(old, 2));
        if (PyErr_Occurred()) goto done;
    }
    if (nonzero) {
        PyObject *entry = Py_BuildValue("(LLL)", requests, tokens, at);
        if (entry == NULL) goto done;
        int failed = PyDict_SetItem(entries, key, entry);
        Py_DECREF(entry);
        if (failed) goto done;
    } else if (PyDict_DelItem(entries, key)) {
        goto done;
    }

    PyObject *engine_id = PyDict_GetItemWithError(state[BY_KEY], key);  /* borrowed; NULL: not in the registry */
    if (engine_id == NULL && PyErr_Occurred()) goto done;
    Py_XINCREF(engine_id);  /* held across the calls below, which may run a key's __eq__ */

    /* The prefill stamps: this row's for the key while it has tokens to prefill and a stamp. */
    if (tokens > 0 && at) {
        PyObject *stamps = PyDict_GetItemWithError(state[STAMPS], key);
        if (stamps == NULL) {
            if (PyErr_Occurred()) goto release;
            stamps = PyDict_New();
            if (stamps == NULL) goto release;
            int failed = PyDict_SetItem(state[STAMPS], key, stamps)
                         || (engine_id != NULL && PyDict_SetItem(state[WAITING], engine_id, stamps));
            Py_DECREF(stamps);  /* the stamps dict holds it now */
            if (failed) goto release;
        }
        if (set_long(stamps, row, at)) goto release;
    } else if (old_tokens > 0 && old_at) {
        PyObject *stamps = PyDict_GetItemWithError(state[STAMPS], key);
        if (stamps == NULL) {
            if (PyErr_Occurred()) goto release;
        } else {
            if (discard(stamps, row)) goto release;
            if (PyDict_GET_SIZE(stamps) == 0) {
                if (PyDict_DelItem(state[STAMPS], key)) goto release;
                if (engine_id != NULL && discard(state[WAITING], engine_id)) goto release;
            }
        }
    }

    /* The requests: their sum by key, and by id where above the engine's heartbeat load. */
    long long delta = (requests > 0 ? requests : 0) - (old_requests > 0 ? old_requests : 0);
    if (delta) {
        long long total = get_long(state[REQUESTS], key) + delta;
        if (PyErr_Occurred()) goto release;
        if (total > 0) {
            if (set_long(state[REQUESTS], key, total)) goto release;
            if (engine_id != NULL) {
                PyObject *heartbeat = PyDict_GetItemWithError(state[HEARTBEAT], engine_id);
                if (heartbeat == NULL) {
                    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, engine_id);
                    goto release;
                }
                long long load = PyLong_AsLongLong(heartbeat);
                if (PyErr_Occurred()) goto release;
                if (total > load ? set_long(state[REQUESTS_ABOVE], engine_id, total)
                                 : discard(state[REQUESTS_ABOVE], engine_id)) goto release;
            }
        } else {
            if (discard(state[REQUESTS], key)) goto release;
            if (engine_id != NULL && discard(state[REQUESTS_ABOVE], engine_id)) goto release;
        }
    }

    /* The prompt tokens awaiting their first token: their sum by key, and by id. */
    delta = (tokens > 0 ? tokens : 0) - (old_tokens > 0 ? old_tokens : 0);
    if (delta) {
        long long total = get_long(state[TOKENS], key) + delta;
        if (PyErr_Occurred()) goto release;
        if (total > 0) {
            if (set_long(state[TOKENS], key, total)) goto release;
            if (engine_id != NULL && set_long(state[TOKENS_BY_ID], engine_id, total)) goto release;
        } else {
            if (discard(state[TOKENS], key)) goto release;
            if (engine_id != NULL && discard(state[TOKENS_BY_ID], engine_id)) goto release;
        }
    }
    result = 0;
release:
    Py_XDECREF(engine_id);
done:
    Py_DECREF(key);
    return result;
}

static PyObject *replay(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "replay(ints, log_at, log_records, written_at, cursor, behind, row, entries, state)");
        return NULL;
    }
    Py_ssize_t log_at = PyLong_AsSsize_t(args[1]), log_records = PyLong_AsSsize_t(args[2]);
    Py_ssize_t written_at = PyLong_AsSsize_t(args[3]), behind = PyLong_AsSsize_t(args[5]);
    unsigned long long cursor = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    PyObject *row = args[6], *entries = args[7], *state_tuple = args[8];
    if (!PyDict_Check(entries) || !PyTuple_Check(state_tuple) || PyTuple_GET_SIZE(state_tuple) != STATE_SIZE) {
        PyErr_SetString(PyExc_TypeError, "entries must be a dict and state PodView's tuple of eight dicts");
        return NULL;
    }
    PyObject *const *state = &PyTuple_GET_ITEM(state_tuple, 0);
    for (int i = 0; i < STATE_SIZE; i++) {
        if (!PyDict_Check(state[i])) {
            PyErr_SetString(PyExc_TypeError, "state must hold eight dicts");
            return NULL;
        }
    }
    if (log_records <= 0 || behind <= 0 || behind >= log_records || cursor > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "need 0 < behind < log_records and 0 <= cursor < 2**32");
        return NULL;
    }

    Py_buffer buffer;
    if (PyObject_GetBuffer(args[0], &buffer, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t num_ints = buffer.len / (Py_ssize_t)sizeof(int32_t);
    if (buffer.itemsize != (Py_ssize_t)sizeof(int32_t) || log_at < 0 || written_at < 0 || written_at >= num_ints
            || log_at + 4 * log_records > num_ints) {
        PyBuffer_Release(&buffer);
        PyErr_SetString(PyExc_ValueError, "the row is not a buffer of 32-bit ints holding this ring");
        return NULL;
    }
    /* Shared with the writer's process: each int is read once, as it stands. */
    const volatile int32_t *ints = (const volatile int32_t *)buffer.buf;

    int32_t on_stack[4 * STACK_RECORDS];
    int32_t *records = behind <= STACK_RECORDS ? on_stack : PyMem_Malloc(sizeof(int32_t) * 4 * (size_t)behind);
    if (records == NULL) {
        PyBuffer_Release(&buffer);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < behind; i++) {
        Py_ssize_t at = log_at + 4 * (Py_ssize_t)((cursor + (unsigned long long)i) % (unsigned long long)log_records);
        for (int j = 0; j < 4; j++) records[4 * i + j] = ints[at + j];
    }
    /* Whole if the writer has not come round to the first of them since the caller read the count. */
    uint32_t written_now = (uint32_t)ints[written_at];
    int whole = (uint32_t)(written_now - (uint32_t)cursor) < (uint32_t)log_records;
    PyBuffer_Release(&buffer);

    int failed = 0;
    if (whole) {
        for (Py_ssize_t i = 0; i < behind && !failed; i++) failed = apply_record(state, entries, row, records + 4 * i);
    }
    if (records != on_stack) PyMem_Free(records);
    if (failed) return NULL;
    return PyBool_FromLong(whole);
}

static PyMethodDef methods[] = {
    {"replay", (PyCFunction)(void (*)(void))replay, METH_FASTCALL,
     "replay(ints, log_at, log_records, written_at, cursor, behind, row, entries, state) -> bool: "
     "see tessera/routing/_pod_replay.c and pod_replay.py."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tessera.routing._pod_replay",
    "A pod worker's per-decision replay of another worker's change records, in C (tessera/routing/pod_replay.py).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__pod_replay(void) { return PyModule_Create(&module); }
