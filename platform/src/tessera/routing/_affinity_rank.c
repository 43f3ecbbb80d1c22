/* prefix_affinity's usual decision in C (tessera/routing/policies.py holds the policy, its Python twin, and says
 * why each rule is there; this must give the same ranking, reason and placement for every decision it
 * takes, and hand every other decision back to Python).
 *
 * ring(points, walks, positions) -> capsule
 *   A consistent-hash ring as arrays (built once per set of engine ids, as policies._Ring is):
 *   points    the ring's points, ascending (a list of 64-bit ints)
 *   walks     per ring position, the first `depth` distinct engines clockwise (a list of equal-length tuples)
 *   positions per engine, its ring positions ascending (a list of lists)
 *
 * fleet(ids, index, loads, waiting, block_sizes, pressure, pending, ring, constants) -> capsule
 *   A registry read's engines as arrays (built once a read, off the request path, by policies._Fleet.of):
 *   ids       engine ids (a tuple; index i is engine i)
 *   index     engine id -> i (a dict)
 *   loads, waiting, block_sizes, pending   per engine: heartbeat load, waiting requests, block size, heartbeat
 *             prompt tokens awaiting a first token (lists of ints)
 *   pressure  per engine: under KV pressure (a list of bools)
 *   ring      ring()'s capsule for these engines
 *   constants (max_ranked, bound_factor, tokens_per_running, tokens_per_waiting, wait_step_tokens,
 *             move_margin_tokens, pending_prefill_step)
 *
 * configure(route_decision, pod_waits)
 *   The types the step reads and makes: snapshot.RouteDecision, pod_view.PodWaits (once, at import).
 *
 * rank(fleet, snapshot, num_prompt_tokens, key, state)
 *   snapshot  the policy's RouteSnapshot (engines, cached_prefix_blocks, local_in_flight,
 *             local_pending_prefill_tokens, prefill_wait_s, prefill_fit): the mappings dicts (an empty mapping
 *             of another type reads as empty), the waits a dict or a PodWaits (its stamps read whole)
 *   key       the prefix's key (its first block hash, or the session's salt: an int)
 *   state     the key's placement: None (never routed), "" (settled), or the engine id it was sent to
 * -> None: not the usual case (fewer than max_ranked engines open in the ring's short walk, a request whose
 *    holders all rank after an uncredited engine, a mapping of another kind): the Python policy decides. Else
 *    (RouteDecision, place): the decision, its reason as the Python policy words it, and what the caller records
 *    as the key's placement (None: nothing).
 *
 * Why C: on a 2-vCPU VM the policy's bytecode was ~15 us of a ~30 us decision, and a p99 there is a p50 plus the
 * VM's pauses (docs/routing.md). Nothing here calls Python code: dict reads with str keys, int and float
 * conversions. A fleet's scratch arrays are reset before each call returns (the GIL is held throughout). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define GOLDEN_64 0x9E3779B97F4A7C15ULL
#define HALF_32 2147483648LL
#define WRAP_32 4294967296LL
/* How a decision came about (policies.PLAIN, MOVED, PENDING, PLACED_BY_LOAD). */
#define OUTCOME_PLAIN 0
#define OUTCOME_MOVED 1
#define OUTCOME_PENDING 2
#define OUTCOME_PLACED_BY_LOAD 3

/* configure()'s types. */
static PyObject *RouteDecisionType = NULL, *PodWaitsType = NULL;
static PyObject *str_waiting = NULL, *str_now = NULL;

typedef struct {
    Py_ssize_t n, num_points, depth;
    uint64_t *points;
    int32_t *walks;     /* num_points x depth */
    int32_t *pos_start; /* n + 1 offsets into pos */
    int32_t *pos;
} Ring;

typedef struct {
    Py_ssize_t n;
    long long sum_loads;
    PyObject *ids;   /* tuple of str */
    PyObject *index; /* dict str -> int */
    PyObject *ring_capsule;
    const Ring *ring;
    long long *loads, *waiting, *block_size, *pending;
    char *pressure;
    /* constants */
    Py_ssize_t max_ranked;
    double bound_factor;
    long long per_running, per_waiting, wait_step_tokens, move_margin_tokens, pending_step;
    /* scratch, reset after each call */
    long long *eff;      /* effective load: max(heartbeat, the pod's) */
    long long *cached;   /* credited tokens, -1 absent */
    int32_t *touched;    /* engines whose eff or cached was set */
    int32_t *order;      /* cached engines, in the dict's order */
    int32_t *ranked;     /* up to n + max_ranked */
} Fleet;

static void ring_free(PyObject *capsule) {
    Ring *r = (Ring *)PyCapsule_GetPointer(capsule, "tessera.affinity_ring");
    if (r == NULL) return;
    PyMem_Free(r->points); PyMem_Free(r->walks); PyMem_Free(r->pos_start); PyMem_Free(r->pos);
    PyMem_Free(r);
}

static void fleet_free(PyObject *capsule) {
    Fleet *f = (Fleet *)PyCapsule_GetPointer(capsule, "tessera.affinity_fleet");
    if (f == NULL) return;
    Py_XDECREF(f->ids);
    Py_XDECREF(f->index);
    Py_XDECREF(f->ring_capsule);
    PyMem_Free(f->loads); PyMem_Free(f->waiting); PyMem_Free(f->block_size); PyMem_Free(f->pending);
    PyMem_Free(f->pressure); PyMem_Free(f->eff); PyMem_Free(f->cached); PyMem_Free(f->touched);
    PyMem_Free(f->order); PyMem_Free(f->ranked);
    PyMem_Free(f);
}

static int fill_ll(PyObject *list, long long *out, Py_ssize_t n, const char *what) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != n) {
        PyErr_Format(PyExc_TypeError, "fleet: %s must be a list of one int an engine", what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
        if (v == -1 && PyErr_Occurred()) return -1;
        out[i] = v;
    }
    return 0;
}

static PyObject *make_ring(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *points, *walks, *positions;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &points, &PyList_Type, &walks, &PyList_Type, &positions))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(positions), num_points = PyList_GET_SIZE(points);
    if (PyList_GET_SIZE(walks) != num_points || n == 0 || num_points == 0) {
        PyErr_SetString(PyExc_TypeError, "ring: points, walks and positions must be lists that agree");
        return NULL;
    }
    Ring *r = PyMem_Calloc(1, sizeof(Ring));
    if (r == NULL) return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(r, "tessera.affinity_ring", ring_free);
    if (capsule == NULL) {
        PyMem_Free(r);
        return NULL;
    }
    r->n = n;
    r->num_points = num_points;
    r->depth = PyObject_Length(PyList_GET_ITEM(walks, 0));
    if (r->depth <= 0 || r->depth > n) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "ring: a walk must name 1 to n engines");
        goto fail;
    }
    r->points = PyMem_Calloc(num_points, sizeof(uint64_t));
    r->walks = PyMem_Calloc(num_points * r->depth, sizeof(int32_t));
    r->pos_start = PyMem_Calloc(n + 1, sizeof(int32_t));
    r->pos = PyMem_Calloc(num_points, sizeof(int32_t));
    if (!r->points || !r->walks || !r->pos_start || !r->pos) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t p = 0; p < num_points; p++) {
        r->points[p] = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(points, p));
        if (PyErr_Occurred()) goto fail;
        PyObject *walk = PyList_GET_ITEM(walks, p);
        if (!PyTuple_Check(walk) || PyTuple_GET_SIZE(walk) != r->depth) {
            PyErr_SetString(PyExc_TypeError, "ring: every walk must be a tuple of the same length");
            goto fail;
        }
        for (Py_ssize_t k = 0; k < r->depth; k++) {
            long engine = PyLong_AsLong(PyTuple_GET_ITEM(walk, k));
            if (engine == -1 && PyErr_Occurred()) goto fail;
            if (engine < 0 || engine >= n) {
                PyErr_SetString(PyExc_ValueError, "ring: a walk names an engine the ring lacks");
                goto fail;
            }
            r->walks[p * r->depth + k] = (int32_t)engine;
        }
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *places = PyList_GET_ITEM(positions, i);
        if (!PyList_Check(places) || PyList_GET_SIZE(places) == 0 || at + PyList_GET_SIZE(places) > num_points) {
            PyErr_SetString(PyExc_TypeError, "ring: every engine needs its ring positions");
            goto fail;
        }
        r->pos_start[i] = (int32_t)at;
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(places); k++) {
            long place = PyLong_AsLong(PyList_GET_ITEM(places, k));
            if (place == -1 && PyErr_Occurred()) goto fail;
            if (place < 0 || place >= num_points) {
                PyErr_SetString(PyExc_ValueError, "ring: a position past the ring's points");
                goto fail;
            }
            r->pos[at++] = (int32_t)place;
        }
    }
    r->pos_start[n] = (int32_t)at;
    return capsule;
fail:
    Py_DECREF(capsule);
    return NULL;
}

static PyObject *make_fleet(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ids, *index, *loads, *waiting, *sizes, *pressure, *pending, *ring;
    Py_ssize_t max_ranked;
    double bound_factor;
    long long per_running, per_waiting, wait_step, move_margin, pending_step;
    if (!PyArg_ParseTuple(args, "O!O!OOOO!OO(ndLLLLL)", &PyTuple_Type, &ids, &PyDict_Type, &index, &loads,
                          &waiting, &sizes, &PyList_Type, &pressure, &pending, &ring, &max_ranked, &bound_factor,
                          &per_running, &per_waiting, &wait_step, &move_margin, &pending_step))
        return NULL;
    Ring *r = (Ring *)PyCapsule_GetPointer(ring, "tessera.affinity_ring");
    if (r == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(ids);
    if (PyList_GET_SIZE(pressure) != n || r->n != n || max_ranked < 2) {
        PyErr_SetString(PyExc_TypeError, "fleet: the engines, their pressure flags and the ring must agree");
        return NULL;
    }
    Fleet *f = PyMem_Calloc(1, sizeof(Fleet));
    if (f == NULL) return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(f, "tessera.affinity_fleet", fleet_free);
    if (capsule == NULL) {
        PyMem_Free(f);
        return NULL;
    }
    f->n = n;
    f->ids = Py_NewRef(ids);
    f->index = Py_NewRef(index);
    f->ring_capsule = Py_NewRef(ring);
    f->ring = r;
    f->max_ranked = max_ranked;
    f->bound_factor = bound_factor;
    f->per_running = per_running; f->per_waiting = per_waiting; f->wait_step_tokens = wait_step;
    f->move_margin_tokens = move_margin; f->pending_step = pending_step;
    f->loads = PyMem_Calloc(n, sizeof(long long));
    f->waiting = PyMem_Calloc(n, sizeof(long long));
    f->block_size = PyMem_Calloc(n, sizeof(long long));
    f->pending = PyMem_Calloc(n, sizeof(long long));
    f->pressure = PyMem_Calloc(n, 1);
    f->eff = PyMem_Calloc(n, sizeof(long long));
    f->cached = PyMem_Calloc(n, sizeof(long long));
    f->touched = PyMem_Calloc(2 * n + 1, sizeof(int32_t));
    f->order = PyMem_Calloc(n + 1, sizeof(int32_t));
    f->ranked = PyMem_Calloc(n + max_ranked + 1, sizeof(int32_t));
    if (!f->loads || !f->waiting || !f->block_size || !f->pending || !f->pressure || !f->eff || !f->cached ||
        !f->touched || !f->order || !f->ranked) {
        PyErr_NoMemory();
        goto fail;
    }
    if (fill_ll(loads, f->loads, n, "loads") < 0 || fill_ll(waiting, f->waiting, n, "waiting") < 0 ||
        fill_ll(sizes, f->block_size, n, "block_sizes") < 0 || fill_ll(pending, f->pending, n, "pending") < 0)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        f->sum_loads += f->loads[i];
        int flag = PyObject_IsTrue(PyList_GET_ITEM(pressure, i));
        if (flag < 0) goto fail;
        f->pressure[i] = (char)flag;
        f->eff[i] = f->loads[i];
        f->cached[i] = -1;
    }
    return capsule;
fail:
    Py_DECREF(capsule);
    return NULL;
}

/* _Ring.start: the first point at or after the key's ring key (0 past the end). */
static Py_ssize_t ring_start(const Ring *r, uint64_t key) {
    uint64_t ring_key = key * GOLDEN_64;
    Py_ssize_t lo = 0, hi = r->num_points;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (r->points[mid] < ring_key) lo = mid + 1;
        else hi = mid;
    }
    return lo == r->num_points ? 0 : lo;
}

/* _Ring.offset: how far clockwise from `start` the engine's first point lies. */
static Py_ssize_t ring_offset(const Ring *r, Py_ssize_t start, int32_t engine) {
    const int32_t *places = r->pos + r->pos_start[engine];
    Py_ssize_t count = r->pos_start[engine + 1] - r->pos_start[engine];
    Py_ssize_t lo = 0, hi = count;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (places[mid] < start) lo = mid + 1;
        else hi = mid;
    }
    return lo < count ? places[lo] - start : places[0] + r->num_points - start;
}

typedef struct {
    const Fleet *f;
    double bound;
    PyObject *waiting, *waits, *pending;
    long long now;
} Call;

static int is_closed(const Call *c, int32_t i) { return c->f->pressure[i] || (double)c->f->eff[i] >= c->bound; }

static long long cached_of(const Fleet *f, int32_t i) { return f->cached[i] < 0 ? 0 : f->cached[i]; }

/* waits.get(ids[i], 0.0) as pod_view.PodWaits (or a plain dict) answers it: 0 with *out, -1 with an exception. */
static int wait_of(const Call *c, int32_t i, double *out) {
    PyObject *engine_id = PyTuple_GET_ITEM(c->f->ids, i);
    *out = 0.0;
    if (c->waiting != Py_None) {
        PyObject *stamps = PyDict_GetItemWithError(c->waiting, engine_id);
        if (stamps == NULL) return PyErr_Occurred() ? -1 : 0;
        if (!PyDict_Check(stamps)) {
            PyErr_SetString(PyExc_TypeError, "rank: a prefill wait's stamps must be a dict");
            return -1;
        }
        Py_ssize_t pos = 0;
        PyObject *row, *stamp;
        long long wait_us = 0;
        while (PyDict_Next(stamps, &pos, &row, &stamp)) {
            long long at = PyLong_AsLongLong(stamp);
            if (at == -1 && PyErr_Occurred()) return -1;
            long long shifted = (at - c->now + HALF_32) % WRAP_32;
            if (shifted < 0) shifted += WRAP_32;
            long long left = shifted - HALF_32;
            if (left > 0) wait_us += left;
        }
        if (wait_us > 0) *out = (double)wait_us / 1e6;
        return 0;
    }
    PyObject *value = PyDict_GetItemWithError(c->waits, engine_id);
    if (value == NULL) return PyErr_Occurred() ? -1 : 0;
    *out = PyFloat_AsDouble(value);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

static long long floor_div(long long a, long long b) {
    long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/* policies._to_front over ranked[0..*len). */
static void to_front(const Fleet *f, int32_t *ranked, Py_ssize_t *len, int32_t i) {
    if (*len && ranked[0] == i) return;
    Py_ssize_t at = -1;
    for (Py_ssize_t k = 0; k < *len; k++)
        if (ranked[k] == i) { at = k; break; }
    if (at >= 0) {
        memmove(ranked + 1, ranked, at * sizeof(int32_t));
    } else {
        if (*len > f->max_ranked - 1) *len = f->max_ranked - 1;
        memmove(ranked + 1, ranked, *len * sizeof(int32_t));
        (*len)++;
    }
    ranked[0] = i;
}

/* policies._least_backlogged: the engine, -1 for None, -2 with an exception. */
static int32_t least_backlogged(const Call *c, const int32_t *ranked, Py_ssize_t len, int has_fit,
                                double s_per_token) {
    const Fleet *f = c->f;
    double step_s = has_fit ? s_per_token * (double)f->wait_step_tokens : 0.0;
    int32_t best = -1;
    long long best_backlog = 0, best_requests = 0;
    Py_ssize_t num_open = 0;
    int any_pending = PyDict_GET_SIZE(c->pending) > 0;
    for (Py_ssize_t k = 0; k < len; k++) {
        int32_t i = ranked[k];
        if (is_closed(c, i)) continue;
        num_open++;
        if (best >= 0 && best_backlog == 0 && best_requests == 0) break;
        long long requests = f->eff[i] + f->waiting[i];
        if (best >= 0 && best_backlog == 0 && requests >= best_requests) continue;
        long long backlog;
        if (step_s > 0) {
            double wait;
            if (wait_of(c, i, &wait) < 0) return -2;
            backlog = (long long)(wait / step_s);
        } else {
            long long tokens = f->pending[i];
            if (any_pending) {
                PyObject *value = PyDict_GetItemWithError(c->pending, PyTuple_GET_ITEM(f->ids, i));
                if (value == NULL && PyErr_Occurred()) return -2;
                if (value != NULL) {
                    long long local = PyLong_AsLongLong(value);
                    if (local == -1 && PyErr_Occurred()) return -2;
                    if (local > tokens) tokens = local;
                }
            }
            backlog = floor_div(tokens, f->pending_step);
        }
        if (best < 0 || backlog < best_backlog || (backlog == best_backlog && requests < best_requests)) {
            best = i;
            best_backlog = backlog;
            best_requests = requests;
        }
    }
    return num_open >= 2 ? best : -1;
}

/* policies._sooner_elsewhere: the engine, -1 for None, -2 with an exception; *holder_wait its holder's wait. */
static int32_t sooner_elsewhere(const Call *c, const int32_t *ranked, Py_ssize_t len, double per_token,
                                double *holder_wait) {
    const Fleet *f = c->f;
    int32_t holder = ranked[0];
    if (wait_of(c, holder, holder_wait) < 0) return -2;
    if (*holder_wait <= 0) return -1;
    int32_t best = -1;
    double best_cost = *holder_wait - per_token * (double)(cached_of(f, holder) + f->move_margin_tokens);
    for (Py_ssize_t k = 1; k < len; k++) {
        int32_t i = ranked[k];
        double floor = -per_token * (double)cached_of(f, i);
        if (floor >= best_cost || is_closed(c, i)) continue;
        double wait;
        if (wait_of(c, i, &wait) < 0) return -2;
        double cost = wait + floor;
        if (cost < best_cost) {
            best = i;
            best_cost = cost;
        }
    }
    return best;
}

/* The decision's reason, worded as policies._reason words it (the tests hold the two to the same strings). */
static PyObject *reason(int outcome, long long top_cached, long long top_load, double moved_wait_s) {
    Py_ssize_t cached = (Py_ssize_t)top_cached, load = (Py_ssize_t)top_load;
    if (outcome == OUTCOME_MOVED) {
        char *ms = PyOS_double_to_string(moved_wait_s * 1e3, 'f', 1, 0, NULL);
        if (ms == NULL) return NULL;
        PyObject *text = PyUnicode_FromFormat(
            "prefix_affinity sooner elsewhere: holder's prefill wait %s ms, cached_tokens=%zd load=%zd", ms, cached,
            load);
        PyMem_Free(ms);
        return text;
    }
    if (outcome == OUTCOME_PENDING)
        return PyUnicode_FromFormat("prefix_affinity miss: pending where it was sent, load=%zd", load);
    if (outcome == OUTCOME_PLACED_BY_LOAD)
        return PyUnicode_FromFormat("prefix_affinity miss: new prefix, shortest backlog of its homes load=%zd", load);
    if (top_cached > 0) return PyUnicode_FromFormat("prefix_affinity cached_tokens=%zd load=%zd", cached, load);
    return PyUnicode_FromFormat("prefix_affinity miss: home load=%zd", load);
}

/* (RouteDecision(ranked ids, reason, the first engine's credited tokens), place): place NULL for "" (settled). */
static PyObject *decision(const Fleet *f, const int32_t *ranked, Py_ssize_t len, int outcome, double moved_wait_s,
                          PyObject *place) {
    long long top_cached = cached_of(f, ranked[0]);
    PyObject *ids = PyTuple_New(len);
    if (ids == NULL) return NULL;
    for (Py_ssize_t k = 0; k < len; k++) PyTuple_SET_ITEM(ids, k, Py_NewRef(PyTuple_GET_ITEM(f->ids, ranked[k])));
    PyObject *text = reason(outcome, top_cached, f->eff[ranked[0]], moved_wait_s);
    PyObject *tokens = text == NULL ? NULL : PyLong_FromLongLong(top_cached);
    PyTypeObject *type = (PyTypeObject *)RouteDecisionType;
    PyObject *made = tokens == NULL ? NULL : type->tp_alloc(type, 3);
    if (made == NULL) {
        Py_DECREF(ids);
        Py_XDECREF(text);
        Py_XDECREF(tokens);
        return NULL;
    }
    PyTuple_SET_ITEM(made, 0, ids);
    PyTuple_SET_ITEM(made, 1, text);
    PyTuple_SET_ITEM(made, 2, tokens);
    PyObject *place_obj = place == NULL ? PyUnicode_FromStringAndSize("", 0) : Py_NewRef(place);
    if (place_obj == NULL) {
        Py_DECREF(made);
        return NULL;
    }
    return Py_BuildValue("(NN)", made, place_obj);
}

/* A snapshot's mapping as a dict the step reads: the dict itself, NULL for an empty mapping of another kind
 * (MappingProxy's empty default), or *other = 1 for anything else (the Python policy decides). -1: an error. */
static int as_dict(PyObject *mapping, PyObject **out, int *other) {
    if (PyDict_CheckExact(mapping)) {
        *out = mapping;
        return 0;
    }
    *out = NULL;
    Py_ssize_t size = PyObject_Length(mapping);
    if (size < 0) return -1;
    if (size > 0) *other = 1;
    return 0;
}

static PyObject *rank(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "rank(fleet, snapshot, num_prompt_tokens, key, state) takes 5 arguments");
        return NULL;
    }
    if (RouteDecisionType == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "rank: configure() was not called");
        return NULL;
    }
    Fleet *f = (Fleet *)PyCapsule_GetPointer(args[0], "tessera.affinity_fleet");
    if (f == NULL) return NULL;
    PyObject *snapshot = args[1], *state = args[4];
    if (!PyTuple_Check(snapshot) || PyTuple_GET_SIZE(snapshot) != 6 || (state != Py_None && !PyUnicode_Check(state))) {
        PyErr_SetString(PyExc_TypeError, "rank: snapshot must be a RouteSnapshot, the state None or a str");
        return NULL;
    }
    PyObject *cached_blocks, *in_flight, *pending, *waits = NULL, *waiting = Py_None;
    int other = 0;
    if (as_dict(PyTuple_GET_ITEM(snapshot, 1), &cached_blocks, &other) < 0 ||
        as_dict(PyTuple_GET_ITEM(snapshot, 2), &in_flight, &other) < 0 ||
        as_dict(PyTuple_GET_ITEM(snapshot, 3), &pending, &other) < 0)
        return NULL;
    PyObject *waits_in = PyTuple_GET_ITEM(snapshot, 4), *fit = PyTuple_GET_ITEM(snapshot, 5);
    PyObject *now_obj = NULL, *owned = NULL;  /* owned: the PodWaits' stamps, held for the call */
    long long now = 0;
    if ((PyObject *)Py_TYPE(waits_in) == PodWaitsType) {
        owned = waiting = PyObject_GetAttr(waits_in, str_waiting);
        if (waiting == NULL) return NULL;
        now_obj = PyObject_GetAttr(waits_in, str_now);
        if (now_obj == NULL) {
            Py_DECREF(owned);
            return NULL;
        }
        now = PyLong_AsLongLong(now_obj);
        Py_DECREF(now_obj);
        if (!PyDict_CheckExact(waiting)) other = 1;
        if (now == -1 && PyErr_Occurred()) {
            Py_DECREF(owned);
            return NULL;
        }
    } else if (as_dict(waits_in, &waits, &other) < 0) {
        return NULL;
    }
    if (other) {
        Py_XDECREF(owned);
        Py_RETURN_NONE;
    }
    PyObject *empty = NULL;
    if (cached_blocks == NULL || in_flight == NULL || pending == NULL || (waiting == Py_None && waits == NULL)) {
        empty = PyDict_New();
        if (empty == NULL) {
            Py_XDECREF(owned);
            return NULL;
        }
        if (cached_blocks == NULL) cached_blocks = empty;
        if (in_flight == NULL) in_flight = empty;
        if (pending == NULL) pending = empty;
        if (waiting == Py_None && waits == NULL) waits = empty;
    }
    int has_fit = fit != Py_None;
    double s_per_token = 0.0;
    if (has_fit) {
        if (!PyTuple_Check(fit) || PyTuple_GET_SIZE(fit) != 2) {
            Py_XDECREF(empty);
            Py_XDECREF(owned);
            PyErr_SetString(PyExc_TypeError, "rank: prefill_fit must be a PrefillFit");
            return NULL;
        }
        s_per_token = PyFloat_AsDouble(PyTuple_GET_ITEM(fit, 1));
        if (s_per_token == -1.0 && PyErr_Occurred()) {
            Py_XDECREF(empty);
            Py_XDECREF(owned);
            return NULL;
        }
    }
    long long num_prompt_tokens = PyLong_AsLongLong(args[2]);
    uint64_t key = PyLong_AsUnsignedLongLongMask(args[3]);
    if (PyErr_Occurred()) {
        Py_XDECREF(empty);
        Py_XDECREF(owned);
        return NULL;
    }

    PyObject *result = NULL;
    Py_ssize_t num_touched = 0, num_cached = 0;
    Py_ssize_t n = f->n;
    /* Loads: the pod's count where above the heartbeat's. */
    long long sum_loads = f->sum_loads;
    Py_ssize_t pos = 0;
    PyObject *engine_id, *value;
    while (PyDict_Next(in_flight, &pos, &engine_id, &value)) {
        PyObject *at = PyDict_GetItemWithError(f->index, engine_id);
        if (at == NULL) {
            if (PyErr_Occurred()) goto done;
            continue;
        }
        long i = PyLong_AsLong(at);
        long long num = PyLong_AsLongLong(value);
        if (PyErr_Occurred()) goto done;
        if (num > f->eff[i]) {
            if (f->eff[i] == f->loads[i] && f->cached[i] < 0) f->touched[num_touched++] = (int32_t)i;
            sum_loads += num - f->eff[i];
            f->eff[i] = num;
        }
    }
    Call call = {f, f->bound_factor * (double)sum_loads / (double)n + 1, waiting, waits, pending, now};
    /* Cached tokens, at most what a prefill can reuse (vLLM recomputes the last prompt token). */
    long long reusable = num_prompt_tokens - 1 > 0 ? num_prompt_tokens - 1 : 0;
    pos = 0;
    while (PyDict_Next(cached_blocks, &pos, &engine_id, &value)) {
        PyObject *at = PyDict_GetItemWithError(f->index, engine_id);
        if (at == NULL) {
            if (PyErr_Occurred()) goto done;
            continue;
        }
        long i = PyLong_AsLong(at);
        long long blocks = PyLong_AsLongLong(value);
        if (PyErr_Occurred()) goto done;
        if (blocks <= 0) continue;
        long long size = f->block_size[i];
        long long cap = size > 0 ? floor_div(reusable, size) * size : 0;
        long long tokens = blocks * size < cap ? blocks * size : cap;
        if (f->eff[i] == f->loads[i] && f->cached[i] < 0) f->touched[num_touched++] = (int32_t)i;
        if (f->cached[i] < 0) f->order[num_cached++] = (int32_t)i;
        f->cached[i] = tokens;
    }
    /* The walk: the usual case has max_ranked open engines in the ring's short walk. */
    const Ring *ring = f->ring;
    Py_ssize_t walk_len = n < ring->depth ? n : ring->depth;
    Py_ssize_t start = ring_start(ring, key);
    const int32_t *walk = ring->walks + start * ring->depth;
    int32_t *open = f->ranked + n;  /* max_ranked slots past the ranking's n */
    Py_ssize_t num_open = 0;
    for (Py_ssize_t k = 0; k < walk_len && num_open < f->max_ranked; k++)
        if (!is_closed(&call, walk[k])) open[num_open++] = walk[k];
    if (num_open < f->max_ranked) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    /* Two homes: the second takes the first's place while it is idle and the first is not. */
    int32_t swap_a = -1, swap_b = -1;
    if (f->eff[open[1]] == 0 && 0 < f->eff[open[0]]) {
        swap_a = open[0];
        swap_b = open[1];
        open[0] = swap_b;
        open[1] = swap_a;
    }
    /* The ranking: the open holders with credit (by credit, then price, then home rank), then the open homes. */
    int32_t *ranked = f->ranked;
    Py_ssize_t len = 0;
    for (Py_ssize_t k = 0; k < num_cached; k++) {
        int32_t i = f->order[k];
        if (f->cached[i] && !is_closed(&call, i)) ranked[len++] = i;
    }
    if (len > 1) {
        /* An insertion sort by (-credit, price, home rank): keys are distinct (home ranks are). */
        long long *credit = PyMem_Malloc(len * sizeof(long long) * 3);
        if (credit == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        long long *price = credit + len, *home = credit + 2 * len;
        for (Py_ssize_t k = 0; k < len; k++) {
            int32_t i = ranked[k];
            int32_t placed = i == swap_a ? swap_b : (i == swap_b ? swap_a : i);
            credit[k] = f->cached[i];
            price[k] = f->per_running * f->eff[i] + f->per_waiting * f->waiting[i];
            home[k] = ring_offset(ring, start, placed);
        }
        for (Py_ssize_t k = 1; k < len; k++) {
            int32_t i = ranked[k];
            long long c = credit[k], p = price[k], h = home[k];
            Py_ssize_t j = k - 1;
            while (j >= 0 && (credit[j] < c || (credit[j] == c && (price[j] > p || (price[j] == p && home[j] > h))))) {
                ranked[j + 1] = ranked[j];
                credit[j + 1] = credit[j];
                price[j + 1] = price[j];
                home[j + 1] = home[j];
                j--;
            }
            ranked[j + 1] = i;
            credit[j + 1] = c;
            price[j + 1] = p;
            home[j + 1] = h;
        }
        PyMem_Free(credit);
    }
    if (len) {
        for (Py_ssize_t k = 0; k < num_open; k++)
            if (!cached_of(f, open[k])) ranked[len++] = open[k];
    } else {
        memcpy(ranked, open, num_open * sizeof(int32_t));
        len = num_open;
    }
    if (len > f->max_ranked) len = f->max_ranked;

    /* The placement rules. */
    int outcome = OUTCOME_PLAIN;
    double moved_wait_s = 0.0;
    PyObject *place = Py_None;  /* borrowed; "" for settled, or an id */
    int settled = state != Py_None && PyUnicode_GET_LENGTH(state) == 0;
    if (num_cached) {
        if (!settled) place = NULL;  /* SETTLED, made below */
        if (has_fit && cached_of(f, ranked[0])) {
            double holder_wait;
            int32_t sooner = sooner_elsewhere(&call, ranked, len, s_per_token, &holder_wait);
            if (sooner == -2) goto done;
            if (sooner >= 0) {
                outcome = OUTCOME_MOVED;
                moved_wait_s = holder_wait;
                to_front(f, ranked, &len, sooner);
            }
        }
        if (!cached_of(f, ranked[0]) && outcome == OUTCOME_PLAIN) {
            /* Holders over the bound, or nothing creditable: the Python policy's rarer rules. */
            result = Py_NewRef(Py_None);
            goto done;
        }
    } else if (state == Py_None) {
        int32_t best = least_backlogged(&call, ranked, len, has_fit, s_per_token);
        if (best == -2) goto done;
        if (best >= 0) {
            to_front(f, ranked, &len, best);
            outcome = OUTCOME_PLACED_BY_LOAD;
        }
        place = PyTuple_GET_ITEM(f->ids, ranked[0]);
    } else if (!settled) {
        PyObject *at = PyDict_GetItemWithError(f->index, state);
        if (at == NULL && PyErr_Occurred()) goto done;
        long i = at == NULL ? -1 : PyLong_AsLong(at);
        if (i >= 0 && !is_closed(&call, (int32_t)i)) {
            to_front(f, ranked, &len, (int32_t)i);
            outcome = OUTCOME_PENDING;
        } else {
            place = PyTuple_GET_ITEM(f->ids, ranked[0]);
        }
    }
    result = decision(f, ranked, len, outcome, moved_wait_s, place);
done:
    for (Py_ssize_t k = 0; k < num_touched; k++) {
        int32_t i = f->touched[k];
        f->eff[i] = f->loads[i];
        f->cached[i] = -1;
    }
    Py_XDECREF(empty);
    Py_XDECREF(owned);
    return result;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *decision_type, *waits_type;
    if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &decision_type, &PyType_Type, &waits_type)) return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)decision_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "configure: the decision type must be a NamedTuple");
        return NULL;
    }
    Py_XSETREF(RouteDecisionType, Py_NewRef(decision_type));
    Py_XSETREF(PodWaitsType, Py_NewRef(waits_type));
    if (str_waiting == NULL && (str_waiting = PyUnicode_InternFromString("_waiting")) == NULL) return NULL;
    if (str_now == NULL && (str_now = PyUnicode_InternFromString("now")) == NULL) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"ring", make_ring, METH_VARARGS, "A consistent-hash ring as prefix_affinity's arrays."},
    {"fleet", make_fleet, METH_VARARGS, "A registry read's engines as prefix_affinity's arrays."},
    {"rank", (PyCFunction)(void (*)(void))rank, METH_FASTCALL, "prefix_affinity's usual decision, or None."},
    {"configure", configure, METH_VARARGS, "The RouteDecision and PodWaits types the step makes and reads."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_affinity_rank", NULL, 0, methods};

PyMODINIT_FUNC PyInit__affinity_rank(void) { return PyModule_Create(&module); }
