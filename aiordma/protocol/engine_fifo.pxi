# The engine's per-message queues (included by engine.pyx).


@cython.final
cdef class Fifo:
    """A first-in first-out queue: the send queues of a connection and its queue of
    received messages.

    A ring over a Python list whose length (the capacity) is a power of two; empty
    places hold None, and the garbage collector sees every item through the list. The
    engine appends, pops and peeks with C calls and tests emptiness on the C field
    ``n``, where a ``collections.deque`` cost a method call each. Python callers get
    deque's interface for what they use: ``append``, ``extend``, ``popleft``, ``q[i]``
    (negative ``i`` from the end), ``len``, truth, iteration (over a snapshot: the
    queue may change meanwhile), ``remove`` (the first item equal to the value;
    ValueError when none is) and ``clear``. ``popleft`` and ``q[i]`` raise IndexError
    as deque's do."""

    def __cinit__(self):
        self._items = [None] * 8
        self._head = 0
        self.n = 0

    cdef int push_c(self, object obj) except -1:
        cdef Py_ssize_t cap = len(self._items)
        if self.n == cap:
            self._rebuild(self._snapshot(), 2 * cap)
            cap = 2 * cap
        self._items[(self._head + self.n) & (cap - 1)] = obj
        self.n += 1
        return 0

    cdef object pop_c(self):
        if self.n == 0:
            raise IndexError("pop from an empty queue")
        cdef Py_ssize_t head = self._head
        obj = self._items[head]
        self._items[head] = None
        self._head = (head + 1) & (len(self._items) - 1)
        self.n -= 1
        return obj

    cdef object head_c(self):
        if self.n == 0:
            raise IndexError("the queue is empty")
        return self._items[self._head]

    cdef list _snapshot(self):
        cdef Py_ssize_t i, mask = len(self._items) - 1
        return [self._items[(self._head + i) & mask] for i in range(self.n)]

    cdef int _rebuild(self, list items, Py_ssize_t cap) except -1:
        """Hold ``items`` from place 0 in a list of ``cap`` places (a power of two)."""
        self._items = items + [None] * (cap - len(items))
        self._head = 0
        self.n = len(items)
        return 0

    def append(self, obj):
        """Add ``obj`` at the end."""
        self.push_c(obj)

    def extend(self, items):
        """Add each of ``items`` at the end, in order."""
        for obj in items:
            self.push_c(obj)

    def popleft(self):
        """Remove and return the first item; IndexError when empty."""
        return self.pop_c()

    def remove(self, value):
        """Remove the first item equal to ``value``; ValueError when none is."""
        items = self._snapshot()
        items.remove(value)
        self._rebuild(items, len(self._items))

    def clear(self):
        """Remove every item."""
        self._rebuild([], 8)

    def __len__(self):
        return self.n

    def __bool__(self):
        return self.n != 0

    def __getitem__(self, Py_ssize_t i):
        if i < 0:
            i += self.n
        if i < 0 or i >= self.n:
            raise IndexError("queue index out of range")
        return self._items[(self._head + i) & (len(self._items) - 1)]

    def __iter__(self):
        return iter(self._snapshot())

    def __repr__(self):
        return f"Fifo({self._snapshot()!r})"
