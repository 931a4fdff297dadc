/* Where two tensors differ, in one pass over both: client/wire/delta_plan.py's native diff.
 *
 * NumPy takes three passes for it (a flag per element, flatnonzero, a gather), and those are
 * most of the server's diff at RL densities (docs/performance.md, "Delta updates on a trained
 * model"). This module compares the old and new bytes 64 elements at a time (16 bytes per
 * instruction with SSE2, 8 bytes per word elsewhere), skips a block with no change, and for
 * each changed element of the others writes the gap from the previous changed element and
 * the new element straight into the caller's buffers. Only the CPython C API and the buffer
 * protocol: it builds against any NumPy, and delta_plan.py falls back to NumPy where it was
 * not built.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* Elements compared as one block: a bit each in a uint64_t (64 to 512 bytes). Blocks of 32
 * elements were slower from 2 % changed up, on 128 MiB tensors of 1, 2 and 4-byte elements. */
#define BLOCK_ELEMENTS 64
#define WORD_BYTES 8

typedef struct {
    const unsigned char *old_bytes;
    const unsigned char *new_bytes;
    unsigned char *gaps;
    unsigned char *values;
    Py_ssize_t gap_size;
    Py_ssize_t capacity; /* elements the gaps and values buffers hold */
    Py_ssize_t written;
    uint64_t last; /* the previous changed index; 0 before the first (its gap is its index) */
    uint64_t widest;
} Diff;

/* -DDIFFNATIVE_PORTABLE builds the fallback where the builtin exists, to test it. */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(DIFFNATIVE_PORTABLE)
#define lowest_bit(x) ((Py_ssize_t)__builtin_ctzll(x))
#else
/* The index of the lowest set bit of ``x`` (nonzero), by a de Bruijn sequence. */
static inline Py_ssize_t
lowest_bit(uint64_t x)
{
    static const unsigned char positions[64] = {
        0,  1,  48, 2,  57, 49, 28, 3,  61, 58, 50, 42, 38, 29, 17, 4,
        62, 55, 59, 36, 53, 51, 43, 22, 45, 39, 33, 30, 24, 18, 12, 5,
        63, 47, 56, 27, 60, 41, 37, 16, 54, 35, 52, 21, 44, 32, 23, 11,
        46, 26, 40, 15, 34, 20, 31, 10, 25, 14, 19, 9,  13, 8,  7,  6,
    };
    return positions[((x & (0 - x)) * UINT64_C(0x03f79d71b4cb0a89)) >> 58];
}
#endif

/* block_changes_SIZE(old_block, new_block): one bit per element of a block of
 * BLOCK_ELEMENTS elements of SIZE bytes, set where the element changed, the first element in
 * bit 0. With SSE2 (every x86-64) 16 bytes are compared per instruction and the results
 * packed to one byte per element, whose top bits movemask gathers: about a quarter of the
 * word-at-a-time work, and the compare was most of the diff at RL densities
 * (docs/performance.md, "Delta updates on a trained model"). Elsewhere, or built with
 * -DDIFFNATIVE_PORTABLE (to test that path), words of 8 bytes: one pass that skips a block
 * with no change, then the lanes of the others. */
#if defined(__SSE2__) && !defined(DIFFNATIVE_PORTABLE)
#include <emmintrin.h>

static inline __m128i
load16(const unsigned char *at)
{
    return _mm_loadu_si128((const __m128i *)at);
}

/* 16 elements of ``size`` bytes (1, 2 or 4) compared, one byte per element in order: 0xff
 * where equal. Signed saturation packs keep -1 (equal) and 0 (changed) as they are. */
static inline __m128i
equal_bytes_of_16(const unsigned char *a, const unsigned char *b, int size)
{
    if (size == 1) {
        return _mm_cmpeq_epi8(load16(a), load16(b));
    }
    if (size == 2) {
        return _mm_packs_epi16(_mm_cmpeq_epi16(load16(a), load16(b)),
                               _mm_cmpeq_epi16(load16(a + 16), load16(b + 16)));
    }
    return _mm_packs_epi16(_mm_packs_epi32(_mm_cmpeq_epi32(load16(a), load16(b)),
                                           _mm_cmpeq_epi32(load16(a + 16), load16(b + 16))),
                           _mm_packs_epi32(_mm_cmpeq_epi32(load16(a + 32), load16(b + 32)),
                                           _mm_cmpeq_epi32(load16(a + 48), load16(b + 48))));
}

#define DEFINE_BLOCK_CHANGES(SIZE)                                                  \
    static inline uint64_t block_changes_##SIZE(const unsigned char *o,            \
                                                const unsigned char *n)            \
    {                                                                               \
        uint64_t changed = 0;                                                       \
        int j;                                                                      \
        for (j = 0; j < 4; j++) {                                                   \
            __m128i equal = equal_bytes_of_16(o + 16 * (SIZE) * j,                  \
                                              n + 16 * (SIZE) * j, SIZE);           \
            changed |= (uint64_t)(~_mm_movemask_epi8(equal) & 0xffff) << (16 * j);  \
        }                                                                           \
        return changed;                                                             \
    }

DEFINE_BLOCK_CHANGES(1)
DEFINE_BLOCK_CHANGES(2)
DEFINE_BLOCK_CHANGES(4)

static inline uint64_t
block_changes_8(const unsigned char *o, const unsigned char *n)
{
    uint64_t changed = 0;
    int j;
    for (j = 0; j < 32; j++) { /* two elements per compare: equal where both halves are */
        __m128i halves = _mm_cmpeq_epi32(load16(o + 16 * j), load16(n + 16 * j));
        __m128i both = _mm_and_si128(halves, _mm_shuffle_epi32(halves, 0xb1));
        changed |= (uint64_t)(~_mm_movemask_pd(_mm_castsi128_pd(both)) & 3) << (2 * j);
    }
    return changed;
}
#else
/* Eight bytes as a little-endian integer, whatever the machine's order and the address's
 * alignment, so that the first element of a word is in its low bits everywhere. Compilers
 * make this one load on little-endian machines. */
static inline uint64_t
load_word(const unsigned char *at)
{
    return (uint64_t)at[0] | (uint64_t)at[1] << 8 | (uint64_t)at[2] << 16 |
           (uint64_t)at[3] << 24 | (uint64_t)at[4] << 32 | (uint64_t)at[5] << 40 |
           (uint64_t)at[6] << 48 | (uint64_t)at[7] << 56;
}

/* One bit per element of the word ``x`` (old XOR new), set where the element changed, the
 * first element in bit 0: the top bit of each nonzero lane, gathered by a multiply whose
 * partial products land on distinct bits. No branch: at RL densities whether a word or a
 * block changed is close to a coin toss, and a mispredicted branch cost more than this. */
static inline uint64_t
changed_lanes_1(uint64_t x)
{
    const uint64_t low = UINT64_C(0x7f7f7f7f7f7f7f7f);
    uint64_t tops = (((x & low) + low) | x) & ~low;
    return ((tops >> 7) * UINT64_C(0x0102040810204080)) >> 56;
}

static inline uint64_t
changed_lanes_2(uint64_t x)
{
    const uint64_t low = UINT64_C(0x7fff7fff7fff7fff);
    uint64_t tops = (((x & low) + low) | x) & ~low;
    return (((tops >> 15) * UINT64_C(0x0001000200040008)) >> 48) & 0xf;
}

static inline uint64_t
changed_lanes_4(uint64_t x)
{
    return (uint64_t)((x & UINT64_C(0xffffffff)) != 0) | (uint64_t)((x >> 32) != 0) << 1;
}

static inline uint64_t
changed_lanes_8(uint64_t x)
{
    return x != 0;
}

#define DEFINE_BLOCK_CHANGES(SIZE)                                                  \
    static inline uint64_t block_changes_##SIZE(const unsigned char *o,            \
                                                const unsigned char *n)            \
    {                                                                               \
        const Py_ssize_t per_word = WORD_BYTES / (SIZE);                            \
        const Py_ssize_t block_words = BLOCK_ELEMENTS / per_word;                   \
        uint64_t any = 0, changed = 0;                                              \
        Py_ssize_t w;                                                               \
        /* Below about 1 % changed most blocks have none: one test skips them. */   \
        for (w = 0; w < block_words; w++) {                                         \
            any |= load_word(o + w * WORD_BYTES) ^ load_word(n + w * WORD_BYTES);   \
        }                                                                           \
        if (!any) {                                                                 \
            return 0;                                                               \
        }                                                                           \
        for (w = 0; w < block_words; w++) {                                         \
            uint64_t x = load_word(o + w * WORD_BYTES) ^ load_word(n + w * WORD_BYTES); \
            changed |= changed_lanes_##SIZE(x) << (w * per_word);                   \
        }                                                                           \
        return changed;                                                             \
    }

DEFINE_BLOCK_CHANGES(1)
DEFINE_BLOCK_CHANGES(2)
DEFINE_BLOCK_CHANGES(4)
DEFINE_BLOCK_CHANGES(8)
#endif

/* For elements of SIZE bytes: record_SIZE(d, index) records element ``index`` as changed and
 * says whether the buffers are then full; scan_SIZE(d, start, stop) compares elements
 * [start, stop) and records the changed ones, and returns where it stopped: ``stop``, or the
 * element after the one that filled the buffers. */
#define DEFINE_SCAN(SIZE, TYPE)                                                     \
    static inline int record_##SIZE(Diff *d, Py_ssize_t index)                      \
    {                                                                               \
        uint64_t gap = (uint64_t)index - d->last;                                   \
        TYPE value;                                                                 \
        if (gap > d->widest) {                                                      \
            d->widest = gap;                                                        \
        }                                                                           \
        if (d->gap_size == 4) {                                                     \
            uint32_t narrow = (uint32_t)gap;                                        \
            memcpy(d->gaps + d->written * 4, &narrow, 4);                           \
        }                                                                           \
        else {                                                                      \
            memcpy(d->gaps + d->written * 8, &gap, 8);                              \
        }                                                                           \
        memcpy(&value, d->new_bytes + index * (SIZE), SIZE);                        \
        memcpy(d->values + d->written * (SIZE), &value, SIZE);                      \
        d->last = (uint64_t)index;                                                  \
        d->written++;                                                               \
        return d->written == d->capacity;                                           \
    }                                                                               \
                                                                                    \
    static Py_ssize_t scan_##SIZE(Diff *d, Py_ssize_t start, Py_ssize_t stop)       \
    {                                                                               \
        Py_ssize_t i;                                                               \
        for (i = start; stop - i >= BLOCK_ELEMENTS; i += BLOCK_ELEMENTS) {          \
            uint64_t changed = block_changes_##SIZE(d->old_bytes + i * (SIZE),      \
                                                    d->new_bytes + i * (SIZE));     \
            for (; changed; changed &= changed - 1) {                               \
                Py_ssize_t index = i + lowest_bit(changed);                         \
                if (record_##SIZE(d, index)) {                                      \
                    return index + 1;                                               \
                }                                                                   \
            }                                                                       \
        }                                                                           \
        for (; i < stop; i++) { /* the last elements, fewer than a block */         \
            TYPE a, b;                                                              \
            memcpy(&a, d->old_bytes + i * (SIZE), SIZE);                            \
            memcpy(&b, d->new_bytes + i * (SIZE), SIZE);                            \
            if (a != b && record_##SIZE(d, i)) {                                    \
                return i + 1;                                                       \
            }                                                                       \
        }                                                                           \
        return stop;                                                                \
    }

DEFINE_SCAN(1, uint8_t)
DEFINE_SCAN(2, uint16_t)
DEFINE_SCAN(4, uint32_t)
DEFINE_SCAN(8, uint64_t)

PyDoc_STRVAR(diff_doc,
"diff(old, new, element_size, start, stop, gaps, gap_size, values, written, last)\n"
"-> (written, position, last, widest)\n\n"
"Compares elements [start, stop) of the buffers old and new (equal lengths, elements of\n"
"element_size bytes: 1, 2, 4 or 8, compared as bits) and, for each one that differs, writes\n"
"its gap from the previous changed index ``last`` into gaps (unsigned integers of gap_size\n"
"bytes, 4 or 8) and its new element into values, both from index ``written``. Stops early\n"
"when the buffers are full. Returns the number written in all, the element after the last\n"
"one compared (stop, unless the buffers filled), the last changed index and the widest gap\n"
"written by this call. The GIL is released during the compare.");

static PyObject *
diff(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer old_view = {0}, new_view = {0}, gaps_view = {0}, values_view = {0};
    Py_ssize_t element_size, start, stop, gap_size, written, elements, position;
    unsigned long long last;
    PyObject *result = NULL;
    Diff d;

    (void)module;
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "diff() takes 10 arguments (%zd given)", nargs);
        return NULL;
    }
    /* Each conversion is checked before the next: no C API call runs with an error set. */
    if ((element_size = PyLong_AsSsize_t(args[2])) == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if ((start = PyLong_AsSsize_t(args[3])) == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if ((stop = PyLong_AsSsize_t(args[4])) == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if ((gap_size = PyLong_AsSsize_t(args[6])) == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if ((written = PyLong_AsSsize_t(args[8])) == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if ((last = PyLong_AsUnsignedLongLong(args[9])) == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (element_size != 1 && element_size != 2 && element_size != 4 && element_size != 8) {
        PyErr_Format(PyExc_ValueError, "element_size must be 1, 2, 4 or 8, not %zd", element_size);
        return NULL;
    }
    if (gap_size != 4 && gap_size != 8) {
        PyErr_Format(PyExc_ValueError, "gap_size must be 4 or 8, not %zd", gap_size);
        return NULL;
    }
    /* PyBUF_SIMPLE and PyBUF_WRITABLE ask for contiguous memory: an exporter that is not
     * refuses, so the loop can index bytes directly. */
    if (PyObject_GetBuffer(args[0], &old_view, PyBUF_SIMPLE) < 0) {
        goto done;
    }
    if (PyObject_GetBuffer(args[1], &new_view, PyBUF_SIMPLE) < 0) {
        goto done;
    }
    if (PyObject_GetBuffer(args[5], &gaps_view, PyBUF_WRITABLE) < 0) {
        goto done;
    }
    if (PyObject_GetBuffer(args[7], &values_view, PyBUF_WRITABLE) < 0) {
        goto done;
    }
    if (old_view.len != new_view.len || new_view.len % element_size != 0) {
        PyErr_Format(PyExc_ValueError,
                     "old and new must be of one length, whole elements (%zd and %zd bytes)",
                     old_view.len, new_view.len);
        goto done;
    }
    elements = new_view.len / element_size;
    if (start < 0 || start > stop || stop > elements) {
        PyErr_Format(PyExc_ValueError, "[%zd, %zd) is not within the %zd elements", start, stop,
                     elements);
        goto done;
    }
    /* A 4-byte gap holds any gap of fewer than 2**32 elements (the widest is the last index). */
    if (gap_size == 4 && (uint64_t)elements > (uint64_t)UINT32_MAX + 1) {
        PyErr_SetString(PyExc_ValueError, "more than 2**32 elements need gaps of 8 bytes");
        goto done;
    }
    d.capacity = gaps_view.len / gap_size;
    if (values_view.len / element_size < d.capacity) {
        d.capacity = values_view.len / element_size;
    }
    /* ``last`` is a changed index before ``start`` (0 before the first): a gap never wraps. */
    if (written < 0 || written > d.capacity || last > (unsigned long long)start) {
        PyErr_Format(PyExc_ValueError, "written %zd or last %llu is out of range", written, last);
        goto done;
    }
    d.old_bytes = old_view.buf;
    d.new_bytes = new_view.buf;
    d.gaps = gaps_view.buf;
    d.values = values_view.buf;
    d.gap_size = gap_size;
    d.written = written;
    d.last = last;
    d.widest = 0;
    position = start;
    if (start < stop && written < d.capacity) {
        /* The views keep the buffers alive and their memory in place while other threads run:
         * the server diffs tensors on a thread pool. */
        Py_BEGIN_ALLOW_THREADS
        switch (element_size) {
        case 1: position = scan_1(&d, start, stop); break;
        case 2: position = scan_2(&d, start, stop); break;
        case 4: position = scan_4(&d, start, stop); break;
        default: position = scan_8(&d, start, stop); break;
        }
        Py_END_ALLOW_THREADS
    }
    result = Py_BuildValue("(nnKK)", d.written, position, (unsigned long long)d.last,
                           (unsigned long long)d.widest);
done:
    if (values_view.obj) {
        PyBuffer_Release(&values_view);
    }
    if (gaps_view.obj) {
        PyBuffer_Release(&gaps_view);
    }
    if (new_view.obj) {
        PyBuffer_Release(&new_view);
    }
    if (old_view.obj) {
        PyBuffer_Release(&old_view);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"diff", (PyCFunction)(void (*)(void))diff, METH_FASTCALL, diff_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_GIL_DISABLED
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "weightserve.client.wire._diffnative",
    "One-pass diff of two tensors' bytes for client/wire/delta_plan.py.",
    0,
    methods,
    slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__diffnative(void)
{
    return PyModuleDef_Init(&module_def);
}
