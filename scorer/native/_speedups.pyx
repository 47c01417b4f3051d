# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled hot paths of the event → index path (the pure-Python code is the reference).

* `chain_keys` / `chain_keys_bytes`: `BlockHasher.keys` / `keys_from_bytes` for xxh3 (same
  keys: xxh3_64 of each block's tokens as little-endian uint32, seeded by the previous key),
  with the xxHash C library (vendored header, scorer/native/xxhash/) instead of one Python
  call and one bytes slice per block;
* `msgpack_uint32s`: a msgpack array of token ids (a `msgspec.Raw` field of the typed event
  decoder) → `array('I')`, so the decoder never makes one Python int per token;
* `engine_keys`: `apply._engine_keys` for int hashes (h & MASK60) in one C loop;
* `EngineMap`: a worker's engine key → our key map (insertion-ordered like a dict, oldest
  first for eviction), 24-48 bytes per entry instead of a dict entry plus one int object.

Every function raises the same exception classes as the pure code on bad input
(TypeError / OverflowError), so callers count the same outcomes.
"""

from cpython.array cimport array, clone
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.array cimport resize_smart
from cpython.dict cimport PyDict_Contains, PyDict_GetItemWithError, PyDict_Next, PyDict_Size
from cpython.list cimport PyList_Append, PyList_GET_SIZE
from cpython.long cimport PyLong_AsUnsignedLongLongMask, PyLong_Check, PyLong_FromUnsignedLongLong
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.object cimport PyObject
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

cdef extern from *:
    """
    #define XXH_INLINE_ALL
    #include "xxhash.h"
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    #define KV_BIG_ENDIAN 1
    #else
    #define KV_BIG_ENDIAN 0
    #endif
    static inline uint64_t kv_be32(const uint8_t* p) {
        uint32_t x; memcpy(&x, p, 4);
    #if KV_BIG_ENDIAN
        return x;
    #else
        return __builtin_bswap32(x);
    #endif
    }
    static inline uint64_t kv_be64(const uint8_t* p) {
        uint64_t x; memcpy(&x, p, 8);
    #if KV_BIG_ENDIAN
        return x;
    #else
        return __builtin_bswap64(x);
    #endif
    }
    static inline uint32_t kv_le32(uint32_t x) {
    #if KV_BIG_ENDIAN
        return __builtin_bswap32(x);
    #else
        return x;
    #endif
    }
    /* The first `total` items of a list as little-endian uint32 (what array('I') takes:
       ints and __index__ objects; TypeError / OverflowError otherwise). */
    static int kv_fill_u32(PyObject* list, Py_ssize_t total, uint32_t* buf) {
        for (Py_ssize_t i = 0; i < total; i++) {
            if (i >= PyList_GET_SIZE(list)) {  /* an __index__ method shrank the list */
                PyErr_SetString(PyExc_ValueError, "token list changed while hashing");
                return -1;
            }
            PyObject* v = PyList_GET_ITEM(list, i);
            unsigned long x;
            if (PyLong_Check(v)) {
                x = PyLong_AsUnsignedLong(v);
            } else {
                PyObject* iv = PyNumber_Index(v);
                if (iv == NULL) return -1;
                x = PyLong_AsUnsignedLong(iv);
                Py_DECREF(iv);
            }
            if (x == (unsigned long)-1 && PyErr_Occurred()) return -1;
            if (x > 0xFFFFFFFFUL) {
                PyErr_SetString(PyExc_OverflowError, "token id out of the uint32 range");
                return -1;
            }
            buf[i] = kv_le32((uint32_t)x);
        }
        return 0;
    }
    /* k as uint64 when it is an int in [0, 2**64 - 1) (UINT64_MAX is the dead mark):
       1, else 0 with no exception set. */
    static inline int kv_u64(PyObject* k, uint64_t* out) {
        if (!PyLong_Check(k) || _PyLong_Sign(k) < 0 || _PyLong_NumBits(k) > 64) return 0;
        *out = PyLong_AsUnsignedLongLongMask(k);
        return *out != UINT64_MAX;
    }
    """
    int kv_u64(object k, uint64_t* out)
    int kv_fill_u32(list lst, Py_ssize_t total, uint32_t* buf) except -1
    uint64_t XXH3_64bits_withSeed(const void* data, size_t length, uint64_t seed) nogil
    uint32_t kv_le32(uint32_t x) nogil
    uint64_t kv_be32(const uint8_t* p) nogil
    uint64_t kv_be64(const uint8_t* p) nogil
    int KV_BIG_ENDIAN

cdef array _U32 = array("I")
cdef array _U64 = array("Q")
cdef uint64_t MASK60 = (1ULL << 60) - 1
cdef uint64_t U32MAX = 0xFFFFFFFFULL  # a typed constant: a bare literal this big is a Python int
cdef uint64_t U64MAX = 0xFFFFFFFFFFFFFFFFULL


cdef list _chain(const uint8_t* data, Py_ssize_t n, Py_ssize_t stride, uint64_t prev):
    cdef list out = []
    cdef Py_ssize_t i
    for i in range(n):
        prev = XXH3_64bits_withSeed(data + i * stride, <size_t>stride, prev)
        out.append(prev)
    return out


def chain_keys(tokens, Py_ssize_t block_size, uint64_t seed):
    """Keys of the full blocks of `tokens` (a list of ints or an array('I')), chained from
    `seed` ((parent or 0) ^ namespace, already reduced to 64 bits)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    cdef Py_ssize_t n = len(tokens) // block_size
    cdef Py_ssize_t total = n * block_size
    cdef Py_ssize_t i
    cdef uint32_t* buf
    cdef list lst
    if n <= 0:
        return []
    if type(tokens) is array and (<array>tokens).ob_descr.typecode == b"I":
        if not KV_BIG_ENDIAN:
            return _chain(<const uint8_t*>(<array>tokens).data.as_uints, n, block_size * 4, seed)
        lst = list(tokens[:total])
    elif type(tokens) is list:
        lst = <list>tokens
    else:
        lst = list(tokens[:total])
    buf = <uint32_t*>PyMem_Malloc(total * 4)
    if buf == NULL:
        raise MemoryError()
    try:
        kv_fill_u32(lst, total, buf)
        return _chain(<const uint8_t*>buf, n, block_size * 4, seed)
    finally:
        PyMem_Free(buf)


def chain_keys_bytes(data, Py_ssize_t stride, uint64_t seed):
    """Keys of the full `stride`-byte blocks of a bytes-like object of packed uint32 ids."""
    cdef Py_buffer view
    if stride < 1:
        raise ValueError("stride must be >= 1")
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        return _chain(<const uint8_t*>view.buf, view.len // stride, stride, seed)
    finally:
        PyBuffer_Release(&view)


cdef inline uint64_t _be(const uint8_t* p, int k) noexcept nogil:
    cdef uint64_t v = 0
    cdef int j
    for j in range(k):
        v = (v << 8) | p[j]
    return v


cdef struct _Cur:
    const uint8_t* p
    const uint8_t* end


cdef inline int _arr_len(_Cur* c, Py_ssize_t* n) noexcept:
    """An array header → 1 and its length, else 0."""
    cdef uint8_t b
    if c.p >= c.end:
        return 0
    b = c.p[0]
    if 0x90 <= b <= 0x9F:
        n[0] = b & 0x0F
        c.p += 1
    elif b == 0xDC and c.end - c.p >= 3:
        n[0] = <Py_ssize_t>_be(c.p + 1, 2)
        c.p += 3
    elif b == 0xDD and c.end - c.p >= 5:
        n[0] = <Py_ssize_t>_be(c.p + 1, 4)
        c.p += 5
    else:
        return 0
    return n[0] <= c.end - c.p  # every item takes at least one byte


cdef object _uints_at(const uint8_t** pp, const uint8_t* end, array template, uint64_t vmax):
    """The msgpack array at *pp whose items are all ints in [0, vmax] → an array like
    `template` ('I' or 'Q'), *pp moved past it; None for any other value."""
    cdef _Cur c
    cdef const uint8_t* p
    cdef Py_ssize_t n, i
    cdef uint8_t b
    cdef uint64_t v
    cdef int k
    cdef array out
    cdef bint wide = template.ob_descr.itemsize == 8
    cdef uint32_t* dst32 = NULL
    cdef unsigned long long* dst64 = NULL
    c.p = pp[0]
    c.end = end
    if not _arr_len(&c, &n):
        return None
    p = c.p
    out = clone(template, n, False)
    if wide:
        dst64 = out.data.as_ulonglongs
    else:
        dst32 = out.data.as_uints
    for i in range(n):
        if p >= end:
            return None
        b = p[0]
        # The encodings senders use for token ids and hashes, one branch each
        # (big-endian loads; `end - p` checked before every read).
        if b <= 0x7F:
            v = b
            p += 1
        elif b == 0xCE:
            if end - p < 5:
                return None
            v = kv_be32(p + 1)
            p += 5
        elif b == 0xCD:
            if end - p < 3:
                return None
            v = (<uint64_t>p[1] << 8) | p[2]
            p += 3
        elif b == 0xCF:
            if end - p < 9:
                return None
            v = kv_be64(p + 1)
            p += 9
        elif b == 0xCC:
            if end - p < 2:
                return None
            v = p[1]
            p += 2
        elif 0xD0 <= b <= 0xD3:  # int8/16/32/64: only non-negative values fit
            k = 1 << (b - 0xD0)
            if end - p < 1 + k:
                return None
            v = _be(p + 1, k)
            if (v >> (8 * k - 1)) & 1:
                return None
            p += 1 + k
        else:
            return None
        if v > vmax:
            return None
        if wide:
            dst64[i] = v
        else:
            dst32[i] = <uint32_t>v
    pp[0] = p
    return out


cdef object _msgpack_uints(raw, array template, uint64_t vmax):
    """A msgpack array (all of `raw`) of ints in [0, vmax] → packed array, else None."""
    cdef Py_buffer view
    cdef const uint8_t* p
    cdef const uint8_t* end
    PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
    try:
        p = <const uint8_t*>view.buf
        end = p + view.len
        out = _uints_at(&p, end, template, vmax)
        return out if out is not None and p == end else None
    finally:
        PyBuffer_Release(&view)


def msgpack_uint32s(raw):
    """A msgpack array whose items are all ints in [0, 2**32) → array('I'); None for any
    other value (the caller then decodes the payload on its generic path)."""
    return _msgpack_uints(raw, _U32, U32MAX)


def msgpack_uint64s(raw):
    """A msgpack array whose items are all ints in [0, 2**64) → array('Q') (block hashes
    of vLLM >= 0.10.2); None for any other value (negative int64 or bytes hashes: the
    caller decodes them as a list)."""
    return _msgpack_uints(raw, _U64, U64MAX)


def engine_keys(list hashes):
    """[h & MASK60 for h in hashes] when the first hash is an int and every hash is an int
    (what apply's comprehension accepts); None otherwise (the caller takes its general
    path)."""
    cdef list out = []
    cdef object h
    if not hashes or type(hashes[0]) is not int:
        return None
    for h in hashes:
        if not PyLong_Check(h):
            return None
        out.append(PyLong_AsUnsignedLongLongMask(h) & MASK60)
    return out


# ---- EngineMap -----------------------------------------------------------------------------

cdef enum:
    _EMPTY = -1
    _DUMMY = -2

cdef uint64_t _DEAD = 0xFFFFFFFFFFFFFFFFULL  # an entry's key after deletion


cdef class EngineMap:
    """engine key (int in [0, 2**64-1)) → our key (uint64), insertion-ordered.

    Like CPython's dict: an append-only entry array (key, value) in insertion order and an
    open-addressing index of int32 entry positions (linear probing, load <= 1/2). A deleted
    entry keeps its place (key = dead) until the next rebuild; re-inserting an existing key
    keeps its position (dict.update semantics), so `pop_oldest` evicts what a dict would.
    Memory: 16 bytes per entry slot + 8 bytes of index per entry slot, PyMem (tracemalloc
    sees it)."""

    cdef uint64_t* ek
    cdef uint64_t* val
    cdef int32_t* idx
    cdef Py_ssize_t cap  # entry slots
    cdef Py_ssize_t used  # entries appended (live + dead)
    cdef Py_ssize_t live
    cdef Py_ssize_t head  # no live entry before this position
    cdef int bits  # index size = 1 << bits

    def __cinit__(self):
        self.ek = NULL
        self.val = NULL
        self.idx = NULL
        self.cap = self.used = self.live = self.head = 0
        self.bits = 0

    def __dealloc__(self):
        PyMem_Free(self.ek)
        PyMem_Free(self.val)
        PyMem_Free(self.idx)

    cdef inline Py_ssize_t _slot0(self, uint64_t k) noexcept nogil:
        return <Py_ssize_t>((k * 0x9E3779B97F4A7C15ULL) >> (64 - self.bits))

    cdef Py_ssize_t _find(self, uint64_t k) noexcept nogil:
        """Entry position of key k, or -1."""
        cdef Py_ssize_t mask, s
        cdef int32_t e
        if self.bits == 0:
            return -1
        mask = (1 << self.bits) - 1
        s = self._slot0(k)
        while True:
            e = self.idx[s]
            if e == _EMPTY:
                return -1
            if e >= 0 and self.ek[e] == k:
                return e
            s = (s + 1) & mask

    cdef int _rebuild(self, Py_ssize_t new_cap) except -1:
        """Compact the live entries into `new_cap` slots and re-index them."""
        cdef Py_ssize_t i, j = 0, s, mask
        cdef int bits = 3
        cdef uint64_t* nek
        cdef uint64_t* nval
        cdef int32_t* nidx
        while (1 << bits) < 2 * new_cap:
            bits += 1
        if new_cap > 0x3FFFFFFF:
            raise MemoryError("EngineMap too large")
        nek = <uint64_t*>PyMem_Malloc(new_cap * 8)
        nval = <uint64_t*>PyMem_Malloc(new_cap * 8)
        nidx = <int32_t*>PyMem_Malloc((1 << bits) * 4)
        if nek == NULL or nval == NULL or nidx == NULL:
            PyMem_Free(nek)
            PyMem_Free(nval)
            PyMem_Free(nidx)
            raise MemoryError()
        memset(nidx, 0xFF, (1 << bits) * 4)  # all _EMPTY (-1)
        mask = (1 << bits) - 1
        for i in range(self.head, self.used):
            if self.ek[i] == _DEAD:
                continue
            nek[j] = self.ek[i]
            nval[j] = self.val[i]
            s = <Py_ssize_t>((nek[j] * 0x9E3779B97F4A7C15ULL) >> (64 - bits))
            while nidx[s] != _EMPTY:
                s = (s + 1) & mask
            nidx[s] = <int32_t>j
            j += 1
        PyMem_Free(self.ek)
        PyMem_Free(self.val)
        PyMem_Free(self.idx)
        self.ek, self.val, self.idx = nek, nval, nidx
        self.cap, self.used, self.live, self.head, self.bits = new_cap, j, j, 0, bits
        return 0

    cdef int _put(self, uint64_t k, uint64_t v, uint64_t* old) except -1:
        """Insert or update k -> v; 1 (and the value it had in `old`) when k led to
        another value, else 0."""
        cdef Py_ssize_t e, s, mask, c
        if k == _DEAD:
            raise OverflowError("engine key out of range")
        e = self._find(k)
        if e >= 0:
            if self.val[e] == v:
                return 0
            old[0] = self.val[e]
            self.val[e] = v
            return 1
        if self.used == self.cap:
            # Full: compact when at least half is dead, else double.
            c = self.cap if self.live * 2 <= self.cap and self.cap else max(8, self.cap * 2)
            self._rebuild(c)
        mask = (1 << self.bits) - 1
        s = self._slot0(k)
        while self.idx[s] >= 0:  # reuse the first empty or dummy slot on the probe path
            s = (s + 1) & mask
        e = self.used
        self.ek[e] = k
        self.val[e] = v
        self.idx[s] = <int32_t>e
        self.used += 1
        self.live += 1
        return 0

    cdef int _delete_at(self, uint64_t k) except -1:
        """Delete key k; -1 with KeyError when absent."""
        cdef Py_ssize_t mask, s
        cdef int32_t e
        if self.bits:
            mask = (1 << self.bits) - 1
            s = self._slot0(k)
            while True:
                e = self.idx[s]
                if e == _EMPTY:
                    break
                if e >= 0 and self.ek[e] == k:
                    self.idx[s] = _DUMMY
                    self.ek[e] = _DEAD
                    self.live -= 1
                    while self.head < self.used and self.ek[self.head] == _DEAD:
                        self.head += 1
                    return 0
                s = (s + 1) & mask
        raise KeyError(k)

    cdef inline uint64_t _key(self, object k) except? 0xFFFFFFFFFFFFFFFF:
        cdef uint64_t x
        if kv_u64(k, &x):
            return x
        if not PyLong_Check(k):
            raise TypeError(f"EngineMap keys are ints, got {type(k).__name__}")
        raise OverflowError("engine key out of range")

    def __len__(self):
        return self.live

    def __contains__(self, k):
        cdef uint64_t x
        return bool(kv_u64(k, &x)) and self._find(x) >= 0

    def get(self, k, default=None):
        """Our key for engine key `k`, or `default`."""
        cdef Py_ssize_t e
        cdef uint64_t x
        if not kv_u64(k, &x):
            return default
        e = self._find(x)
        return default if e < 0 else self.val[e]

    def __getitem__(self, k):
        v = self.get(k)
        if v is None:
            raise KeyError(k)
        return v

    def __setitem__(self, k, v):
        cdef uint64_t old
        self._put(self._key(k), <uint64_t>v, &old)

    def __delitem__(self, k):
        self._delete_at(self._key(k))

    def update_pairs(self, ekeys, keys):
        """Insert zip(ekeys, keys) (the shorter one bounds it), like dict.update. Returns
        the values replaced: what an engine key led to before it was given another."""
        cdef Py_ssize_t i, n = min(len(ekeys), len(keys))
        cdef uint64_t old
        cdef list replaced = []
        for i in range(n):
            if self._put(self._key(ekeys[i]), <uint64_t>keys[i], &old):
                replaced.append(old)
        return replaced

    def pop_oldest(self, Py_ssize_t n):
        """Remove up to `n` oldest entries; returns them as [(engine key, our key)]."""
        cdef list out = []
        cdef Py_ssize_t i = self.head
        while len(out) < n and i < self.used:
            if self.ek[i] != _DEAD:
                out.append((self.ek[i], self.val[i]))
            i += 1
        for ek, _ in out:
            self._delete_at(ek)
        return out

    def clear(self):
        """Remove every entry (and free the memory)."""
        PyMem_Free(self.ek)
        PyMem_Free(self.val)
        PyMem_Free(self.idx)
        self.ek = self.val = NULL
        self.idx = NULL
        self.cap = self.used = self.live = self.head = 0
        self.bits = 0

    def items(self):
        """[(engine key, our key)] in insertion order."""
        cdef Py_ssize_t i
        return [(self.ek[i], self.val[i]) for i in range(self.head, self.used)
                if self.ek[i] != _DEAD]

    def keys(self):
        """Engine keys in insertion order."""
        cdef Py_ssize_t i
        return [self.ek[i] for i in range(self.head, self.used) if self.ek[i] != _DEAD]

    def values(self):
        """Our keys in insertion order."""
        cdef Py_ssize_t i
        return [self.val[i] for i in range(self.head, self.used) if self.ek[i] != _DEAD]

    def __iter__(self):
        return iter(self.keys())

    def nbytes(self):
        """Bytes allocated (entries + index)."""
        return self.cap * 16 + ((1 << self.bits) * 4 if self.bits else 0)


# ---- fused BlockStored → index (packed arrays, no Python int per block until the dict) -----

cdef extern from "Python.h":
    PyObject* PyDict_SetDefault(object d, object key, object default) except NULL


def stored_chain(array tokens, array hashes, Py_ssize_t n, Py_ssize_t block_size,
                 uint64_t seed, array keys_out, array ekeys_out):
    """Append the keys of the first `n` blocks of `tokens` (array('I'), chained xxh3 from
    `seed`, as `chain_keys`) to `keys_out` and the engine keys (h & MASK60) of the first `n`
    `hashes` (array('Q')) to `ekeys_out` (both array('Q')). One C loop per event: the
    fused BlockStored path of apply (scorer/events/apply.py). False when the inputs are not
    those (the caller takes the reference path), True when appended."""
    cdef Py_ssize_t i, k0, e0
    cdef const uint8_t* data
    cdef uint64_t prev = seed
    cdef unsigned long long* ko
    cdef unsigned long long* eo
    cdef const unsigned long long* hs
    if (KV_BIG_ENDIAN or block_size < 1 or n < 0
            or tokens.ob_descr.typecode != b"I" or hashes.ob_descr.typecode != b"Q"
            or keys_out.ob_descr.typecode != b"Q" or ekeys_out.ob_descr.typecode != b"Q"
            or len(tokens) // block_size < n or len(hashes) < n):
        return False
    k0 = len(keys_out)
    e0 = len(ekeys_out)
    resize_smart(keys_out, k0 + n)
    resize_smart(ekeys_out, e0 + n)
    ko = keys_out.data.as_ulonglongs + k0
    eo = ekeys_out.data.as_ulonglongs + e0
    hs = hashes.data.as_ulonglongs
    data = <const uint8_t*>tokens.data.as_uints
    for i in range(n):
        prev = XXH3_64bits_withSeed(data + i * block_size * 4, <size_t>(block_size * 4), prev)
        ko[i] = prev
        eo[i] = hs[i] & MASK60
    return True


def index_add(dict d, EngineMap emap, array ekeys, array keys, object bit):
    """`BlockIndex.add`'s insert for packed keys (array('Q') each): every (engine key, key)
    pair into `emap` (insertion order as update_pairs), then every key absent from `d`
    (a medium dict) inserted with `bit` (the slot's shared bit object). Returns (new keys,
    [(key, mask)] of the keys already held under another mask object, [our keys an engine
    key led to before it was given another]), for the caller to add its bit to those masks
    and drop the replaced keys as the reference code does. Only the first min(len) keys
    go in (the caller passes equal lengths)."""
    cdef Py_ssize_t i, n = min(len(ekeys), len(keys))
    cdef Py_ssize_t before
    cdef uint64_t old
    cdef list replaced = []
    cdef const unsigned long long* ek
    cdef const unsigned long long* kk
    cdef object ko
    cdef PyObject* m
    cdef list shared = []
    if ekeys.ob_descr.typecode != b"Q" or keys.ob_descr.typecode != b"Q":
        raise TypeError("index_add takes array('Q') keys")
    ek = ekeys.data.as_ulonglongs
    for i in range(n):
        if ek[i] == _DEAD:
            raise OverflowError("engine key out of range")
        if emap._put(ek[i], keys.data.as_ulonglongs[i], &old):
            replaced.append(old)
    kk = keys.data.as_ulonglongs
    before = PyDict_Size(d)
    for i in range(n):
        ko = PyLong_FromUnsignedLongLong(kk[i])
        m = PyDict_SetDefault(d, ko, bit)
        if m != <PyObject*>bit:
            shared.append((ko, <object>m))
    return PyDict_Size(d) - before, shared, replaced


# ---- fused batch decode: one pass over a well-formed payload ------------------------------
# The common shapes of a vLLM/SGLang batch (vLLM 0.9-0.23 positional events, 0.24+ tagged
# maps; uint64 hashes, uint32 token ids, no LoRA / extra keys / salt) parsed in one C pass
# into the event dataclasses, with hashes and ids packed (array('Q') / array('I')). Anything
# else (another field, a type it does not take, trailing bytes, a lying header) returns None
# and the caller takes the msgspec paths, which give the reference meaning.

cdef inline int _map_len(_Cur* c, Py_ssize_t* n) noexcept:
    cdef uint8_t b
    if c.p >= c.end:
        return 0
    b = c.p[0]
    if 0x80 <= b <= 0x8F:
        n[0] = b & 0x0F
        c.p += 1
    elif b == 0xDE and c.end - c.p >= 3:
        n[0] = <Py_ssize_t>_be(c.p + 1, 2)
        c.p += 3
    else:
        return 0
    return 2 * n[0] <= c.end - c.p


cdef inline int _str(_Cur* c, const uint8_t** s, Py_ssize_t* n) noexcept:
    """A str → 1 with its bytes, else 0."""
    cdef uint8_t b
    if c.p >= c.end:
        return 0
    b = c.p[0]
    if 0xA0 <= b <= 0xBF:
        n[0] = b & 0x1F
        c.p += 1
    elif b == 0xD9 and c.end - c.p >= 2:
        n[0] = c.p[1]
        c.p += 2
    elif b == 0xDA and c.end - c.p >= 3:
        n[0] = <Py_ssize_t>_be(c.p + 1, 2)
        c.p += 3
    else:
        return 0
    if n[0] > c.end - c.p:
        return 0
    s[0] = c.p
    c.p += n[0]
    return 1


cdef inline int _nil(_Cur* c) noexcept:
    if c.p < c.end and c.p[0] == 0xC0:
        c.p += 1
        return 1
    return 0


cdef inline int _uint(_Cur* c, uint64_t* v) noexcept:
    """A non-negative int → 1, else 0."""
    cdef uint8_t b
    cdef int k
    if c.p >= c.end:
        return 0
    b = c.p[0]
    if b <= 0x7F:
        v[0] = b
        c.p += 1
        return 1
    if 0xCC <= b <= 0xCF:
        k = 1 << (b - 0xCC)
        if c.end - c.p < 1 + k:
            return 0
        v[0] = _be(c.p + 1, k)
        c.p += 1 + k
        return 1
    if 0xD0 <= b <= 0xD3:
        k = 1 << (b - 0xD0)
        if c.end - c.p < 1 + k:
            return 0
        v[0] = _be(c.p + 1, k)
        if (v[0] >> (8 * k - 1)) & 1:
            return 0
        c.p += 1 + k
        return 1
    return 0


cdef inline object _packed(_Cur* c, array template, uint64_t vmax):
    """An array of ints in [0, vmax] → packed array, else None."""
    return _uints_at(&c.p, c.end, template, vmax)


cdef object _opt_medium(_Cur* c):
    """nil → None, a UTF-8 str → str, else False (not taken)."""
    cdef const uint8_t* s
    cdef Py_ssize_t n
    if _nil(c):
        return None
    if not _str(c, &s, &n):
        return False
    try:
        return (<char*>s)[:n].decode("utf-8")
    except UnicodeDecodeError:
        return False


cdef enum:
    # BlockStored fields by position (vLLM 0.9-0.23 array events); map keys map onto them.
    F_HASHES, F_PARENT, F_TOKENS, F_BS, F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA, F_GROUP,
    F_SALT, F_N,
    # Map keys the reference decode ignores (no field of ours), taken with a scalar value:
    # vLLM >= 0.22 fills kv_cache_spec_kind on every event, 0.30+ may add session_id.
    K_SPEC_KIND, K_SPEC_WINDOW, K_SESSION

cdef inline bint _is(const uint8_t* s, Py_ssize_t n, const char* name, Py_ssize_t m) noexcept:
    return n == m and memcmp(s, name, m) == 0


cdef inline int _key_id(const uint8_t* s, Py_ssize_t n) noexcept:
    """A BlockStored map key → its field (F_*), or -1 (no bytes object per key)."""
    if _is(s, n, "block_hashes", 12):
        return F_HASHES
    if _is(s, n, "token_ids", 9):
        return F_TOKENS
    if _is(s, n, "parent_block_hash", 17):
        return F_PARENT
    if _is(s, n, "block_size", 10):
        return F_BS
    if _is(s, n, "medium", 6):
        return F_MEDIUM
    if _is(s, n, "lora_id", 7):
        return F_LORA_ID
    if _is(s, n, "lora_name", 9):
        return F_LORA_NAME
    if _is(s, n, "extra_keys", 10):
        return F_EXTRA
    if _is(s, n, "group_idx", 9):
        return F_GROUP
    if _is(s, n, "cache_salt", 10):
        return F_SALT
    if _is(s, n, "kv_cache_spec_kind", 18):
        return K_SPEC_KIND
    if _is(s, n, "kv_cache_spec_sliding_window", 28):
        return K_SPEC_WINDOW
    if _is(s, n, "session_id", 10):
        return K_SESSION
    return -1


cdef int _field(_Cur* c, int f, list out) except -1:
    """Read field `f` of an event into out[f] → 1, or 0 when not taken."""
    cdef uint64_t v
    cdef object o
    cdef const uint8_t* s
    cdef Py_ssize_t n, k
    if f >= F_N:  # a key the reference ignores: skipped, when its value is a plain scalar
        if _nil(c):
            return 1
        if f == K_SPEC_WINDOW:
            return _uint(c, &v)
        return _str(c, &s, &n)
    if f == F_EXTRA:
        # nil, or one nil per block (vLLM >= 0.20 on the plain path: no extra key for any
        # block), kept as the reference keeps it ([None] * n); anything else is not taken.
        if _nil(c):
            out[f] = None
            return 1
        if not _arr_len(c, &n):
            return 0
        for k in range(n):
            if not _nil(c):
                return 0
        out[f] = [None] * n
        return 1
    if f == F_HASHES:
        o = _packed(c, _U64, U64MAX)
    elif f == F_TOKENS:
        o = _packed(c, _U32, U32MAX)
    elif f == F_PARENT:
        if _nil(c):
            out[f] = None
            return 1
        if not _uint(c, &v):
            return 0
        o = v
    elif f == F_BS:
        if not _uint(c, &v) or v < 1:
            return 0
        o = v
    elif f == F_GROUP:
        if _nil(c):
            out[f] = None
            return 1
        if not _uint(c, &v):
            return 0
        o = v
    elif f == F_MEDIUM:
        o = _opt_medium(c)
        if o is False:
            return 0
        out[f] = o
        return 1
    else:  # lora_id, lora_name, cache_salt: only absent / nil here
        if not _nil(c):
            return 0
        out[f] = None
        return 1
    if o is None:
        return 0
    out[f] = o
    return 1


def decode_batch(payload, stored_cls, removed_cls, cleared_cls, normalize):
    """A payload of the common shapes → (ts, [events], data_parallel_rank), else None.

    Events are built with `stored_cls` / `removed_cls` / `cleared_cls` (the decode module's
    dataclasses) and media spelled by `normalize` (its `normalize_medium`)."""
    cdef Py_buffer view
    cdef _Cur c
    cdef Py_ssize_t n, ne, i, j, nf, ks
    cdef uint64_t v
    cdef const uint8_t* s
    cdef double ts
    cdef object rank = None
    cdef list events = []
    cdef list f
    cdef int fi, seen
    cdef bint is_map
    cdef object mraw
    PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
    try:
        c.p = <const uint8_t*>view.buf
        c.end = c.p + view.len
        if not _arr_len(&c, &n) or n < 2 or n > 3:
            return None
        if c.p >= c.end:
            return None
        if c.p[0] == 0xCB and c.end - c.p >= 9:
            v = kv_be64(c.p + 1)
            memcpy(&ts, &v, 8)
            c.p += 9
        elif _uint(&c, &v):
            ts = <double>v
        else:
            return None
        if not _arr_len(&c, &ne):
            return None
        for i in range(ne):
            if c.p >= c.end:
                return None
            f = [None] * F_N
            is_map = 0x80 <= c.p[0] <= 0x8F or c.p[0] == 0xDE
            if is_map:
                if not _map_len(&c, &nf) or nf < 1:
                    return None
                # vLLM writes "type" first (msgspec tag_field); another order is not taken.
                if not _str(&c, &s, &ks) or not _is(s, ks, "type", 4):
                    return None
                if not _str(&c, &s, &ks):
                    return None
                nf -= 1
            else:
                if not _arr_len(&c, &nf) or nf < 1:
                    return None
                if not _str(&c, &s, &ks):
                    return None
                nf -= 1
            if _is(s, ks, "BlockStored", 11):
                seen = 0
                if is_map:
                    for j in range(nf):
                        if not _str(&c, &s, &ks):
                            return None
                        fi = _key_id(s, ks)
                        if fi < 0:
                            return None
                        if seen & (1 << fi) or not _field(&c, fi, f):
                            return None
                        seen |= 1 << fi
                    if seen & 0b1101 != 0b1101:  # hashes, tokens, block_size required
                        return None
                else:
                    if nf < 4 or nf > F_SALT:  # 4..9 positional fields (no salt)
                        return None
                    for j in range(nf):
                        if not _field(&c, j, f):
                            return None
                mraw = f[F_MEDIUM]
                events.append(stored_cls(
                    f[F_HASHES], f[F_PARENT], f[F_TOKENS], f[F_BS], None,
                    "GPU" if mraw is None or mraw == "GPU" else normalize(mraw), mraw,
                    None, f[F_EXTRA], f[F_GROUP], None))
            elif _is(s, ks, "BlockRemoved", 12):
                seen = 0
                if is_map:
                    for j in range(nf):
                        if not _str(&c, &s, &ks):
                            return None
                        fi = _key_id(s, ks)
                        if fi != F_HASHES and fi != F_MEDIUM and fi != F_GROUP:
                            return None
                        if seen & (1 << fi) or not _field(&c, fi, f):
                            return None
                        seen |= 1 << fi
                    if not seen & 1:
                        return None
                else:
                    if nf < 1 or nf > 3:
                        return None
                    for j in range(nf):
                        if not _field(&c, (F_HASHES, F_MEDIUM, F_GROUP)[j], f):
                            return None
                mraw = f[F_MEDIUM]
                events.append(removed_cls(
                    f[F_HASHES].tolist(),
                    "GPU" if mraw is None or mraw == "GPU" else normalize(mraw), mraw,
                    f[F_GROUP]))
            elif _is(s, ks, "AllBlocksCleared", 16):
                if nf > 1:
                    return None
                if nf == 1:
                    if is_map:
                        if not _str(&c, &s, &ks) or not _is(s, ks, "medium", 6):
                            return None
                    if not _field(&c, F_MEDIUM, f):
                        return None
                mraw = f[F_MEDIUM]
                events.append(cleared_cls(None if mraw is None else normalize(mraw)))
            else:
                return None
        if n == 3:
            if _nil(&c):
                rank = None
            elif _uint(&c, &v) and v <= 0x7FFFFFFF:
                rank = v
            else:
                return None
        if c.p != c.end:
            return None
        return ts, events, rank
    finally:
        PyBuffer_Release(&view)


cdef inline void _chain_into(const uint8_t* data, const unsigned long long* hs, Py_ssize_t n,
                             Py_ssize_t stride, uint64_t prev, unsigned long long* ko,
                             unsigned long long* eo) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        prev = XXH3_64bits_withSeed(data + i * stride, <size_t>stride, prev)
        ko[i] = prev
        eo[i] = hs[i] & MASK60


cdef inline bint _no_extra_keys(object ek):
    """None, or a list of None only (one per block): no block has an extra key."""
    if ek is None:
        return True
    if type(ek) is not list:
        return False
    for x in <list>ek:
        if x is not None:
            return False
    return True


def stored_events(list events, Py_ssize_t i, object stored_cls, object medium,
                  Py_ssize_t block_size, object emap, array keys_out, array ekeys_out):
    """Apply's BlockStored loop for a run of plain events, from events[i]: each one of
    type `stored_cls` on `medium`, group 0, `block_size`, no LoRA / salt and no block with
    an extra key (extra_keys None or all None),
    packed hashes and ids, >= 1 full block, and a parent that is the pending tail or in
    `emap` (the slot's EngineMap, or None). Their keys and engine keys are appended to the
    packed pending arrays. Stops at the first other event (the reference code takes it).
    Returns (index of that event, blocks appended)."""
    cdef Py_ssize_t j = i, n, nt, k0, total = 0, stride = block_size * 4, e
    cdef array tokens, hashes
    cdef uint64_t seed, pk
    cdef EngineMap em = emap if isinstance(emap, EngineMap) else None
    cdef object ev, ph, t, h
    if (KV_BIG_ENDIAN or block_size < 1 or keys_out.ob_descr.typecode != b"Q"
            or ekeys_out.ob_descr.typecode != b"Q"):
        return i, 0
    while j < len(events):
        ev = events[j]
        if type(ev) is not stored_cls:
            break
        if ev.medium is not medium and ev.medium != medium:
            break
        if ev.group_idx or ev.block_size != block_size:
            break
        if (not _no_extra_keys(ev.extra_keys) or ev.lora_name is not None
                or ev.lora_id is not None or ev.cache_salt is not None):
            break
        t = ev.token_ids
        h = ev.block_hashes
        if type(t) is not array or type(h) is not array:
            break
        tokens = <array>t
        hashes = <array>h
        if tokens.ob_descr.typecode != b"I" or hashes.ob_descr.typecode != b"Q":
            break
        n = len(hashes)
        nt = len(tokens) // block_size
        if nt < n:
            n = nt
        if n == 0:
            break
        ph = ev.parent_block_hash
        if ph is None:
            seed = 0
        else:
            if not kv_u64(ph, &pk):
                break
            pk &= MASK60
            k0 = len(ekeys_out)
            if k0 and ekeys_out.data.as_ulonglongs[k0 - 1] == pk:
                seed = keys_out.data.as_ulonglongs[k0 - 1]
            else:
                e = em._find(pk) if em is not None else -1
                if e < 0:
                    break  # maybe pending (the caller flushes) or unknown
                seed = em.val[e]
        k0 = len(keys_out)
        resize_smart(keys_out, k0 + n)
        resize_smart(ekeys_out, k0 + n)
        _chain_into(<const uint8_t*>tokens.data.as_uints, hashes.data.as_ulonglongs, n, stride,
                    seed, keys_out.data.as_ulonglongs + k0, ekeys_out.data.as_ulonglongs + k0)
        total += n
        j += 1
    return j, total


# -- The cost function's columns (scorer.policy.cost; its Python code is the reference) -----
#
# Each float operation is the reference's, in its order (C's + and * are left-associative as
# Python's; the extension is built with -ffp-contract=off so no multiply-add is fused), so the
# numbers are the same bits. Objects the reference passes through unchanged (an int count)
# stay the same objects.

cdef str _BUSY_WAITING = "busy_waiting"
cdef str _BUSY_KV_USAGE = "busy_kv_usage"
cdef str _BUSY_INFLIGHT = "busy_inflight"


def load_columns(candidates, double fresh_since, double wrb, busy_w, busy_k, busy_i, bint check):
    """`scorer.policy.cost.load_table`'s pass: (prefill, decode, waiting, kv_usage, busy)."""
    cdef list pfs = [], dcs = [], wqs = [], kus = [], busys = []
    cdef double x, at, wq_d, ku_d
    cdef bint has_w = busy_w is not None, has_k = busy_k is not None, has_i = busy_i is not None
    cdef double bw = busy_w if has_w else 0.0
    cdef double bk = busy_k if has_k else 0.0
    cdef object pf, dc, wq, ku, b, ngb
    for w in candidates:
        fl = w.inflight
        sc = w.scraped
        pf = fl.prefill_blocks
        dc = fl.decode_blocks
        b = None
        at = sc.at
        if at > 0.0 and at >= fresh_since:
            wq = sc.waiting
            ku = sc.kv_usage
            wq_d = wq
            ku_d = ku
            x = wq_d * wrb
            if x > <double>pf:
                pf = x
            ngb = sc.num_gpu_blocks
            if ngb:
                x = ku_d * <double>ngb
                if x > <double>dc:
                    dc = x
            if has_w and wq_d >= bw:
                b = _BUSY_WAITING
            elif has_k and ku_d >= bk:
                b = _BUSY_KV_USAGE
        else:
            wq = ku = 0.0
        if b is None and has_i and fl.requests >= busy_i:
            b = _BUSY_INFLIGHT
        pfs.append(pf)
        dcs.append(dc)
        wqs.append(wq)
        kus.append(ku)
        busys.append(b)
    return pfs, dcs, wqs, kus, (busys if check else None)


def decay_credit(list pf, list dc, double rb, double decay):
    """`dynamo_costs`' credit column: 1 / (1 + decay * (load - load_min) / unit), unit =
    max(load_min, rb, 1.0), load = prefill + decode (1.0 at the least loaded)."""
    cdef Py_ssize_t n = len(pf), k
    if len(dc) != n:
        raise ValueError("prefill and decode columns differ in length")
    if n == 0:
        raise ValueError("min() iterable argument is empty")
    cdef double lm = <double>pf[0] + <double>dc[0], x, unit
    for k in range(1, n):
        x = <double>pf[k] + <double>dc[k]
        if x < lm:
            lm = x
    unit = lm  # max(load_min, rb, 1.0), first maximal as Python's max
    if rb > unit:
        unit = rb
    if 1.0 > unit:
        unit = 1.0
    cdef list out = [None] * n
    cdef double one = 1.0
    for k in range(n):
        x = <double>pf[k] + <double>dc[k]
        out[k] = one / (one + decay * (x - lm) / unit) if x > lm else one
    return out


def cost_column(list pf, list dc, list credit, list weighted, list held, double rb, double pls,
                double dup, double best):
    """`dynamo_costs`' cost column: pls * max(prefill + rb - credit * weighted, 0) + decode
    + rb + dup * (best - held)."""
    cdef Py_ssize_t n = len(pf), k
    if len(dc) != n or len(credit) != n or len(weighted) != n or len(held) != n:
        raise ValueError("cost columns differ in length")
    cdef list out = [None] * n
    cdef double p
    for k in range(n):
        p = <double>pf[k] + rb - <double>credit[k] * <double>weighted[k]
        if not p > 0.0:
            p = 0.0
        out[k] = pls * p + <double>dc[k] + rb + dup * (best - <double>held[k])
    return out


cdef double _f(object x) except? -1.0:
    # A column's number as the reference's arithmetic converts it (float, or int exactly).
    return <double>x


def cost_core(list cands, list eps, list pf, list dc, matches, double rb, double decay,
              stale, double sc, double dup_opt, bint new_session, double pls, waiting,
              double cap, bint add_share, double step_share):
    """`dynamo_costs`' columns from the index lookup to the costs, and the step-sharing
    blocks, for the common case (no medium_credit, no block life): the Python code in
    scorer.policy.cost is the reference (`native=False`), op for op and object for object
    (the matches, weights and held overlaps are the same objects; a comparison between
    objects is Python's). `matches`: a dict or None (empty); `waiting`: the scraped queue
    column when step sharing is on (else None); `add_share`: the step-sharing blocks are
    also added to the costs (`_add_prefill_blocks` at step_share x pls: the blocks unit).
    Returns (ms, any_match, credit, stale flags, stale_any, weighted, dup, held, best,
    costs, share)."""
    cdef Py_ssize_t n = len(pf), k
    if len(dc) != n or len(cands) != n or len(eps) != n:
        raise ValueError("cost columns differ in length")
    cdef list ms = [None] * n
    cdef bint any_match = False
    cdef object m
    if matches is not None:
        if type(matches) is not dict:
            raise TypeError("matches must be a dict")
        for k in range(n):
            m = (<dict>matches).get(eps[k])
            if m is not None:
                ms[k] = m
                any_match = True
    # Credit: decay_credit's column, or 1.0 each.
    cdef list credit
    cdef double lm, x, unit, one = 1.0
    if decay > 0.0:
        if n == 0:
            raise ValueError("min() iterable argument is empty")
        lm = _f(pf[0]) + _f(dc[0])
        for k in range(1, n):
            x = _f(pf[k]) + _f(dc[k])
            if x < lm:
                lm = x
        unit = lm
        if rb > unit:
            unit = rb
        if 1.0 > unit:
            unit = 1.0
        credit = [None] * n
        for k in range(n):
            x = _f(pf[k]) + _f(dc[k])
            credit[k] = one / (one + decay * (x - lm) / unit) if x > lm else one
    else:
        credit = [1.0] * n
    # Stale streams: the flags as `stale` returns them, their credit cut.
    cdef object flags = None
    cdef bint stale_any = False
    cdef list fl
    cdef object f
    if stale is not None and any_match:
        fl = [None] * n
        for k in range(n):
            m = ms[k]
            f = False if m is None else stale(cands[k])
            fl[k] = f
            if not stale_any and (f is True or f == True):  # (`True in flags`)
                stale_any = True
        flags = fl
        if stale_any:
            for k in range(n):
                if fl[k]:
                    credit[k] = _f(credit[k]) * sc
    cdef list weighted = [None] * n
    for k in range(n):
        m = ms[k]
        weighted[k] = 0.0 if m is None else m.weighted
    # Duplicate term: held overlap (a stale stream's cut too), the best of it.
    cdef double dup = dup_opt
    if not any_match or new_session:
        dup = 0.0
    cdef list held = weighted
    cdef object best = 0.0, h, top
    if dup > 0.0:
        if stale_any:
            held = [None] * n
            for k in range(n):
                h = weighted[k]
                held[k] = _f(h) * sc if fl[k] else h
        best = held[0]
        for k in range(n):
            h = held[k]
            if h > best:
                best = h
        if best <= 0.0:
            top = None
            for k in range(n):
                if ms[k] is not None and (top is None or held[k] > top):
                    top = held[k]
            best = top
    # The cost column (cost_column's arithmetic).
    cdef double b = _f(best), p
    cdef list costs = [None] * n
    for k in range(n):
        p = _f(pf[k]) + rb - _f(credit[k]) * _f(weighted[k])
        if not p > 0.0:
            p = 0.0
        costs[k] = pls * p + _f(dc[k]) + rb + dup * (b - _f(held[k]))
    # Step sharing's blocks (cost._share_term), and (add_share) on the costs at
    # step_share x pls (cost._add_prefill_blocks).
    cdef object share = None
    cdef list sh
    cdef double r, wq, u, q, x2, w2 = step_share * pls
    if waiting is not None:
        if len(waiting) != n:
            raise ValueError("cost columns differ in length")
        sh = [None] * n
        for k in range(n):
            r = _f(cands[k].inflight.prefill_requests)
            wq = _f(waiting[k])
            if wq > r:
                r = wq
            u = rb - _f(credit[k]) * _f(weighted[k])
            if r > 0.0 and u > 0.0:
                q = _f(pf[k])
                if q > cap:
                    r = r * cap / q
                x2 = r * (u if u < cap else cap)
                sh[k] = x2
                if add_share and x2 > 0.0:
                    costs[k] = <double>costs[k] + w2 * x2
            else:
                sh[k] = 0.0
        share = sh
    return ms, any_match, credit, flags, stale_any, weighted, dup, held, best, costs, share


def pick_lowest(list costs, tiebreak, rng, random_type):
    """`scorer.policy.cost.pick` at temperature 0 (its Python code is the reference):
    the lowest cost's position, or among the costs within 1e-9 of it the lowest
    `tiebreak(i)` key, then `rng`'s draw (Random.choice's, inlined for `random_type`
    itself). Every comparison and operation is the reference's on the same objects."""
    cdef Py_ssize_t n = len(costs), k, j = 0, m, bits
    if n == 1:
        return 0
    if n == 0:
        raise IndexError("list index out of range")  # (costs[0], unchecked here)
    c_min = costs[0]
    for k in range(n):
        c = costs[k]
        if c < c_min:
            c_min = c
            j = k
    a = c_min if c_min >= 0.0 else -c_min
    limit = c_min + 1e-9 * (a if a > 1.0 else 1.0)
    other = None
    for k in range(n):
        c = costs[k]
        if k != j and (other is None or c < other):
            other = c
    if other is not None and other > limit:
        return j
    cdef list tied = [], keys = [], won = []
    for k in range(n):
        if costs[k] <= limit:
            tied.append(k)
            keys.append(tiebreak(k))
    if not keys:
        raise ValueError("min() arg is an empty sequence")
    best = keys[0]
    for key in keys:
        if key < best:
            best = key
    for k in range(len(keys)):
        if keys[k] == best:
            won.append(tied[k])
    m = len(won)
    if m == 1:
        return won[0]
    if type(rng) is random_type:
        bits = 0
        while (m >> bits) != 0:
            bits += 1
        r = rng.getrandbits(bits)
        while r >= m:
            r = rng.getrandbits(bits)
        return won[r]
    return rng.choice(won)


# -- The index match (scorer.index.masks.depths and BlockIndex.match's gathering are the
# reference) ------------------------------------------------------------------------------
#
# Holder masks are Python ints (bit i = slot i) of any width; only the bits of `allowed` (the
# candidates' slots) matter, so each mask is read as the words of `allowed`'s width.

cdef extern from *:
    """
    static inline int kv_ctz64(uint64_t x) { return __builtin_ctzll(x); }
    """
    int kv_ctz64(uint64_t x) nogil


cdef int _mask_words(object m, uint64_t* out, const uint64_t* allowed, Py_ssize_t nw) except -1:
    """out = the low nw words of int m, AND allowed (allowed NULL: all ones)."""
    cdef Py_ssize_t w
    cdef uint64_t x
    for w in range(nw):
        x = PyLong_AsUnsignedLongLongMask(m)
        out[w] = x & allowed[w] if allowed != NULL else x
        if w + 1 < nw:
            m = m >> 64
    return 0


def gpu_depths(keys, dict gpu, dict spec, dict cpu, dict disk, allowed):
    """`BlockIndex.match`'s GPU-only lookup in one pass: per block of `keys`, its GPU holder
    mask (`gpu`) OR its speculative one (`spec`), and from them, as `masks.depths(...)[0]`,
    slot bit -> leading blocks held by that slot, among the bits of `allowed` (an int >= 0),
    in the same order. Stops at the first block no allowed slot holds (the blocks after it
    change nothing). None when one of the blocks it reads has a CPU (`cpu`) or disk
    (`disk`) holder: the caller takes the media path (`match.with_media`)."""
    cdef list ks = keys if type(keys) is list else list(keys)
    cdef Py_ssize_t n = len(ks), i, w, nw
    cdef dict counts = {}
    if allowed < 0:
        raise ValueError("allowed must be >= 0")
    nw = (allowed.bit_length() + 63) // 64
    if nw == 0 or n == 0:
        return counts
    cdef uint64_t stack[16]
    cdef uint64_t* buf = stack
    if nw > 4:
        buf = <uint64_t*>PyMem_Malloc(4 * nw * sizeof(uint64_t))
        if buf == NULL:
            raise MemoryError()
    cdef uint64_t* al = buf
    cdef uint64_t* alive = buf + nw
    cdef uint64_t* cur = buf + 2 * nw
    cdef uint64_t* tmp = buf + 3 * nw
    cdef bint has_spec = len(spec) > 0, has_cpu = len(cpu) > 0, has_disk = len(disk) > 0
    cdef bint same_ok = False, changed, any_alive
    cdef PyObject* prev = NULL
    cdef PyObject* g
    cdef PyObject* s
    cdef object k, depth
    cdef uint64_t x, gone
    try:
        _mask_words(allowed, al, NULL, nw)
        for w in range(nw):
            alive[w] = al[w]
        for i in range(n):
            k = ks[i]
            if has_cpu and PyDict_Contains(cpu, k):
                return None
            if has_disk and PyDict_Contains(disk, k):
                return None
            g = PyDict_GetItemWithError(gpu, k)
            s = PyDict_GetItemWithError(spec, k) if has_spec else NULL
            if s == NULL:
                # Equal masks are one shared object: the same object as the block before
                # leaves every alive slot alive.
                if same_ok and g == prev:
                    continue
                prev = g
                same_ok = True
                if g == NULL:
                    for w in range(nw):
                        cur[w] = 0
                else:
                    _mask_words(<object>g, cur, al, nw)
            else:
                same_ok = False
                _mask_words(<object>s, cur, al, nw)
                if g != NULL:
                    _mask_words(<object>g, tmp, al, nw)
                    for w in range(nw):
                        cur[w] |= tmp[w]
            changed = False
            for w in range(nw):
                if alive[w] & cur[w] != alive[w]:
                    changed = True
                    break
            if not changed:
                continue
            depth = i
            any_alive = False
            for w in range(nw):
                if i:  # a slot without block 0 matches nothing: not in the result
                    gone = alive[w] & ~cur[w]
                    while gone:
                        counts[w * 64 + kv_ctz64(gone)] = depth
                        gone &= gone - 1
                alive[w] &= cur[w]
                if alive[w]:
                    any_alive = True
            if not any_alive:
                return counts
        depth = n
        for w in range(nw):
            x = alive[w]
            while x:
                counts[w * 64 + kv_ctz64(x)] = depth
                x &= x - 1
        return counts
    finally:
        if buf != stack:
            PyMem_Free(buf)


def depth_matches(dict counts, list bit_ep, cache, make):
    """`match.from_depths` without dp ranks: endpoint -> the Match of its depth, from slot
    bit -> depth, taking each Match from `cache` (a dict, depth -> Match) or `make(depth)`."""
    cdef dict out = {}
    if not isinstance(cache, dict):
        raise TypeError("cache must be a dict")
    cdef PyObject* m
    cdef object b, c, got
    for b, c in counts.items():
        m = PyDict_GetItemWithError(cache, c)
        if m == NULL:
            got = make(c)
        else:
            got = <object>m
        out[bit_ep[b]] = got
    return out


# ---------------------------------------------------------------- decision stage histograms

def append_stages(dict stages, dict pending, Py_ssize_t fold_at):
    """`scorer.policy.metrics.append_stages` (the reference): each (stage, seconds) of
    `stages` whose stage has a list in `pending` appended to that list; True when one of
    those lists holds `fold_at` values or more (the caller folds it)."""
    cdef Py_ssize_t pos = 0
    cdef PyObject* k
    cdef PyObject* v
    cdef PyObject* got
    cdef bint full = False
    while PyDict_Next(stages, &pos, &k, &v):
        got = PyDict_GetItemWithError(pending, <object>k)
        if got == NULL:
            continue
        if type(<object>got) is not list:
            raise TypeError("pending lists must be lists")
        PyList_Append(<object>got, <object>v)
        if PyList_GET_SIZE(<object>got) >= fold_at:
            full = True
    return full

def media_depths(keys, dict gpu, dict spec, dict cpu, dict disk, allowed):
    """`match.media_depths` (the reference) in one pass: per block of `keys`, its holders on
    GPU (`gpu` OR `spec`), CPU (`cpu`) and disk (`disk`); returns (slot bit -> leading
    blocks held on any medium, in `masks.depths`' order; bit -> those blocks held on CPU and
    not GPU; bit -> those held on disk only), among the bits of `allowed` (an int >= 0).
    Stops at the first block no allowed slot holds."""
    cdef list ks = keys if type(keys) is list else list(keys)
    cdef Py_ssize_t n = len(ks), i, w, nw, b, nb
    cdef dict counts = {}, n_cpu = {}, n_disk = {}
    if allowed < 0:
        raise ValueError("allowed must be >= 0")
    nw = (allowed.bit_length() + 63) // 64
    if nw == 0 or n == 0:
        return counts, n_cpu, n_disk
    nb = 64 * nw
    cdef uint64_t* buf = <uint64_t*>PyMem_Malloc((6 * nw + 2 * nb) * sizeof(uint64_t))
    if buf == NULL:
        raise MemoryError()
    cdef uint64_t* al = buf
    cdef uint64_t* alive = buf + nw
    cdef uint64_t* gw = buf + 2 * nw
    cdef uint64_t* cw = buf + 3 * nw
    cdef uint64_t* dw = buf + 4 * nw
    cdef uint64_t* tmp = buf + 5 * nw
    cdef uint64_t* ncpu = buf + 6 * nw
    cdef uint64_t* ndisk = ncpu + nb
    cdef bint has_spec = len(spec) > 0, has_cpu = len(cpu) > 0, has_disk = len(disk) > 0
    cdef bint changed, any_alive, slow
    cdef PyObject* m
    cdef object k, depth
    cdef uint64_t x, gone, cur
    try:
        memset(ncpu, 0, 2 * nb * sizeof(uint64_t))
        _mask_words(allowed, al, NULL, nw)
        for w in range(nw):
            alive[w] = al[w]
        for i in range(n):
            k = ks[i]
            m = PyDict_GetItemWithError(gpu, k)
            if m == NULL:
                memset(gw, 0, nw * sizeof(uint64_t))
            else:
                _mask_words(<object>m, gw, al, nw)
            if has_spec:
                m = PyDict_GetItemWithError(spec, k)
                if m != NULL:
                    _mask_words(<object>m, tmp, al, nw)
                    for w in range(nw):
                        gw[w] |= tmp[w]
            slow = False
            m = PyDict_GetItemWithError(cpu, k) if has_cpu else NULL
            if m == NULL:
                memset(cw, 0, nw * sizeof(uint64_t))
            else:
                _mask_words(<object>m, cw, al, nw)
                slow = True
            m = PyDict_GetItemWithError(disk, k) if has_disk else NULL
            if m == NULL:
                memset(dw, 0, nw * sizeof(uint64_t))
            else:
                _mask_words(<object>m, dw, al, nw)
                slow = True
            changed = False
            for w in range(nw):
                cur = gw[w] | cw[w] | dw[w]
                if alive[w] & cur != alive[w]:
                    changed = True
                    break
            if changed:
                depth = i
                any_alive = False
                for w in range(nw):
                    cur = gw[w] | cw[w] | dw[w]
                    if i:  # a slot without block 0 matches nothing: not in the result
                        gone = alive[w] & ~cur
                        while gone:
                            counts[w * 64 + kv_ctz64(gone)] = depth
                            gone &= gone - 1
                    alive[w] &= cur
                    if alive[w]:
                        any_alive = True
                if not any_alive:
                    break
            if slow:
                # Slots still counting block i that hold it on CPU/disk only: its best medium.
                for w in range(nw):
                    x = (cw[w] | dw[w]) & ~gw[w] & alive[w]
                    while x:
                        b = w * 64 + kv_ctz64(x)
                        if cw[w] >> (b - w * 64) & 1:
                            ncpu[b] += 1
                        else:
                            ndisk[b] += 1
                        x &= x - 1
        else:
            depth = n
            for w in range(nw):
                x = alive[w]
                while x:
                    counts[w * 64 + kv_ctz64(x)] = depth
                    x &= x - 1
        for b in range(nb):
            if ncpu[b]:
                n_cpu[b] = <Py_ssize_t>ncpu[b]
            if ndisk[b]:
                n_disk[b] = <Py_ssize_t>ndisk[b]
        return counts, n_cpu, n_disk
    finally:
        PyMem_Free(buf)


# -- Token-id prompts (scorer.tokens.service.Tokenization._ids_bytes is the reference) -----

def ids_u32_bytes(list ids):
    """A JSON token-id list as little-endian uint32 bytes, in one pass: TypeError when any
    item is not exactly an int (a bool, float or str is not a token id), else OverflowError
    when any is outside [0, 2**32) — the reference's order of checks."""
    cdef Py_ssize_t n = len(ids), i
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 4 * n)
    cdef char* buf = PyBytes_AS_STRING(out)
    cdef long long x
    cdef int ovf
    cdef bint over = False
    cdef uint32_t le
    cdef object v
    for i in range(n):
        v = ids[i]
        if type(v) is not int:
            raise TypeError("token ids must be ints")
        x = PyLong_AsLongLongAndOverflow(v, &ovf)
        if ovf != 0 or x < 0 or x > <long long>U32MAX:
            over = True
            continue
        le = kv_le32(<uint32_t>x)
        memcpy(buf + 4 * i, &le, 4)
    if over:
        raise OverflowError("token id out of the uint32 range")
    return out


cdef inline bint _json_ws(uint8_t b) noexcept nogil:
    return b == 0x20 or b == 0x0A or b == 0x0D or b == 0x09  # JSON's four (RFC 8259 §2)


def json_ids_u32(buf, Py_ssize_t pos):
    """The value after a JSON object key ending at buf[pos] (`: [ids]`), when it is a plain
    array of non-negative integers below 2**32: (its ids as little-endian uint32 bytes, the
    array's start, its end), without one Python int per id; else None (empty, negative, out
    of range, a fraction or exponent, a nested list, any other value, malformed JSON), and
    the caller decodes the body with msgspec, the reference (scorer/body.py)."""
    cdef Py_buffer view
    cdef const uint8_t* base
    cdef const uint8_t* p
    cdef const uint8_t* end
    cdef const uint8_t* start = NULL
    cdef uint32_t* out = NULL
    cdef Py_ssize_t n = 0, cap
    cdef uint64_t v
    cdef bint ok = False
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        if pos < 0 or pos > view.len:
            return None
        base = <const uint8_t*>view.buf
        p = base + pos
        end = base + view.len
        # Every id takes a digit and a separator: this bounds the count.
        cap = (view.len - pos + 1) // 2
        out = <uint32_t*>PyMem_Malloc((cap + 1) * 4)
        if out == NULL:
            raise MemoryError()
        with nogil:
            while p < end and _json_ws(p[0]):
                p += 1
            if p < end and p[0] == 0x3A:  # ':'
                p += 1
                while p < end and _json_ws(p[0]):
                    p += 1
                if p < end and p[0] == 0x5B:  # '['
                    start = p
                    p += 1
                    while True:
                        while p < end and _json_ws(p[0]):
                            p += 1
                        if p >= end or p[0] < 0x30 or p[0] > 0x39:
                            break  # not a digit: '-', ']', a nested list, a string, ...
                        v = p[0] - 0x30
                        p += 1
                        if v == 0:
                            if p < end and 0x30 <= p[0] <= 0x39:
                                break  # a leading zero: malformed JSON, msgspec's error
                        else:
                            while p < end and 0x30 <= p[0] <= 0x39 and v <= U32MAX:
                                v = v * 10 + (p[0] - 0x30)
                                p += 1
                            if v > U32MAX:
                                break  # out of range: the reference refuses it
                        if p < end and (p[0] == 0x2E or p[0] == 0x65 or p[0] == 0x45):
                            break  # '.', 'e', 'E': a float to JSON and to msgspec
                        out[n] = kv_le32(<uint32_t>v)
                        n += 1
                        while p < end and _json_ws(p[0]):
                            p += 1
                        if p < end and p[0] == 0x2C:  # ','
                            p += 1
                            continue
                        if p < end and p[0] == 0x5D:  # ']'
                            p += 1
                            ok = True
                        break
        if not ok:
            return None
        return (
            PyBytes_FromStringAndSize(<char*>out, 4 * n),
            <Py_ssize_t>(start - base),
            <Py_ssize_t>(p - base),
        )
    finally:
        PyMem_Free(out)
        PyBuffer_Release(&view)


# ---------------------------------------------------------------- ext_proc response chunks
# `chunk_lane` is `H2Connection.one_message` + the servicer's answerer (`_answerer`'s
# body-chunk case: `wire.body_chunk`'s common shapes, `wire.streamed_body_response`,
# `H2Stream.write_now`, `after_write`) + `grant`, for the one frame shape Envoy sends per
# streamed response chunk. It decides from the same state, changes the same state in the
# same order and writes the same bytes; whenever anything is off the common case it
# returns False having changed nothing, and the Python path (the reference) takes the frame.

cdef Py_ssize_t _RECV_WINDOW = 8 * 1024 * 1024  # scorer/extproc/transport/limits.py
cdef Py_ssize_t _CONN_RECV_WINDOW = 16 * 1024 * 1024


cdef inline _grant(conn, s, Py_ssize_t flow_len):
    """`H2Connection.grant(s, flow_len)`: below both batching thresholds it only adds the
    credit; at a threshold the Python method sends the WINDOW_UPDATEs."""
    cc = conn.conn_credit + flow_len
    c = s._credit + flow_len
    if cc < _CONN_RECV_WINDOW // 4 and c < _RECV_WINDOW // 4:
        conn.conn_credit = cc
        s._credit = c
    else:
        conn.grant(s, flow_len)
cdef uint8_t _TAG_RESPONSE_BODY = (5 << 3) | 2  # ProcessingRequest.response_body, LEN
cdef uint8_t _TAG_METADATA = (8 << 3) | 2  # ProcessingRequest.metadata_context, LEN
cdef uint8_t _TAG_RESP_RESPONSE_BODY = (4 << 3) | 2  # ProcessingResponse.response_body


cdef inline Py_ssize_t _vlen(Py_ssize_t x) noexcept nogil:
    cdef Py_ssize_t k = 1
    while x >= 0x80:
        x >>= 7
        k += 1
    return k


cdef inline uint8_t* _put_varint(uint8_t* o, Py_ssize_t x) noexcept nogil:
    while x >= 0x80:
        o[0] = <uint8_t>((x & 0x7F) | 0x80)
        x >>= 7
        o += 1
    o[0] = <uint8_t>x
    return o + 1


cdef inline bint _fits(conn, s, Py_ssize_t n):
    """An answer DATA frame of `n` payload bytes may go out now on stream `s`
    (`H2Stream.write_now`'s checks: frame size, both send windows, writes not paused,
    the stream not over)."""
    return not (
        n > conn.peer_max_frame
        or n > conn.send_window
        or n > conn.peer_initial_window + s.send_credit
        or conn.write_paused is not None
        or s._done
    )


cdef inline uint8_t* _data_head(uint8_t* o, Py_ssize_t sid, Py_ssize_t msg):
    """Write a DATA frame's header (length msg + 5, no flags, stream `sid`) and the gRPC
    prefix of a `msg`-byte message at `o`; returns where the message goes."""
    cdef Py_ssize_t n = msg + 5
    o[0] = <uint8_t>(n >> 16); o[1] = <uint8_t>(n >> 8); o[2] = <uint8_t>n
    o[3] = 0; o[4] = 0
    o[5] = <uint8_t>(sid >> 24); o[6] = <uint8_t>(sid >> 16); o[7] = <uint8_t>(sid >> 8)
    o[8] = <uint8_t>sid
    o[9] = 0
    o[10] = <uint8_t>(msg >> 24); o[11] = <uint8_t>(msg >> 16); o[12] = <uint8_t>(msg >> 8)
    o[13] = <uint8_t>msg
    return o + 14


def chunk_lane(conn, s, object data, Py_ssize_t start, Py_ssize_t end, tuple lane):
    """Answer the DATA frame payload `data[start:end]` (no flags) on stream `s` of
    H2Connection `conn` when it is one whole gRPC message holding a response-body chunk in
    a common shape; `lane` = (duplex, continue_body bytes, valid_meta set,
    director.response_chunk, request id). True: answered and accounted exactly as
    `one_message` with the servicer's answerer would; False: nothing changed."""
    if type(data) is not bytes or not conn.receiving:
        return False  # (outside data_received the director's part would run inside)
    cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t flow_len = end - start
    cdef Py_ssize_t b = start + 5  # the message
    cdef Py_ssize_t n, pos, hb_end, ml, q, m, after, st, bq = 0, blen = 0
    cdef bint eos = False
    cdef object meta = b""
    if flow_len <= 5 or end > len(data) or p[start] != 0 or <Py_ssize_t>kv_be32(p + start + 1) + 5 != flow_len:
        return False
    if flow_len - 5 > conn.server.max_message:
        return False
    if s._half_closed or s._buf or s._msgs or s._sizes is None:
        return False
    if s._unacked + flow_len > _RECV_WINDOW or conn.recv_unacked + flow_len > _CONN_RECV_WINDOW:
        return False
    w = s._waiter
    if w is None or w.done() or s.fast is None:
        return False
    # wire.body_chunk's fast shapes (field 5), relative to the message at `b`.
    if not (end - b > 3 and p[b] == _TAG_RESPONSE_BODY):
        return False
    n = p[b + 1]
    pos = b + 2
    if n >= 0x80 and p[b + 2] < 0x80:
        n = (n & 0x7F) | (<Py_ssize_t>p[b + 2] << 7)
        pos = b + 3
    hb_end = pos + n
    if not ((n < 0x80 or pos == b + 3) and n > 1 and hb_end <= end):
        return False
    if hb_end < end:
        ml = p[hb_end + 1] if hb_end + 1 < end else -1
        st = hb_end + 2
        if ml >= 0x80:
            if st < end and p[st] < 0x80:
                ml = (ml & 0x7F) | (<Py_ssize_t>p[st] << 7)
                st += 1
            else:
                return False
        if p[hb_end] == _TAG_METADATA and ml >= 0 and st + ml == end:
            meta = PyBytes_FromStringAndSize(<const char*>p + st, end - st)
        else:
            return False
    if p[pos] == 0x0A:
        m = p[pos + 1]
        q = pos + 2
        if m >= 0x80 and q < hb_end and p[q] < 0x80:
            m = (m & 0x7F) | (<Py_ssize_t>p[q] << 7)
            q += 1
        if not (m and (m < 0x80 or q == pos + 3)):
            return False
        after = q + m
        if after == hb_end:
            eos = False
        elif after + 2 == hb_end and p[after] == 0x10 and p[after + 1] == 1:
            eos = True
        else:
            return False
        bq = q
        blen = m
    elif n == 2 and p[pos] == 0x10 and p[pos + 1] == 1:
        eos = True
    else:
        return False
    duplex, continue_body, valid_meta, response_chunk, rid = lane
    if meta and meta not in <set>valid_meta:
        return False  # the Python path checks (and remembers) a new value
    # The answer's size (H2Stream.write_now's checks), before building it.
    cdef Py_ssize_t l0 = 0, l1 = 0, l2 = 0, l3 = 0, msg
    if duplex:
        l0 = (1 + _vlen(blen) if blen else 0) + blen + (2 if eos else 0)
        l1 = 1 + _vlen(l0) + l0
        l2 = 1 + _vlen(l1) + l1
        l3 = 1 + _vlen(l2) + l2
        msg = 1 + _vlen(l3) + l3
    else:
        msg = len(<bytes>continue_body)
    cdef Py_ssize_t total = msg + 5
    if not s._headers_sent or not _fits(conn, s, total):
        return False
    body = PyBytes_FromStringAndSize(<const char*>p + bq, blen) if blen else b""
    out = PyBytes_FromStringAndSize(NULL, 9 + total)
    cdef Py_ssize_t sid = s.sid
    cdef uint8_t* o = _data_head(<uint8_t*>PyBytes_AS_STRING(out), sid, msg)
    if duplex:
        # wire._streamed_head, then the body, then end_of_stream.
        o[0] = _TAG_RESP_RESPONSE_BODY
        o = _put_varint(o + 1, l3)
        o[0] = 0x0A
        o = _put_varint(o + 1, l2)
        o[0] = 0x1A
        o = _put_varint(o + 1, l1)
        o[0] = 0x1A
        o = _put_varint(o + 1, l0)
        if blen:
            o[0] = 0x0A
            o = _put_varint(o + 1, blen)
            memcpy(o, p + bq, blen)
            o += blen
        if eos:
            o[0] = 0x10
            o[1] = 1
    else:
        memcpy(o, PyBytes_AS_STRING(<bytes>continue_body), msg)
    # conn.send (inside data_received: one write at its end), the windows.
    if not conn.closed:
        (<list>conn.out).append(out)
    conn.send_window -= total
    s.send_credit -= total
    # after_write(director.response_chunk, rid, body, eos): once the answers are written.
    (<list>conn.deferred).append((s, response_chunk, (rid, body, eos)))
    # one_message's accounting.
    conn.recv_unacked += flow_len
    s._unacked += flow_len
    if conn.owed:
        conn.release(s, 0)
    big = conn.big_sid == sid
    if conn.buffered <= conn.limits.max_buffered or big:
        _grant(conn, s, flow_len)
    else:
        s._owed += flow_len
        conn.owed += flow_len
        conn.owing.add(s)
    if big:
        conn.big_sid = 0
    return True


# ---------------------------------------------------------------- ext_proc request frames
# `frame_lane` is `H2Connection.receive`'s frame loop (what follows its buffering and the
# connection preface), with `queue_message` + `grant` compiled in (`_queue`): the lean
# shape's request messages (each one whole message in a DATA frame without flags) are
# queued for the handler without a Python frame per DATA frame. Every other frame goes to
# the Python handlers the loop calls (`on_frame`, and `one_message` / the chunk lane for a
# stream answered in the frame loop), in the same order, with the same arguments. `_queue`
# decides from the same state and changes the same state in the same order as
# `queue_message`; when a check fails it changes nothing and `on_frame` takes the frame.

cdef Py_ssize_t _OUR_MAX_FRAME = 1024 * 1024  # scorer/extproc/transport/limits.py
cdef int _FRAME_SIZE_ERROR = 0x6  # scorer/extproc/transport/frames.py


cdef inline _schedule(conn, s):
    """`H2Stream.schedule`: step the task-less handler at the end of this read."""
    if s._ready:
        return
    s._ready = True
    if conn.receiving:
        (<list>conn.ready).append(s)
    else:
        conn.loop.call_soon(s.step)


cdef inline _start_or_wake(conn, s):
    """`H2Stream.start` when the handler has not started, else `H2Stream._wake`."""
    handler = s.handler
    if handler is not None:
        s.handler = None
        s._coro = conn.server.run(s, handler)
        _schedule(conn, s)
        return
    w = s._waiter
    if w is not None and not w.done():
        w.set_result(None)
        if s._coro is not None:
            _schedule(conn, s)


cdef int _queue(conn, s, bytes data, Py_ssize_t start, Py_ssize_t end) except -1:
    """`H2Connection.queue_message` for `data[start:end]` (length > 5): 1 when queued,
    0 with nothing changed."""
    cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t flow_len = end - start
    cdef Py_ssize_t n = flow_len - 5
    if p[start] != 0 or <Py_ssize_t>kv_be32(p + start + 1) != n:
        return 0
    if n > conn.server.max_message:
        return 0
    if s._half_closed or s._buf or s._sizes is None:
        return 0
    cdef Py_ssize_t unacked = s._unacked
    cdef Py_ssize_t recv_unacked = conn.recv_unacked
    cdef Py_ssize_t buffered = conn.buffered
    if unacked + flow_len > _RECV_WINDOW or recv_unacked + flow_len > _CONN_RECV_WINDOW:
        return 0
    if buffered + flow_len > conn.limits.max_buffered:
        return 0
    deserialize = s._deserialize
    raw = PyBytes_FromStringAndSize(<const char*>p + start + 5, n)
    if deserialize is None:
        msg = raw
    else:
        try:
            msg = deserialize(raw)
        except Exception:
            return 0  # the general path reports it
    conn.recv_unacked = recv_unacked + flow_len
    s._unacked = unacked + flow_len
    s._held += flow_len
    conn.buffered = buffered + flow_len
    s._msgs.append(msg)
    s._sizes.append(flow_len)
    _grant(conn, s, flow_len)
    if conn.big_sid == s.sid:
        conn.big_sid = 0  # its message is complete
    _start_or_wake(conn, s)
    return 1


def queue_lane(conn, s, bytes data, Py_ssize_t start, Py_ssize_t end):
    """`H2Connection.queue_message(s, data, start, end)` compiled (what `frame_lane` runs
    for a DATA frame without flags on a stream not answered in the frame loop): True when
    the message was queued, accounted exactly as the Python method does; False, nothing
    changed, when it does not apply."""
    if start < 0 or end > len(data) or end - start <= 5:
        return False
    return _queue(conn, s, data, start, end) == 1


cdef object _EOF = None  # scorer.extproc.transport.stream.EOF (grpc.aio's), on first use
cdef Py_ssize_t _MAX_WINDOW = 2**31 - 1


cdef object _frame(conn, int ftype, int flags, Py_ssize_t sid, object payload,
                   const uint8_t* p, Py_ssize_t length):
    """`conn.on_frame(ftype, flags, sid, payload)` (payload at `p`, `length` bytes), with
    its dispatch and the lean shape's frames compiled: HEADERS of one whole header block
    (`on_headers_frame` down to `on_header_block`), the empty DATA frame ending a stream
    (`on_data_frame` + `H2Stream.on_data`), WINDOW_UPDATE on the connection (Envoy's
    after each request) and RST_STREAM. Anything else, or any check that would fail, goes
    to the Python method that handles it, from unchanged state."""
    global _EOF
    if conn.cont_sid:
        return conn.on_frame(ftype, flags, sid, payload)
    if ftype == 0:  # DATA
        if flags == 1 and length == 0 and sid != 0:
            # on_data_frame for an empty END_STREAM: no bytes to account; on_data queues
            # EOF and starts or wakes the handler.
            s = (<dict>conn.streams).get(sid)
            if (
                s is not None
                and not s._half_closed
                and not s._buf
                and conn.recv_unacked <= _CONN_RECV_WINDOW
                and s._unacked <= _RECV_WINDOW
            ):
                if _EOF is None:
                    from scorer.extproc.transport.stream import EOF as eof
                    _EOF = eof
                s._half_closed = True
                s._msgs.append(_EOF)
                _start_or_wake(conn, s)
                return True
        return conn.on_data_frame(flags, sid, payload)
    if ftype == 1:  # HEADERS
        if (
            flags & 0x2C == 0x04  # END_HEADERS, neither PADDED nor PRIORITY
            and sid != 0
            and length <= conn.limits.max_header_list
            and conn.settings_seen
        ):
            return conn.on_header_block(sid, flags, PyBytes_FromStringAndSize(<const char*>p, length))
        return conn.on_headers_frame(flags, sid, payload)
    if ftype == 4 or ftype == 9 or not conn.settings_seen:  # SETTINGS, CONTINUATION
        return conn.on_frame(ftype, flags, sid, payload)
    cdef Py_ssize_t inc, window
    if ftype == 8:  # WINDOW_UPDATE
        if sid == 0 and length == 4:
            inc = <Py_ssize_t>(kv_be32(p) & 0x7FFFFFFF)
            window = conn.send_window
            if inc != 0 and window + inc <= _MAX_WINDOW:
                conn.send_window = window + inc
                if conn.window_waiters:
                    conn.wake_writers()
                return True
        return conn.on_window_update(sid, payload)
    if ftype == 3 and length == 4 and sid != 0 and sid <= conn.last_sid:  # RST_STREAM
        s = (<dict>conn.streams).get(sid)
        if s is not None:
            conn.drop(s)
            s.on_reset()
            if s.handler is None and not s._headers_sent:  # started, unanswered
                return conn.premature_reset()
        return True
    return conn.on_frame(ftype, flags, sid, payload)


def frame_lane(conn, object data):
    """`H2Connection.receive`'s frame loop over `data` (bytes, after the buffered bytes
    and the preface were handled): parses each frame's header, queues one-message DATA
    frames (`queue_message`), hands a stream answered in the frame loop's frame to
    `conn.chunk_lane` / `conn.one_message` and every other frame to `conn.on_frame`; keeps
    an incomplete frame in `conn.buf`. False (nothing done) when `data` is not bytes: the
    Python loop then runs."""
    if type(data) is not bytes:
        return False
    _frames(conn, <bytes>data)
    return True


cdef _frames(conn, bytes data):
    """`frame_lane`'s loop."""
    cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = len(data), pos = 0, length, end
    cdef int ftype, flags
    cdef Py_ssize_t sid
    cdef object view = None
    cdef dict streams = conn.streams
    lane = conn.chunk_lane
    while n - pos >= 9:
        length = (<Py_ssize_t>p[pos] << 16) | (<Py_ssize_t>p[pos + 1] << 8) | p[pos + 2]
        ftype = p[pos + 3]
        flags = p[pos + 4]
        sid = <Py_ssize_t>(kv_be32(p + pos + 5) & 0x7FFFFFFF)
        if length > _OUR_MAX_FRAME:
            conn.abort_connection("frame too large", _FRAME_SIZE_ERROR)
            return
        if n - pos < 9 + length:
            conn.need = 9 + length
            break
        end = pos + 9 + length
        if ftype == 0 and flags == 0 and length > 5 and not conn.cont_sid:
            # The one-message lane (see receive).
            s = streams.get(sid)
            if s is not None:
                if s.fast is not None:
                    if (
                        (s.lane is not None
                         and lane is not None
                         and lane(conn, s, data, pos + 9, end, s.lane))
                        or conn.one_message(s, data, pos + 9, end)
                    ):
                        pos = end
                        continue
                elif _queue(conn, s, <bytes>data, pos + 9, end):
                    pos = end
                    continue
        if view is None:
            view = memoryview(data)
        payload = view[pos + 9 : end]
        pos = end
        if _frame(conn, ftype, flags, sid, payload, p + end - length, length) is False:
            return
    else:
        conn.need = 9
    if pos < n:
        if view is None:
            view = memoryview(data)
        buf = conn.buf
        buf += view[pos:]


def take_lane(s):
    """The end of `H2Stream.read` once a message is queued: the next message (or EOF) off
    stream `s`'s queue, its bytes released (`H2Connection.release`) when it was counted."""
    global _EOF
    m = s._msgs.popleft()
    sizes = s._sizes
    if sizes:
        if _EOF is None:
            from scorer.extproc.transport.stream import EOF as eof
            _EOF = eof
        if m is not _EOF:
            n = sizes.popleft()
            conn = s.conn
            if conn.owed:
                conn.release(s, n)  # owed credit to return: the Python method does it all
            else:
                s._held -= n
                conn.buffered -= n
    return m


# ---------------------------------------------------------------- ext_proc answers
# `write_lane` is `H2Stream.write_now` (what `H2Stream.write` runs for every answer that
# fits one DATA frame): the same checks, the same frames queued by the same sends (the
# response HEADERS once, then one DATA frame), the same window and balance updates.

cdef object _RESPONSE_HEADERS_FRAME = None  # frame(HEADERS, END_HEADERS, 0, RESPONSE_HEADERS)


cdef inline _send(conn, bytes out):
    """`H2Connection.send(out)`."""
    if conn.closed:
        return
    (<list>conn.out).append(out)
    if not conn.flush_scheduled and not conn.receiving:
        conn.flush_scheduled = True
        conn.loop.call_soon(conn.flush)


def write_lane(s, object data):
    """`s.write_now(data)` for H2Stream `s` (data: one serialized response message): True
    when it was queued as one DATA frame (after the response HEADERS, the first time),
    False with nothing changed when it has to wait."""
    global _RESPONSE_HEADERS_FRAME
    if type(data) is not bytes:
        return s.write_now(data)
    conn = s.conn
    cdef Py_ssize_t m = len(<bytes>data)
    cdef Py_ssize_t n = m + 5
    if not _fits(conn, s, n):
        return False
    cdef Py_ssize_t sid = s.sid
    cdef uint8_t* o
    if not s._headers_sent:
        s._headers_sent = True
        conn.reset_balance += 1  # an answered stream (rapid reset accounting)
        if _RESPONSE_HEADERS_FRAME is None:
            from scorer.extproc.transport.hpack_codec import RESPONSE_HEADERS
            from scorer.extproc.transport.frames import END_HEADERS, HEADERS, frame
            _RESPONSE_HEADERS_FRAME = frame(HEADERS, END_HEADERS, 0, RESPONSE_HEADERS)
        hdr = PyBytes_FromStringAndSize(
            PyBytes_AS_STRING(<bytes>_RESPONSE_HEADERS_FRAME), len(<bytes>_RESPONSE_HEADERS_FRAME)
        )
        o = <uint8_t*>PyBytes_AS_STRING(hdr)
        o[5] = <uint8_t>(sid >> 24); o[6] = <uint8_t>(sid >> 16); o[7] = <uint8_t>(sid >> 8)
        o[8] = <uint8_t>sid
        _send(conn, hdr)
    # DATA_MSG.pack((n << 8) | DATA, 0, sid, 0, n - 5) + data
    out = PyBytes_FromStringAndSize(NULL, 9 + n)
    memcpy(_data_head(<uint8_t*>PyBytes_AS_STRING(out), sid, m), PyBytes_AS_STRING(<bytes>data), m)
    _send(conn, out)
    conn.send_window -= n
    s.send_credit -= n
    return True


# The transport constants the lanes above compile in, for the test that holds them to
# scorer/extproc/transport (limits.py, frames.py): (RECV_WINDOW, CONN_RECV_WINDOW,
# OUR_MAX_FRAME, MAX_WINDOW, FRAME_SIZE_ERROR).
LANE_CONSTANTS = (_RECV_WINDOW, _CONN_RECV_WINDOW, _OUR_MAX_FRAME, _MAX_WINDOW, _FRAME_SIZE_ERROR)
