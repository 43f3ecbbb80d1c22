/* The gateway's per-token step in C: one HTTP chunk of an engine's streamed body in, the client's HTTP chunk
 * out (tessera/gateway/delta_chunk.py says why, and holds the Python twin this must agree with byte for byte).
 *
 * split_delta_chunk(data, head, tail) takes `data` only when it is exactly one chunk in chunked encoding,
 * `<hex size>\r\n<line>\r\n`, whose line is one delta of choice 0 as the engine's encoder writes it
 * (engine/protocol.py delta_line: orjson's bytes, `{"i":0,"t":<string>,"d":[<ids>]}` then `\n`). The text is
 * accepted only in the canonical form orjson writes (its escapes and nothing else, well-formed UTF-8), so
 * copying it into the client's chunk gives the bytes that decoding and re-encoding it would: the same bytes
 * as the Python path, and no engine byte can end the client's SSE line or JSON string early. Anything else
 * returns None and takes the Python path, which parses it (or rejects it) as any other line.
 *
 * Returns (framed, ids): framed is `<hex size>\r\n` head + text + tail `\r\n` (b"" for an empty text: nothing
 * to write), ids the delta's token ids. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define LINE_HEAD "{\"i\":0,\"t\":"
#define IDS_HEAD ",\"d\":["
#define MAX_SIZE_DIGITS 8  /* a chunk of up to 4 GiB: far beyond any delta */
#define MAX_ID_DIGITS 18   /* fits a long long */

static int hex_value(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int is_continuation(unsigned char c) { return (c & 0xC0) == 0x80; }

/* Length of the well-formed UTF-8 sequence at s[0] (a byte >= 0x80; `avail` bytes readable), or -1. The second
 * byte's range per lead byte rules out overlong forms, surrogates and code points past U+10FFFF. */
static Py_ssize_t utf8_sequence(const unsigned char *s, Py_ssize_t avail) {
    unsigned char c = s[0], low = 0x80, high = 0xBF;
    Py_ssize_t length;
    if (c >= 0xC2 && c <= 0xDF) {
        length = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        length = 3;
        if (c == 0xE0) low = 0xA0;
        if (c == 0xED) high = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        length = 4;
        if (c == 0xF0) low = 0x90;
        if (c == 0xF4) high = 0x8F;
    } else {
        return -1;
    }
    if (avail < length || s[1] < low || s[1] > high) return -1;
    for (Py_ssize_t k = 2; k < length; k++) {
        if (!is_continuation(s[k])) return -1;
    }
    return length;
}

/* Length of the canonical JSON string literal (its quotes included) at s[0] == '"', or -1. Canonical as
 * orjson writes: ", \ and the controls escaped (\b \t \n \f \r, else \u00xx in lower case), nothing else
 * escaped, UTF-8 well formed (no overlong forms, no surrogates, nothing above U+10FFFF). */
static Py_ssize_t canonical_string(const unsigned char *s, Py_ssize_t n) {
    Py_ssize_t i = 1;
    while (i < n) {
        unsigned char c = s[i];
        if (c == '"') return i + 1;
        if (c < 0x20) return -1;
        if (c == '\\') {
            if (i + 1 >= n) return -1;
            unsigned char e = s[i + 1];
            if (e == '"' || e == '\\' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
                i += 2;
                continue;
            }
            if (e != 'u' || i + 5 >= n || s[i + 2] != '0' || s[i + 3] != '0') return -1;
            unsigned char h1 = s[i + 4], h2 = s[i + 5];
            if (h1 != '0' && h1 != '1') return -1;
            int low = (h2 >= '0' && h2 <= '9') ? h2 - '0' : (h2 >= 'a' && h2 <= 'f') ? h2 - 'a' + 10 : -1;
            if (low < 0) return -1;
            int code = (h1 - '0') * 16 + low;
            if (code == 0x08 || code == 0x09 || code == 0x0a || code == 0x0c || code == 0x0d) return -1;
            i += 6;
            continue;
        }
        if (c < 0x80) {
            i += 1;
            continue;
        }
        Py_ssize_t length = utf8_sequence(s + i, n - i);
        if (length < 0) return -1;
        i += length;
    }
    return -1;
}

/* The ids between "[" and "]" (s points past "["): appended to `ids`; the index of "]" or -1 (not canonical:
 * a leading zero, a sign, a space, too many digits) or -2 (a Python error is set). */
static Py_ssize_t parse_ids(const unsigned char *s, Py_ssize_t n, PyObject *ids) {
    Py_ssize_t i = 0;
    if (i < n && s[i] == ']') return i;
    for (;;) {
        Py_ssize_t start = i;
        long long value = 0;
        while (i < n && s[i] >= '0' && s[i] <= '9') {
            if (i - start == MAX_ID_DIGITS) return -1;
            value = value * 10 + (s[i] - '0');
            i++;
        }
        if (i == start || (s[start] == '0' && i - start > 1) || i >= n) return -1;
        PyObject *id = PyLong_FromLongLong(value);
        if (id == NULL) return -2;
        int failed = PyList_Append(ids, id);
        Py_DECREF(id);
        if (failed) return -2;
        if (s[i] == ']') return i;
        if (s[i] != ',') return -1;
        i++;
    }
}

static PyObject *split_delta_chunk(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 || !PyBytes_CheckExact(args[0]) || !PyBytes_CheckExact(args[1]) || !PyBytes_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "split_delta_chunk(data: bytes, head: bytes, tail: bytes)");
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);

    /* The chunk's size line, then exactly that many bytes and the chunk's CRLF, then nothing. */
    Py_ssize_t i = 0;
    Py_ssize_t size = 0;
    while (i < n && i < MAX_SIZE_DIGITS && hex_value(data[i]) >= 0) {
        size = size * 16 + hex_value(data[i]);
        i++;
    }
    if (i == 0 || i + 2 > n || data[i] != '\r' || data[i + 1] != '\n') Py_RETURN_NONE;
    const unsigned char *line = data + i + 2;
    if (size < 2 || n - (i + 2) != size + 2 || line[size] != '\r' || line[size + 1] != '\n' || line[size - 1] != '\n')
        Py_RETURN_NONE;
    Py_ssize_t body = size - 1;  /* the line without its newline */

    Py_ssize_t head_len = (Py_ssize_t)(sizeof(LINE_HEAD) - 1);
    if (body < head_len + 2 || memcmp(line, LINE_HEAD, head_len) != 0 || line[head_len] != '"') Py_RETURN_NONE;
    const unsigned char *text = line + head_len;
    Py_ssize_t text_len = canonical_string(text, body - head_len);
    if (text_len < 0) Py_RETURN_NONE;
    Py_ssize_t at = head_len + text_len;
    Py_ssize_t ids_head_len = (Py_ssize_t)(sizeof(IDS_HEAD) - 1);
    if (body - at < ids_head_len + 2 || memcmp(line + at, IDS_HEAD, ids_head_len) != 0) Py_RETURN_NONE;
    at += ids_head_len;

    PyObject *ids = PyList_New(0);
    if (ids == NULL) return NULL;
    Py_ssize_t close = parse_ids(line + at, body - at, ids);
    if (close == -2) {
        Py_DECREF(ids);
        return NULL;
    }
    /* After "]": the object's "}" and the end of the line. */
    if (close < 0 || at + close + 2 != body || line[at + close + 1] != '}') {
        Py_DECREF(ids);
        Py_RETURN_NONE;
    }

    PyObject *framed;
    if (text_len == 2) {  /* "": nothing for the client */
        framed = PyBytes_FromStringAndSize(NULL, 0);
    } else {
        Py_ssize_t head_n = PyBytes_GET_SIZE(args[1]), tail_n = PyBytes_GET_SIZE(args[2]);
        Py_ssize_t chunk = head_n + text_len + tail_n;
        char size_line[24];
        int size_n = snprintf(size_line, sizeof(size_line), "%zx\r\n", (size_t)chunk);
        framed = PyBytes_FromStringAndSize(NULL, size_n + chunk + 2);
        if (framed != NULL) {
            char *out = PyBytes_AS_STRING(framed);
            memcpy(out, size_line, size_n);
            out += size_n;
            memcpy(out, PyBytes_AS_STRING(args[1]), head_n);
            out += head_n;
            memcpy(out, text, text_len);
            out += text_len;
            memcpy(out, PyBytes_AS_STRING(args[2]), tail_n);
            out += tail_n;
            memcpy(out, "\r\n", 2);
        }
    }
    if (framed == NULL) {
        Py_DECREF(ids);
        return NULL;
    }
    PyObject *pair = PyTuple_Pack(2, framed, ids);
    Py_DECREF(framed);
    Py_DECREF(ids);
    return pair;
}

static PyMethodDef methods[] = {
    {"split_delta_chunk", (PyCFunction)(void (*)(void))split_delta_chunk, METH_FASTCALL,
     "split_delta_chunk(data, head, tail) -> (framed, ids) | None: see tessera/gateway/delta_chunk.py."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tessera.gateway._delta_chunk",
    "The per-token step in C (tessera/gateway/delta_chunk.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__delta_chunk(void) { return PyModule_Create(&module); }
