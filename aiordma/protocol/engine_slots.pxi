# Fixed-size buffer slots in one memory region: which are free (included by engine.pyx).
#
# The engine's eager buffers (the send frames and the receive buffers) are slots of one
# registered region each; ``Slots`` keeps their bookkeeping over the region's view, its
# address and its key. ``aiordma.memory.SlotPool`` makes and registers the region.


cdef class Slots:
    """``count`` slots of ``slot_size`` bytes in ``view``, the memory at address ``base``
    with local key ``lkey``.

    ``acquire()`` returns a free slot index, or None when none is free; ``release(i)``
    gives slot ``i`` back and raises ValueError when it is not in use. Not thread-safe
    (the loop thread only). Raises ValueError for a non-positive size or count, or a
    view too small for them."""

    def __init__(self, view, base, lkey, int slot_size, int count):
        cdef int i
        cdef Py_buffer buf
        if slot_size <= 0 or count <= 0:
            raise ValueError("slot_size and count must be positive")
        if len(view) < slot_size * count:
            raise ValueError(f"{count} slots of {slot_size} bytes do not fit in {len(view)}")
        if self._free != NULL:
            raise RuntimeError("Slots is initialised once")
        # The address of the view's memory; no export is held (the region's owner must
        # be able to release its view): ``forget_memory()`` before it does.
        PyObject_GetBuffer(view, &buf, PyBUF_SIMPLE)
        self.mem = <unsigned char *>buf.buf
        self._size = buf.len
        PyBuffer_Release(&buf)
        self.view = view
        self.base = base
        self.lkey = lkey
        self.base_addr = base
        self.lkey_c = lkey
        self.slot_size = slot_size
        self.count = count
        self._free = <int *>malloc(count * sizeof(int))
        self._used = <unsigned char *>calloc(count, 1)
        if self._free == NULL or self._used == NULL:
            raise MemoryError()
        for i in range(count):
            self._free[i] = count - 1 - i
        self._nfree = count

    def __dealloc__(self):
        free(self._free)
        free(self._used)

    cdef int acquire_c(self) noexcept:
        cdef int i
        if not self._nfree:
            return -1
        self._nfree -= 1
        i = self._free[self._nfree]
        self._used[i] = 1
        return i

    cdef int release_c(self, int i) except -1:
        if i < 0 or i >= self.count or not self._used[i]:
            raise ValueError(f"slot {i} is not in use")
        self._used[i] = 0
        self._free[self._nfree] = i
        self._nfree += 1
        return 0

    cdef inline unsigned char *ptr(self, int i) noexcept:
        return self.mem + <Py_ssize_t>i * self.slot_size

    def forget_memory(self):
        """The region is about to go: nothing may read or write its memory through
        these slots any more (``bytes_at`` raises ValueError from now on)."""
        self.mem = NULL
        self._size = 0

    @property
    def available(self):
        """How many slots are free."""
        return self._nfree

    def acquire(self):
        cdef int i = self.acquire_c()
        return None if i < 0 else i

    def release(self, int i):
        self.release_c(i)

    def in_use(self, int i):
        return bool(self._used[i])

    def bytes_at(self, Py_ssize_t offset, Py_ssize_t length):
        """A copy of ``length`` bytes at ``offset`` in the region."""
        if offset < 0 or length < 0 or offset + length > self._size:
            raise ValueError("range outside the region (or its memory is gone)")
        return PyBytes_FromStringAndSize(<char *>self.mem + offset, length)

    def addr(self, int i):
        """The address of slot ``i``."""
        return self.base + i * self.slot_size

    def slot(self, int i, length=None):
        """The first ``length`` bytes (default: all) of slot ``i``, a view."""
        off = i * self.slot_size
        return self.view[off: off + (self.slot_size if length is None else length)]

    def __repr__(self):
        return f"<{type(self).__name__} {self.count}x{self.slot_size} free={self._nfree}>"
