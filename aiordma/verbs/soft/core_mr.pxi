# Memory regions and the device's key table (included by _core.pyx).

from ..buffers import PinnedBuffer


cdef class SoftMR:
    """A registered memory region of the soft device (``api.MR``).

    Its memory stays pinned (``buffers.PinnedBuffer``) until ``close()`` and, past it,
    while work requests or a payload in progress still refer to it (``users``): a
    closed region can be named by no new request (its key is gone), and the ones that
    already hold its memory finish with it, as a NIC finishes the DMA it started."""

    def __init__(self, pd, buffer, access):
        self.pd = pd
        self._pinned = PinnedBuffer(buffer)
        self.view = self._pinned.view
        self.addr = self._pinned.addr
        self.base = <char *><uintptr_t>self.addr
        self.length = self._pinned.length
        self.access = Access(access)
        self.acc = int(self.access)  # plain int: the data path tests bits without enum ops
        self._closed = False
        self.users = 0
        self._release_pending = False
        engine = pd.context._engine
        cdef DeviceLock lock = engine.lock
        lock.acquire_c()
        try:
            self.lkey = self.rkey = (<KeyTable>engine.keys).add(self)
        finally:
            lock.release_c()

    cdef void pin(self) noexcept:
        """One more user of its memory (holds a reference to the region too)."""
        self.users += 1
        Py_INCREF(self)

    cdef void unpin(self):
        """One user less; the last one of a closed region releases its memory."""
        self.users -= 1
        if self.users == 0 and self._release_pending:
            self._release_pending = False
            self._pinned.release()
        Py_DECREF(self)

    def close(self):
        """Deregister (idempotent): its keys name nothing from now on."""
        pd = self.pd
        cdef DeviceLock lock = pd.context._engine.lock
        lock.acquire_c()
        try:
            if self._closed:
                return
            self._closed = True
            (<KeyTable>pd.context._engine.keys).remove(self.lkey)
            pd._mrs.discard(self)
            if self.users:
                self._release_pending = True  # the last unpin releases it
                return
        finally:
            lock.release_c()
        self._pinned.release()

    def __repr__(self):
        return (f"<SoftMR addr={self.addr:#x} length={self.length} lkey={self.lkey:#x} "
                f"access={self.access!r}>")


api.MR.register(SoftMR)


cdef class KeyTable:
    """The device's live lkeys/rkeys (one key serves as both), each drawn from its PD's
    ``KeyStream`` (keys.py: unpredictable, never repeated within the PD)."""

    def __init__(self):
        self._by_key = {}
        memset(self._ckey, 0, sizeof(self._ckey))  # 0 is no key: every slot empty

    def add(self, SoftMR mr):
        stream = mr.pd._keys
        while True:
            key = stream.next()
            if key and key not in self._by_key:  # 0 is no key; another PD's live one
                self._by_key[key] = mr
                return key

    def remove(self, key):
        cdef uint32_t k = key
        cdef int i = k & (KEY_CACHE - 1)
        if self._ckey[i] == k:
            self._ckey[i] = 0
        self._by_key.pop(key, None)

    def get(self, key):
        return self._by_key.get(key)

    cdef SoftMR lookup(self, uint32_t key):
        """The MR of ``key`` (None: no such key). The data path's: a key seen lately
        is found in the cache, without a dict lookup."""
        cdef int i = key & (KEY_CACHE - 1)
        if key and self._ckey[i] == key:
            return <SoftMR>self._cmr[i]
        mr = self._by_key.get(key)
        if mr is not None:
            self._ckey[i] = key
            self._cmr[i] = <PyObject *>mr
        return <SoftMR>mr
