/* Socket loops that run with the GIL released from start to end: client/transports/http1.py's
 * large body reads, and the HTTP server's direct writes of a chunk
 * (service/transports/http/streaming.py).
 *
 * A body read in Python gives up the GIL and takes it back at every receive and at every poll
 * before one, about ten times per 8 MiB chunk. With two streams per load, each of those
 * re-takes waits on the other stream's thread, and the hand-overs cost the client about its
 * whole gap to a raw reader (docs/performance.md, "sendfile or a copy, on a third host").
 * ``recv_into_all`` receives a whole chunk's bytes in one call, keeping the connection's
 * low-water mark as http1.py does, and the bytes that follow the chunk (the next chunk's
 * framing) land in a second buffer in the same receive. ``writev_all`` and ``sendfile_all``
 * (Linux only) are the server's side: a chunk written whole, waiting on a full socket in
 * between, in one call. Only POSIX sockets and the CPython C API; socket_loops.py says whether
 * it was built, and the callers run the same loops in Python where it was not.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <sys/socket.h>
#ifdef __linux__
#include <sys/sendfile.h> /* Linux's sendfile; other systems' differs, and they go without */
#endif
#include <sys/uio.h>

/* What ``recv_loop`` ended on. */
enum { RECV_FILLED, RECV_CLOSED, RECV_TIMED_OUT, RECV_ERROR, RECV_INTERRUPTED };

typedef struct {
    int fd;
    char *data;           /* the destination: filled before anything goes to spill */
    Py_ssize_t left;      /* of data */
    char *spill;          /* where bytes past data go (may be NULL) */
    Py_ssize_t spill_len;
    Py_ssize_t spilled;
    int timeout_ms;       /* no byte for this long: timed out; negative: wait forever */
    int patience_ms;      /* how long a wait for the mark lasts before taking what comes */
    int mark;             /* low-water mark for large reads; 0: marks are not used */
    int current;          /* the mark set on the socket now */
    int error;            /* errno, for RECV_ERROR */
} Recv;

/* An int argument (PyLong_AsInt is 3.13's). */
static int
as_int(PyObject *value, int *out)
{
    long v = PyLong_AsLong(value);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < INT_MIN || v > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "an argument does not fit in an int");
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int
set_lowat(Recv *r, int bytes)
{
    if (setsockopt(r->fd, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof bytes) == 0) {
        r->current = bytes;
        return 0;
    }
    /* A kernel or sandbox without it: wake for any bytes, and ask no mark again. */
    bytes = 1;
    (void)setsockopt(r->fd, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof bytes);
    r->current = 1;
    r->mark = 0;
    return -1;
}

/* The outcome of a poll or receive that failed with errno. */
static int
recv_failed(Recv *r)
{
    if (errno == EINTR) {
        return RECV_INTERRUPTED;
    }
    r->error = errno;
    return RECV_ERROR;
}

/* Runs without the GIL. Waits before every receive: a receive straight after another would
 * take the few segments that came in between and undo what the mark is for. */
static int
recv_loop(Recv *r)
{
    while (r->left > 0) {
        if (r->mark) {
            /* Never wait for more than the peer owes: the rest of this body at least. */
            int want = r->left < r->mark ? (int)r->left : r->mark;
            if (want != r->current) {
                set_lowat(r, want);
            }
        }
        struct pollfd pfd = {r->fd, POLLIN, 0};
        int patient = r->current > 1 && r->patience_ms >= 0 &&
                      (r->timeout_ms < 0 || r->patience_ms < r->timeout_ms);
        int ready = poll(&pfd, 1, patient ? r->patience_ms : r->timeout_ms);
        if (ready < 0) {
            return recv_failed(r);
        }
        if (ready == 0) {
            if (!patient) {
                return RECV_TIMED_OUT;
            }
            /* The mark did not fill in its time: this receive takes what comes. Bytes queued
             * short of it (a slow sender, a kernel that cannot grow the buffer to the mark)
             * turn marks off for the connection, as in http1.py. */
            set_lowat(r, 1);
            pfd.revents = 0;
            if (poll(&pfd, 1, 0) > 0) {
                r->mark = 0;
            }
            else {
                /* The patience spent counts toward "no byte for timeout_ms". */
                pfd.revents = 0;
                ready = poll(&pfd, 1, r->timeout_ms < 0 ? -1 : r->timeout_ms - r->patience_ms);
                if (ready == 0) {
                    return RECV_TIMED_OUT;
                }
                if (ready < 0) {
                    return recv_failed(r);
                }
            }
        }
        struct iovec parts[2] = {{r->data, (size_t)r->left}, {r->spill, (size_t)r->spill_len}};
        struct msghdr message = {0};
        message.msg_iov = parts;
        message.msg_iovlen = r->spill_len > 0 ? 2 : 1;
        ssize_t n = recvmsg(r->fd, &message, MSG_DONTWAIT);
        if (n > 0) {
            if (n > r->left) {
                r->spilled = n - r->left;
                n = r->left;
            }
            r->data += n;
            r->left -= n;
            continue;
        }
        if (n == 0) {
            return RECV_CLOSED;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            continue; /* a spurious wake-up */
        }
        return recv_failed(r);
    }
    return RECV_FILLED;
}

PyDoc_STRVAR(recv_into_all_doc,
"recv_into_all(fd, data, spill, timeout_ms, mark, current, patience_ms)\n"
"    -> (received, spilled, mark, current)\n"
"\n"
"Receive from socket ``fd`` until the writable buffer ``data`` is full or the peer closes,\n"
"with the GIL released throughout. Bytes arriving after ``data`` is full, in the same\n"
"receive, go to ``spill`` (a writable buffer, may be empty): ``spilled`` of them.\n"
"Each wait lasts at most ``timeout_ms`` (negative: no limit), else TimeoutError.\n"
"``mark``: the low-water mark for large reads (0: none used on this socket); ``current``:\n"
"the mark set on the socket now. Each wait asks for the mark, or for what ``data`` still\n"
"needs if less; a mark not reached in ``patience_ms`` is dropped for that read, and for\n"
"the connection (``mark`` 0 on return) where bytes came short of it. ``received`` is less\n"
"than ``len(data)`` where the peer closed, or where a wait timed out or the socket failed\n"
"after some bytes came (the next read then meets the error, as with recv).");

static PyObject *
recv_into_all(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer data_view = {0};
    Py_buffer spill_view = {0};
    PyObject *result = NULL;
    Recv r = {0};
    int timeout_ms, mark, current, patience_ms, outcome;
    Py_ssize_t total;

    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "recv_into_all takes 7 arguments");
        return NULL;
    }
    if (as_int(args[0], &r.fd) < 0 || as_int(args[3], &timeout_ms) < 0 ||
        as_int(args[4], &mark) < 0 || as_int(args[5], &current) < 0 ||
        as_int(args[6], &patience_ms) < 0) {
        return NULL;
    }
    if (r.fd < 0 || mark < 0 || current < 0) {
        PyErr_SetString(PyExc_ValueError, "fd, mark and current must not be negative");
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &data_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &spill_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        goto done;
    }
    r.data = data_view.buf;
    r.left = total = data_view.len;
    r.spill = spill_view.buf;
    r.spill_len = spill_view.len;
    r.timeout_ms = timeout_ms;
    r.patience_ms = patience_ms;
    r.mark = mark;
    r.current = current;
    for (;;) {
        /* The views hold both buffers in place while the GIL is released. */
        Py_BEGIN_ALLOW_THREADS
        outcome = recv_loop(&r);
        Py_END_ALLOW_THREADS
        if (outcome != RECV_INTERRUPTED) {
            break;
        }
        /* A signal: its Python handler runs now (Ctrl-C raises here), then the read goes on. */
        if (PyErr_CheckSignals() < 0) {
            goto done;
        }
    }
    if ((outcome == RECV_TIMED_OUT || outcome == RECV_ERROR) && r.left < total) {
        /* As recv does: the bytes that came are returned, the next read meets the error. */
        outcome = RECV_CLOSED;
    }
    if (outcome == RECV_TIMED_OUT) {
        PyErr_SetString(PyExc_TimeoutError, "timed out");
        goto done;
    }
    if (outcome == RECV_ERROR) {
        errno = r.error;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_BuildValue("(nnii)", total - r.left, r.spilled, r.mark, r.current);
done:
    if (spill_view.obj) {
        PyBuffer_Release(&spill_view);
    }
    PyBuffer_Release(&data_view);
    return result;
}


/* What the write loops return besides bytes written: 0 done, or one of these, or an errno. */
#define WRITE_TIMED_OUT (-1)
#define WRITE_FILE_ENDED (-2)
#define WRITE_INTERRUPTED (-3)
/* Parts writev_all takes in one call (the server passes three: padding, framing, data). */
#define MAX_PARTS 16

/* Without the GIL: wait until the socket takes more, at most idle_ms. */
static int
wait_writable(int fd, int idle_ms)
{
    struct pollfd pfd = {fd, POLLOUT, 0};
    int ready = poll(&pfd, 1, idle_ms);
    if (ready > 0) {
        return 0; /* writable, or failed: the next write says which */
    }
    if (ready == 0) {
        return WRITE_TIMED_OUT;
    }
    return errno == EINTR ? WRITE_INTERRUPTED : errno;
}

/* After a write failed with errno: 0 to write again (the socket had no room and has some
 * now), else the loop's outcome. */
static int
after_failed_write(int fd, int idle_ms)
{
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return wait_writable(fd, idle_ms);
    }
    return errno == EINTR ? WRITE_INTERRUPTED : errno;
}

static int
writev_loop(int fd, struct iovec *parts, int count, int idle_ms, Py_ssize_t *written)
{
    while (count > 0) {
        ssize_t n = writev(fd, parts, count);
        if (n < 0) {
            int outcome = after_failed_write(fd, idle_ms);
            if (outcome) {
                return outcome;
            }
            continue;
        }
        *written += n;
        while (count > 0 && (size_t)n >= parts->iov_len) {
            n -= (ssize_t)parts->iov_len;
            parts++;
            count--;
        }
        if (count > 0) {
            parts->iov_base = (char *)parts->iov_base + n;
            parts->iov_len -= (size_t)n;
        }
    }
    return 0;
}

PyDoc_STRVAR(writev_all_doc,
"writev_all(fd, parts, idle_ms) -> (written, outcome)\n"
"\n"
"Write every byte of ``parts`` (a list of at most 16 buffers) to non-blocking socket ``fd``\n"
"with writev, waiting for room while it is full, with the GIL released throughout.\n"
"``outcome``: 0 when all went; -1 when the socket took nothing for ``idle_ms``; else the\n"
"errno of the write that failed. ``written`` counts the bytes that went either way.");

static PyObject *
writev_all(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer views[MAX_PARTS];
    struct iovec parts[MAX_PARTS];
    Py_ssize_t count = 0, written = 0, i;
    PyObject *seq = NULL, *result = NULL;
    int fd, idle_ms, outcome;

    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "writev_all takes 3 arguments");
        return NULL;
    }
    if (as_int(args[0], &fd) < 0 || as_int(args[2], &idle_ms) < 0) {
        return NULL;
    }
    seq = PySequence_Fast(args[1], "parts must be a sequence of buffers");
    if (seq == NULL) {
        return NULL;
    }
    if (PySequence_Fast_GET_SIZE(seq) > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "at most %d parts", MAX_PARTS);
        goto done;
    }
    for (i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &views[count],
                               PyBUF_C_CONTIGUOUS) < 0) {
            goto done;
        }
        parts[count].iov_base = views[count].buf;
        parts[count].iov_len = (size_t)views[count].len;
        count++;
    }
    for (;;) {
        /* The views hold every part in place while the GIL is released. */
        Py_BEGIN_ALLOW_THREADS
        outcome = writev_loop(fd, parts, (int)count, idle_ms, &written);
        Py_END_ALLOW_THREADS
        if (outcome != WRITE_INTERRUPTED) {
            break;
        }
        if (PyErr_CheckSignals() < 0) {
            goto done;
        }
        /* Resume where the loop stopped: skip the parts already written. */
        {
            Py_ssize_t skip = written, k;
            for (k = 0; k < count; k++) {
                size_t whole = (size_t)views[k].len;
                if ((size_t)skip >= whole) {
                    parts[k].iov_base = views[k].buf;
                    parts[k].iov_len = 0;
                    skip -= (Py_ssize_t)whole;
                }
                else {
                    parts[k].iov_base = (char *)views[k].buf + skip;
                    parts[k].iov_len = whole - (size_t)skip;
                    skip = 0;
                }
            }
        }
    }
    result = Py_BuildValue("(ni)", written, outcome);
done:
    for (i = 0; i < count; i++) {
        PyBuffer_Release(&views[i]);
    }
    Py_DECREF(seq);
    return result;
}

#ifdef __linux__
static int
sendfile_loop(int fd, int file_fd, off_t *offset, Py_ssize_t *left, int idle_ms)
{
    while (*left > 0) {
        ssize_t n = sendfile(fd, file_fd, offset, (size_t)*left);
        if (n > 0) {
            *left -= n; /* sendfile moved the offset */
            continue;
        }
        if (n == 0) {
            return WRITE_FILE_ENDED;
        }
        int outcome = after_failed_write(fd, idle_ms);
        if (outcome) {
            return outcome;
        }
    }
    return 0;
}

PyDoc_STRVAR(sendfile_all_doc,
"sendfile_all(fd, file_fd, offset, count, idle_ms) -> (sent, outcome)\n"
"\n"
"Send ``count`` bytes of file ``file_fd`` from ``offset`` to non-blocking socket ``fd``\n"
"with sendfile, waiting for room while it is full, with the GIL released throughout.\n"
"``outcome``: 0 when all went; -1 when the socket took nothing for ``idle_ms``; -2 when\n"
"the file ended first (truncated); else the errno of the sendfile that failed. ``sent``\n"
"counts the bytes that went either way.");

static PyObject *
sendfile_all(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int fd, file_fd, idle_ms, outcome;
    long long offset_arg, count_arg;
    off_t offset;
    Py_ssize_t left;

    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "sendfile_all takes 5 arguments");
        return NULL;
    }
    if (as_int(args[0], &fd) < 0 || as_int(args[1], &file_fd) < 0 ||
        as_int(args[4], &idle_ms) < 0) {
        return NULL;
    }
    offset_arg = PyLong_AsLongLong(args[2]);
    count_arg = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (offset_arg < 0 || count_arg < 0) {
        PyErr_SetString(PyExc_ValueError, "offset and count must not be negative");
        return NULL;
    }
    offset = (off_t)offset_arg;
    left = (Py_ssize_t)count_arg;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        outcome = sendfile_loop(fd, file_fd, &offset, &left, idle_ms);
        Py_END_ALLOW_THREADS
        if (outcome != WRITE_INTERRUPTED) {
            break;
        }
        if (PyErr_CheckSignals() < 0) {
            return NULL;
        }
    }
    return Py_BuildValue("(ni)", (Py_ssize_t)count_arg - left, outcome);
}
#endif /* __linux__ */

static PyMethodDef methods[] = {
    {"recv_into_all", (PyCFunction)(void (*)(void))recv_into_all, METH_FASTCALL,
     recv_into_all_doc},
    {"writev_all", (PyCFunction)(void (*)(void))writev_all, METH_FASTCALL, writev_all_doc},
#ifdef __linux__
    {"sendfile_all", (PyCFunction)(void (*)(void))sendfile_all, METH_FASTCALL,
     sendfile_all_doc},
#endif
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
    "weightserve.client.wire._socketio",
    "Socket loops with the GIL released throughout (client/wire/socket_loops.py).",
    0,
    methods,
    slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__socketio(void)
{
    return PyModuleDef_Init(&module_def);
}
