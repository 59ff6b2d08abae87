# The device lock and the pipe flag (included by _core.pyx).


cdef class DeviceLock:
    """The device lock: one per soft device, protecting every QP, CQ, MR and connection
    (engine.py: Locking). A plain, non-reentrant lock with ``threading.Lock``'s Python
    interface (``acquire``, ``release``, ``locked``, ``with``); the data path takes it
    with a C call. A blocking acquire releases the GIL while it waits (the holder may
    need the GIL to finish)."""

    def __cinit__(self):
        self._lock = PyThread_allocate_lock()
        if self._lock == NULL:
            raise MemoryError()

    def __dealloc__(self):
        if self._lock != NULL:
            PyThread_free_lock(self._lock)

    cdef int acquire_c(self) except -1:
        if PyThread_acquire_lock(self._lock, NOWAIT_LOCK):
            return 0
        with nogil:
            PyThread_acquire_lock(self._lock, WAIT_LOCK)
        return 0

    cdef void release_c(self) noexcept:
        PyThread_release_lock(self._lock)

    def acquire(self, blocking=True, timeout=-1):
        """Take the lock; returns True, or False when ``blocking`` is false and it is
        held (``timeout`` is not supported: only -1)."""
        if timeout != -1:
            raise ValueError("DeviceLock.acquire takes no timeout")
        if not blocking:
            return bool(PyThread_acquire_lock(self._lock, NOWAIT_LOCK))
        self.acquire_c()
        return True

    def release(self):
        PyThread_release_lock(self._lock)

    def locked(self):
        """True while somebody holds the lock."""
        if PyThread_acquire_lock(self._lock, NOWAIT_LOCK):
            PyThread_release_lock(self._lock)
            return False
        return True

    def __enter__(self):
        self.acquire_c()
        return True

    def __exit__(self, *exc):
        PyThread_release_lock(self._lock)
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
