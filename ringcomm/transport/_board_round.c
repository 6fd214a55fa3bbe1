/* The shared board's one-shot round (``Board.round_whole``) in C: the post, the quick wait
 * for each peer's post, the header's check and the fold of the commonest dtypes and ops.
 *
 * Why: at a few bytes the round is all fixed cost, and in Python it is a few microseconds
 * of interpreted steps per call, about a quarter of a small allreduce through torch. Here
 * it is a few hundred nanoseconds. It does only what cannot go wrong quietly: whenever a
 * step needs more than the fast case (a peer still behind after the quick wait, a header
 * that differs, a fold this file does not do, a peer asleep that must be woken), it stops
 * and says where, and ``Board.round_whole`` goes on from there in Python, which waits,
 * raises and folds as it always does. The protocol and the layout are board.py's; this
 * file reads and writes the same memory with the same orders.
 *
 * round_whole(board, rank, world_size, number, header, data, takes, op, turns, wakes_by_flag)
 *   board       the board's memory (a writable buffer), rank's view of it
 *   number      the posts this rank has made (``Board.number``)
 *   header      the post's header (bytes of HEADER_SIZE)
 *   data        the op's 1-d contiguous array, posted, then reduced into or copied over
 *   takes       ((peer, does, final), ...): ``WholeTake``s, as board.py's (``does``: 0 copy,
 *               1 fold the post in after the data, 2 before it)
 *   op          ``ReduceOp.code`` of the reduction, or -1 for none
 *   turns       how many times to yield the core while waiting for a post before giving
 *               the wait back (0: give it back at once)
 *   wakes_by_flag  a sleeping peer raises its flag (else: every post must wake the peers)
 * returns -1 when it did nothing (a peer has not taken this rank's last post yet, or the
 * call is not one it takes: Python does the whole round), else ``(first << 1) | ring``:
 * the post is made (number + 1), ``ring`` says the peers must be woken now, and the takes
 * from ``first`` on are left to do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <fenv.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#if !PY_LITTLE_ENDIAN
#error "the board's counts are little-endian words (board.py's struct '<Q')"
#endif
#if defined(__FAST_MATH__) || (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__)
#error "the folds must keep IEEE arithmetic (NaN checks, numpy's bits): build without fast-math"
#endif

#define LINE 64
#define SLOT_BYTES (1 << 20)
#define SLOT (LINE + SLOT_BYTES)
#define RANK_BYTES (LINE + 2 * SLOT)
#define HEADER_SIZE 56
#define MAX_TAKES 256
/* The largest take this file folds itself: above it numpy's vectorised loops (AVX, chosen
 * at run time) fold faster than this file's, built for the baseline x86-64 (SSE2), and the
 * call's fixed cost no longer matters. Measured, a round of two ranks' float32 sum in one
 * process: 8 B 1.2 us here against 4.2 us in Python, 8 KiB 4.1 against 5.5, but 16 KiB
 * folded here 7.7 against 6.8, and 256 KiB 57 against 31. */
#define FOLD_MAX_BYTES (8 << 10)

enum { OP_SUM = 0, OP_PROD = 1, OP_MIN = 2, OP_MAX = 3, OP_AVG = 4, OP_BAND = 5,
       OP_BOR = 6, OP_BXOR = 7 };

static inline uint64_t load_count(const char *at)
{
    return __atomic_load_n((const uint64_t *)at, __ATOMIC_ACQUIRE);
}

/* Whether ``peer`` has made ``number`` posts, yielding the core up to ``turns`` times
 * while it has not (the GIL let go meanwhile, as ``os.sched_yield`` does). */
static int posted_by(const char *mem, long peer, uint64_t number, int turns)
{
    const char *count = mem + (size_t)peer * RANK_BYTES;
    int seen = load_count(count) >= number;
    if (seen || turns <= 0)
        return seen;
    Py_BEGIN_ALLOW_THREADS
    for (int turn = 0; turn < turns && !seen; turn++) {
        sched_yield();
        seen = load_count(count) >= number;
    }
    Py_END_ALLOW_THREADS
    return seen;
}

/* Elementwise ``a = a (op) b``, or ``a = b (op) a`` (``FOLD_BEFORE``): the same, as
 * numpy's ufunc would give them, bit for bit. Integers wrap (done on their unsigned twins,
 * where C defines the wrap), and their folds are symmetric in their bits. Floats only sum
 * and multiply (numpy's min and max choose among NaNs in ways not worth copying), and a
 * float fold's bits depend on the order of its operands only where both are NaNs (x86
 * keeps the first one's, as numpy does, but the compiler may swap a sum's operands): where
 * ``a`` holds no NaN (a first pass looks) no element holds two, and where it does the fold
 * is left to numpy. So is a fold that raises a floating-point exception (an overflow, an
 * invalid operation...): the data is put back as it was, and numpy does the fold and
 * warns, raises or ignores as its error state says, as it would without this file. */
#define FOLD_EXCEPTIONS (FE_OVERFLOW | FE_INVALID | FE_DIVBYZERO | FE_UNDERFLOW)
#define FOLD_FLOAT(T, n, a, b, op)                                                         \
    do {                                                                                   \
        T *x = (T *)(a);                                                                   \
        const T *y = (const T *)(b);                                                       \
        T kept[FOLD_MAX_BYTES / sizeof(T)];                                                \
        int nan = 0;                                                                       \
        for (Py_ssize_t i = 0; i < (n); i++) nan |= x[i] != x[i];                         \
        if (nan)                                                                           \
            return 0;                                                                      \
        memcpy(kept, x, (size_t)(n) * sizeof(T));                                          \
        fenv_t outer;                                                                      \
        feholdexcept(&outer);  /* the caller's flags kept aside, ours cleared */          \
        if ((op) == OP_SUM)                                                                \
            for (Py_ssize_t i = 0; i < (n); i++) x[i] = x[i] + y[i];                      \
        else                                                                               \
            for (Py_ssize_t i = 0; i < (n); i++) x[i] = x[i] * y[i];                      \
        const int raised = fetestexcept(FOLD_EXCEPTIONS);                                  \
        fesetenv(&outer);                                                                  \
        if (raised) {                                                                      \
            memcpy(x, kept, (size_t)(n) * sizeof(T));                                      \
            return 0;                                                                      \
        }                                                                                  \
    } while (0)

#define FOLD_INT(S, U, n, a, b, op)                                                        \
    do {                                                                                   \
        U *x = (U *)(a);                                                                   \
        const U *y = (const U *)(b);                                                       \
        S *sx = (S *)(a);                                                                  \
        const S *sy = (const S *)(b);                                                      \
        switch (op) {                                                                      \
        case OP_SUM: for (Py_ssize_t i = 0; i < (n); i++) x[i] = (U)(x[i] + y[i]); break;  \
        case OP_PROD: /* widened first: a narrow type's product would overflow int */     \
            for (Py_ssize_t i = 0; i < (n); i++) x[i] = (U)((uint64_t)x[i] * y[i]);        \
            break;                                                                         \
        case OP_MIN: for (Py_ssize_t i = 0; i < (n); i++) if (sy[i] < sx[i]) sx[i] = sy[i]; \
            break;                                                                         \
        case OP_MAX: for (Py_ssize_t i = 0; i < (n); i++) if (sy[i] > sx[i]) sx[i] = sy[i]; \
            break;                                                                         \
        case OP_BAND: for (Py_ssize_t i = 0; i < (n); i++) x[i] &= y[i]; break;            \
        case OP_BOR: for (Py_ssize_t i = 0; i < (n); i++) x[i] |= y[i]; break;             \
        case OP_BXOR: for (Py_ssize_t i = 0; i < (n); i++) x[i] ^= y[i]; break;            \
        default: return 0;                                                                 \
        }                                                                                  \
    } while (0)

/* Fold ``b`` into ``a`` (``n`` items of the buffer format ``format``) by ``op``, in
 * either order (``FOLD_FLOAT``); 0 when this file does not do that fold (Python does it).
 * ``avg`` sums, except in the take that completes it, which also divides. */
static int fold(const char *format, int op, int final, char *a, const char *b, Py_ssize_t n)
{
    if (op == OP_AVG) {
        if (final)
            return 0;
        op = OP_SUM;
    }
    if (format == NULL || format[0] == '\0' || format[1] != '\0')
        return 0;  /* not one native-order type code */
    switch (format[0]) {
    case 'f':
        if (op != OP_SUM && op != OP_PROD) return 0;
        FOLD_FLOAT(float, n, a, b, op);
        return 1;
    case 'd':
        if (op != OP_SUM && op != OP_PROD) return 0;
        FOLD_FLOAT(double, n, a, b, op);
        return 1;
    case 'b': FOLD_INT(int8_t, uint8_t, n, a, b, op); return 1;
    case 'B': FOLD_INT(uint8_t, uint8_t, n, a, b, op); return 1;
    case 'h': FOLD_INT(int16_t, uint16_t, n, a, b, op); return 1;
    case 'H': FOLD_INT(uint16_t, uint16_t, n, a, b, op); return 1;
    case 'i': FOLD_INT(int32_t, uint32_t, n, a, b, op); return 1;
    case 'I': FOLD_INT(uint32_t, uint32_t, n, a, b, op); return 1;
    case 'l': case 'q':
        if (sizeof(long) != 8 && format[0] == 'l') return 0;
        FOLD_INT(int64_t, uint64_t, n, a, b, op); return 1;
    case 'L': case 'Q':
        if (sizeof(long) != 8 && format[0] == 'L') return 0;
        FOLD_INT(uint64_t, uint64_t, n, a, b, op); return 1;
    default:
        return 0;
    }
}

enum { TAKE_COPY = 0, TAKE_FOLD = 1, TAKE_FOLD_BEFORE = 2 };  /* board.py's COPY, FOLD... */

typedef struct {
    long peer;
    long does;
    int final;
} Take;

/* The takes' tuple read once, checked before anything is posted; -1 if it is not one this
 * file takes (Python then does the whole round, and raises what is wrong with it). */
static Py_ssize_t read_takes(PyObject *takes, long world_size, Take *out)
{
    if (!PyTuple_Check(takes))
        return -1;
    Py_ssize_t count = PyTuple_GET_SIZE(takes);
    if (count > MAX_TAKES)
        return -1;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *take = PyTuple_GET_ITEM(takes, k);
        if (!PyTuple_Check(take) || PyTuple_GET_SIZE(take) != 3)
            return -1;
        long peer = PyLong_AsLong(PyTuple_GET_ITEM(take, 0));
        long does = PyLong_AsLong(PyTuple_GET_ITEM(take, 1));
        int final = PyObject_IsTrue(PyTuple_GET_ITEM(take, 2));
        if (PyErr_Occurred() || peer < 0 || peer >= world_size || does < TAKE_COPY
                || does > TAKE_FOLD_BEFORE || final < 0) {
            PyErr_Clear();
            return -1;
        }
        out[k] = (Take){peer, does, final};
    }
    return count;
}

static PyObject *round_whole(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "round_whole takes 10 arguments");
        return NULL;
    }
    long rank = PyLong_AsLong(args[1]);
    long world_size = PyLong_AsLong(args[2]);
    unsigned long long number = PyLong_AsUnsignedLongLong(args[3]);
    PyObject *header = args[4];
    long op = PyLong_AsLong(args[7]);
    long turns = PyLong_AsLong(args[8]);
    turns = turns < 0 ? 0 : turns > (1L << 24) ? (1L << 24) : turns;
    int wakes_by_flag = PyObject_IsTrue(args[9]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(header) || PyBytes_GET_SIZE(header) != HEADER_SIZE || rank < 0
            || rank >= world_size || wakes_by_flag < 0)
        return PyLong_FromLong(-1);
    Take takes[MAX_TAKES];
    Py_ssize_t ntakes = read_takes(args[6], world_size, takes);
    if (ntakes < 0)
        return PyLong_FromLong(-1);

    Py_buffer board, data;
    if (PyObject_GetBuffer(args[0], &board, PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[5], &data, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
            < 0) {
        PyBuffer_Release(&board);
        PyErr_Clear();  /* not a buffer this file reads: Python's round takes it */
        return PyLong_FromLong(-1);
    }
    long result = -1;
    char *mem = (char *)board.buf;
    if (board.len < (Py_ssize_t)world_size * RANK_BYTES || data.len > SLOT_BYTES
            || ((uintptr_t)mem & 7) != 0 || data.itemsize <= 0)
        goto done;
    for (long peer = 0; peer < world_size; peer++)  /* every peer took the last post */
        if (peer != rank && !posted_by(mem, peer, number, (int)turns))
            goto done;

    const uint64_t next = number + 1;
    const size_t parity = next % 2;
    char *mine = mem + (size_t)rank * RANK_BYTES;
    char *slot = mine + LINE + parity * SLOT;
    memcpy(slot, PyBytes_AS_STRING(header), HEADER_SIZE);
    memcpy(slot + LINE, data.buf, (size_t)data.len);
    __atomic_store_n((uint64_t *)mine, next, __ATOMIC_RELEASE);  /* last: shows the post */
    int ring = 1;
    if (wakes_by_flag) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* the count is stored before flags load */
        ring = 0;
        for (long peer = 0; peer < world_size && !ring; peer++)
            if (peer != rank && load_count(mem + (size_t)peer * RANK_BYTES + 8))
                ring = 1;
    }
    Py_ssize_t first = 0;
    if (!ring) {
        const Py_ssize_t n = data.len / data.itemsize;
        for (; first < ntakes; first++) {
            const Take take = takes[first];
            const char *theirs = mem + (size_t)take.peer * RANK_BYTES + LINE + parity * SLOT;
            if (!posted_by(mem, take.peer, next, (int)turns)
                    || memcmp(theirs, PyBytes_AS_STRING(header), HEADER_SIZE) != 0)
                break;
            if (take.does == TAKE_COPY)
                memcpy(data.buf, theirs + LINE, (size_t)data.len);
            else if (data.len > FOLD_MAX_BYTES
                     || !fold(data.format, (int)op, take.final, data.buf, theirs + LINE, n))
                break;
        }
    }
    result = ((long)first << 1) | ring;
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&board);
    return PyLong_FromLong(result);
}

static PyMethodDef methods[] = {
    {"round_whole", (PyCFunction)(void (*)(void))round_whole, METH_FASTCALL,
     "The board's one-shot round, as far as its fast case goes (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_board_round",
    "The shared board's one-shot round in C (ringcomm.transport.board).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__board_round(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "LINE", LINE) < 0
            || PyModule_AddIntConstant(m, "SLOT_BYTES", SLOT_BYTES) < 0
            || PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
