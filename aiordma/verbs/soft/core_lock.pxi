# The device lock and the pipe flag (included by _core.pyx).


cdef class DeviceLock:
    """The device lock: one per soft device, protecting every QP, CQ, MR and connection
    (engine.py: Locking). A plain, non-reentrant lock with ``threading.Lock``'s Python
    interface (``acquire``, ``release``, ``locked``, ``with``); the data path takes it
    with a C call. A blocking acquire releases the GIL while it waits (the holder may
    need the GIL to finish).

    A POSIX semaphore of one unit, as CPython's own lock is on Linux, taken with
    ``sem_trywait``/``sem_post`` directly: an uncontended acquire and release cost a
    few dozen instructions, where ``PyThread_acquire_lock`` adds its timeout
    arithmetic to each of the three or so the data path makes per message. Like
    CPython's lock (and unlike a mutex) it may be released by another thread than
    the one that took it."""

    def __cinit__(self):
        if sem_init(&self._sem, 0, 1) != 0:
            raise OSError(errno, "sem_init failed")
        self._ready = True

    def __dealloc__(self):
        if self._ready:
            sem_destroy(&self._sem)

    cdef int acquire_c(self) except -1:
        if sem_trywait(&self._sem) == 0:
            return 0
        with nogil:
            while sem_wait(&self._sem) != 0:
                if errno != EINTR:  # (EINTR: a signal came; EINVAL cannot, it is ours)
                    break
        return 0

    cdef void release_c(self) noexcept:
        sem_post(&self._sem)

    def acquire(self, blocking=True, timeout=-1):
        """Take the lock; returns True, or False when ``blocking`` is false and it is
        held (``timeout`` is not supported: only -1)."""
        if timeout != -1:
            raise ValueError("DeviceLock.acquire takes no timeout")
        if not blocking:
            return sem_trywait(&self._sem) == 0
        self.acquire_c()
        return True

    def release(self):
        sem_post(&self._sem)

    def locked(self):
        """True while somebody holds the lock."""
        if sem_trywait(&self._sem) == 0:
            sem_post(&self._sem)
            return False
        return True

    def __enter__(self):
        self.acquire_c()
        return True

    def __exit__(self, *exc):
        sem_post(&self._sem)
        return False


cdef class PipeFlag:
    """``fd`` is readable exactly while the flag is raised (a non-blocking pipe holding
    at most one byte). Callers serialise ``raise_``/``lower`` themselves (the device
    lock)."""

    def __cinit__(self):
        cdef int fds[2]
        if pipe2(fds, O_NONBLOCK | O_CLOEXEC) != 0:
            raise OSError(errno, "pipe2 failed")
        self.fd = fds[0]
        self._wfd = fds[1]
        self._up = False

    cdef void raise_c(self) noexcept:
        cdef char one = 1
        if not self._up and self._wfd >= 0:
            self._up = True
            write(self._wfd, &one, 1)  # (cannot fill with one byte)

    cdef void lower_c(self) noexcept:
        cdef char buf[16]
        if self._up:
            self._up = False
            read(self.fd, buf, sizeof(buf))  # one read: the pipe holds at most one byte

    def raise_(self):
        self.raise_c()

    def lower(self):
        self.lower_c()

    def close(self):
        if self.fd >= 0:
            close(self.fd)
        if self._wfd >= 0:
            close(self._wfd)
        self.fd = self._wfd = -1

    def __dealloc__(self):
        if self.fd >= 0:
            close(self.fd)
        if self._wfd >= 0:
            close(self._wfd)
