/* The two inner loops of `harness scan`, in C: the words front end and the window prefilter.
 *
 * Optional: harness/lib/scan_kernels.py falls back to the numpy code when
 * this module is not built, and tests/lib/test_scan_kernels.py checks that
 * both give the same arrays, bit for bit. numpy computes the same values in
 * about twenty passes over arrays of words, each paying Python's call and a
 * fresh temporary; here each is one pass over the bytes (or the word hashes):
 * about twice numpy's speed, which makes one worker more than ten times the
 * janitor baseline.
 *
 * words(buffer, table) -> (normalised, starts, ends, units, breaks, bounds)
 *   A word is a maximal run of bytes above space, after translating every
 *   byte through `table` (256 bytes; None: the buffer is normalised
 *   already). `normalised` is the translated buffer (None without a table);
 *   starts/ends/breaks/bounds are int64, units uint64, each a bytearray:
 *   word_scan.word_hashes, find_words and WordChunk.of give the same.
 *
 * window_candidates(units, n, bitmap, bits) -> (positions, hashes)
 *   The polynomial hash of every window of n units (ngrams.window_hashes,
 *   rolled instead of a prefix sum: the same value mod 2^64), kept when its
 *   top `bits` bits hit a set bit of the packed `bitmap` (NgramIndex._maybe).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL;  /* word_scan._GOLDEN, also ngrams.BASE */

static inline uint64_t mix(uint64_t x) {  /* word_scan._mix: splitmix64's finaliser */
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

static inline uint64_t load8(const unsigned char *p, Py_ssize_t available) {  /* little-endian; zeros past the end */
    uint64_t v = 0;
    if (available >= 8) {
        memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        v = __builtin_bswap64(v);
#endif
        return v;
    }
    for (Py_ssize_t i = 0; i < available; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static inline uint64_t low(uint64_t block, Py_ssize_t count) {  /* the low `count` bytes of a block, the others zero */
    return count >= 8 ? block : block & ((1ULL << (8 * count)) - 1);
}

/* The high bit of the first byte at or below space (a separator; 0 past the end counts), exact for the lowest such byte:
 * a borrow only runs upwards from it, and bytes from 0x80 up (UTF-8 of words) are never flagged. */
static inline uint64_t separators(uint64_t block) {
    return (block - 0x2121212121212121ULL) & ~block & 0x8080808080808080ULL;
}

static inline Py_ssize_t first_flag(uint64_t flags) {  /* byte index of the lowest flagged byte */
    return (Py_ssize_t)(__builtin_ctzll(flags) >> 3);
}

static PyObject *new_array(Py_ssize_t items) {  /* a bytearray of `items` 8-byte values, resized once filled */
    return PyByteArray_FromStringAndSize(NULL, (items > 0 ? items : 1) * 8);
}

static int resize(PyObject *array, Py_ssize_t items) {  /* to exactly `items` values: shrunk at the end, grown as found */
    return PyByteArray_Resize(array, items * 8);
}

static PyObject *words(PyObject *self, PyObject *args) {
    Py_buffer in;
    PyObject *table_object;
    if (!PyArg_ParseTuple(args, "y*O", &in, &table_object))
        return NULL;
    const unsigned char *table = NULL;
    if (table_object != Py_None) {
        if (!PyBytes_Check(table_object) || PyBytes_GET_SIZE(table_object) != 256) {
            PyBuffer_Release(&in);
            PyErr_SetString(PyExc_ValueError, "words: table must be 256 bytes or None");
            return NULL;
        }
        table = (const unsigned char *)PyBytes_AS_STRING(table_object);
    }
    const Py_ssize_t n = in.len;
    const unsigned char *source = (const unsigned char *)in.buf;
    PyObject *normalised = table ? PyBytes_FromStringAndSize(NULL, n) : (Py_INCREF(Py_None), Py_None);
    if (!normalised) {
        PyBuffer_Release(&in);
        return NULL;
    }
    Py_ssize_t breaks_count = 0;
    Py_BEGIN_ALLOW_THREADS  /* the loops touch only buffers held here (another thread may run meanwhile) */
    if (table) {
        unsigned char *out = (unsigned char *)PyBytes_AS_STRING(normalised);
        for (Py_ssize_t i = 0; i < n; i++) {
            out[i] = table[source[i]];
            breaks_count += out[i] == '\n';
        }
        source = out;
    } else {
        for (const unsigned char *at = source, *end = source + n; (at = memchr(at, '\n', end - at)) != NULL; at++)
            breaks_count++;
    }
    Py_END_ALLOW_THREADS
    const Py_ssize_t most_words = n / 2 + 1;
    PyObject *starts = new_array(most_words), *ends = new_array(most_words), *units = new_array(most_words);
    PyObject *breaks = new_array(breaks_count), *bounds = new_array(breaks_count + 1);
    if (!starts || !ends || !units || !breaks || !bounds)
        goto fail;
    int64_t *start_at = (int64_t *)PyByteArray_AS_STRING(starts), *end_at = (int64_t *)PyByteArray_AS_STRING(ends);
    int64_t *break_at = (int64_t *)PyByteArray_AS_STRING(breaks), *bound_at = (int64_t *)PyByteArray_AS_STRING(bounds);
    uint64_t *unit_at = (uint64_t *)PyByteArray_AS_STRING(units);
    Py_ssize_t count = 0, lines = 0, i = 0;
    bound_at[0] = 0;
    Py_BEGIN_ALLOW_THREADS
    while (i < n) {
        unsigned char c = source[i];
        if (c <= ' ') {
            if (c == '\n' && lines < breaks_count) {  /* always, unless a writable input changed since it was counted */
                break_at[lines++] = i;
                bound_at[lines] = count;
            }
            i++;
            continue;
        }
        if (count == most_words)  /* likewise impossible for an input that holds still: never write past the arrays */
            break;
        /* a word from i: 8 bytes at a time until a block holds a separator (word_scan.word_hashes, in one pass) */
        const Py_ssize_t first = i;
        uint64_t block = load8(source + i, n - i), flags = separators(block), hash;
        if (flags) {
            Py_ssize_t length = first_flag(flags);
            hash = ((uint64_t)length * GOLDEN) ^ low(block, length);
            i += length;
        } else {
            Py_ssize_t end = i + 8;
            for (;;) {
                flags = separators(load8(source + end, n - end));
                if (flags) {
                    end += first_flag(flags);
                    break;
                }
                end += 8;
            }
            Py_ssize_t length = end - first;
            hash = ((uint64_t)length * GOLDEN) ^ block;
            for (Py_ssize_t offset = 8; offset < length; offset += 8)
                hash = mix(hash) ^ low(load8(source + first + offset, n - first - offset), length - offset);
            i = end;
        }
        if (i == first)  /* a byte that changed under us (a writable input): step over it */
            i++;
        start_at[count] = first;
        end_at[count] = i;
        unit_at[count++] = hash;
    }
    Py_END_ALLOW_THREADS
    if (resize(starts, count) || resize(ends, count) || resize(units, count) || resize(breaks, lines) || resize(bounds, lines + 1))
        goto fail;
    PyBuffer_Release(&in);
    return Py_BuildValue("(NNNNNN)", normalised, starts, ends, units, breaks, bounds);
fail:
    PyBuffer_Release(&in);
    Py_XDECREF(normalised);
    Py_XDECREF(starts);
    Py_XDECREF(ends);
    Py_XDECREF(units);
    Py_XDECREF(breaks);
    Py_XDECREF(bounds);
    return NULL;
}

static PyObject *window_candidates(PyObject *self, PyObject *args) {
    Py_buffer units_in, bitmap_in;
    Py_ssize_t n;
    int bits;
    if (!PyArg_ParseTuple(args, "y*ny*i", &units_in, &n, &bitmap_in, &bits))
        return NULL;
    PyObject *positions = NULL, *hashes = NULL;
    if (n <= 0 || bits < 3 || bits > 40 || bitmap_in.len < ((Py_ssize_t)1 << (bits - 3)) || units_in.len % 8) {
        PyErr_SetString(PyExc_ValueError, "window_candidates: units must be 8-byte values, n positive and the bitmap hold 2^bits bits");
        goto done;
    }
    const Py_ssize_t total = units_in.len / 8;
    const Py_ssize_t windows = total - n + 1;
    const uint64_t *units = (const uint64_t *)units_in.buf;
    const unsigned char *bitmap = (const unsigned char *)bitmap_in.buf;
    /* found below: at most one candidate per window, grown as needed (about 1 window in 64 passes) */
    Py_ssize_t capacity = windows > 0 ? windows / 32 + 64 : 1, found = 0;
    positions = new_array(capacity);
    hashes = new_array(capacity);
    if (!positions || !hashes)
        goto done;
    if (windows > 0) {
        uint64_t top = 1;  /* BASE^(n-1) */
        for (Py_ssize_t j = 1; j < n; j++)
            top *= GOLDEN;
        uint64_t h = 0;
        for (Py_ssize_t j = 0; j < n; j++)
            h = h * GOLDEN + (units[j] + 1);
        const int shift = 64 - bits;
        for (Py_ssize_t w = 0;; w++) {
            uint64_t slot = h >> shift;
            if ((bitmap[slot >> 3] >> (slot & 7)) & 1) {
                if (found == capacity) {
                    capacity *= 2;
                    if (resize(positions, capacity) || resize(hashes, capacity))
                        goto done;
                }
                ((int64_t *)PyByteArray_AS_STRING(positions))[found] = w;
                ((uint64_t *)PyByteArray_AS_STRING(hashes))[found] = h;
                found++;
            }
            if (w + 1 >= windows)
                break;
            h = (h - (units[w] + 1) * top) * GOLDEN + (units[w + n] + 1);
        }
    }
    if (resize(positions, found) || resize(hashes, found))
        goto done;
    PyBuffer_Release(&units_in);
    PyBuffer_Release(&bitmap_in);
    return Py_BuildValue("(NN)", positions, hashes);
done:
    PyBuffer_Release(&units_in);
    PyBuffer_Release(&bitmap_in);
    Py_XDECREF(positions);
    Py_XDECREF(hashes);
    return NULL;
}

static PyMethodDef methods[] = {
    {"words", words, METH_VARARGS, "words(buffer, table) -> (normalised, starts, ends, units, breaks, bounds)"},
    {"window_candidates", window_candidates, METH_VARARGS, "window_candidates(units, n, bitmap, bits) -> (positions, hashes)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan_kernels", "C inner loops of harness scan.", -1, methods};

PyMODINIT_FUNC PyInit__scan_kernels(void) { return PyModule_Create(&module); }
