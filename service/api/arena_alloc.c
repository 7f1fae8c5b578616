/* The wire arena's share for Python objects: CPython's object allocator (PYMEM_DOMAIN_OBJ) hooked
 * so that a new object of THRESHOLD bytes or more made by an armed thread (the one that installed
 * the window: a front end's event loop, where grpc receives its messages and the handlers make their
 * responses) is placed in a window of the wire arena's shared memory, everything else going to the
 * allocator it wraps. See service/api/arena_objects.py for why (a gRPC message's bytes, which grpc
 * allocates, then lie where the ranks read and write). Other threads' large objects (a rank
 * thread's, a copy thread's) stay in the heap: the window is for messages, not interpreter state.
 *
 * One window per process, mapped here from the arena's file (MAP_SHARED) and never unmapped: an
 * object placed in it may be freed at any time, interpreter shutdown included. Every page of the
 * window is written once at install, before any rank maps the arena (a page's first write fault
 * moves a shared file's ctime, which a rank takes for a changed object).
 *
 * Blocks: first fit over a sorted array of free extents (start, length), whole pages, with a
 * HEADER before the pointer handed out holding the block's length and a mark (a free of a pointer
 * whose mark is not there aborts: it would otherwise corrupt the free list). The array can never
 * overflow: a block is at least THRESHOLD bytes, so there are at most window / THRESHOLD blocks and
 * one more free extent than blocks. The OBJ domain is only ever called with the GIL held, and so
 * is everything here (the module loads this library with ctypes.PyDLL, which keeps the GIL; it
 * refuses a build of Python without one).
 *
 * fork(): the window is MAP_SHARED and every placed object's header (its refcount, a GC object's
 * links) lies in it, so a child forked after the install would write its parent's objects. Three
 * pthread_atfork handlers give the child a private copy of the window as it was at the fork. The
 * prepare handler runs in the parent before fork(), with the GIL held, so the books are consistent
 * and no Python thread writes an object's header. It copies the live blocks into an anonymous
 * private mapping, extent by extent between the free ones. The child inherits that mapping
 * copy-on-write and moves it over the window at the same address before any Python runs there; it
 * then owns its copies as it owns the rest of its heap, and places nothing new. The parent drops its
 * reference. So a fork costs a copy of the window's live bytes, in the parent: ~0.1 s for ~120 MiB.
 * The server itself never forks; this is for anything else in the process. If the copy cannot be
 * made (no memory), the child's window becomes inaccessible: a child that touches a placed object
 * crashes rather than corrupting its parent. A forked child's own forks copy nothing: its window is
 * ordinary private memory. */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* mremap */
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define HEADER 64 /* a block's length and mark; keeps the pointer 64-byte aligned */
#define MARK 0x6d6f652d61726e61ULL

typedef struct {
    size_t start, length;
} extent;

static PyMemAllocatorEx wrapped;
static char *base;
static size_t window, threshold, page;
static extent *free_list;
static size_t n_free, capacity;
static size_t used, blocks, placed_total, refused_total;
static int detached;          /* a forked child: its window is a private copy; nothing new goes there */
static _Thread_local int armed; /* this thread's large objects are placed (moe_arena_objects_arm) */

static int inside(const void *p) { return base != NULL && (const char *)p >= base && (const char *)p < base + window; }

static void *take(size_t n) {
    if (n > window) {
        refused_total++;
        return NULL;
    }
    size_t length = (n + HEADER + page - 1) / page * page;
    for (size_t i = 0; i < n_free; i++) {
        if (free_list[i].length < length) continue;
        size_t start = free_list[i].start;
        if (free_list[i].length == length) {
            memmove(&free_list[i], &free_list[i + 1], (n_free - i - 1) * sizeof(extent));
            n_free--;
        } else {
            free_list[i].start += length;
            free_list[i].length -= length;
        }
        uint64_t *head = (uint64_t *)(base + start);
        head[0] = length;
        head[1] = MARK;
        used += length;
        blocks++;
        placed_total++;
        return base + start + HEADER;
    }
    refused_total++;
    return NULL;
}

static size_t block_length(const void *p) { return (size_t)((const uint64_t *)((const char *)p - HEADER))[0]; }

static void give(void *p) {
    uint64_t *head = (uint64_t *)((char *)p - HEADER);
    if (head[1] != MARK) abort(); /* not a block of ours, or freed twice */
    head[1] = 0;
    size_t start = (size_t)((char *)head - base), length = (size_t)head[0];
    used -= length;
    blocks--;
    size_t i = 0; /* the first free extent after the block */
    while (i < n_free && free_list[i].start < start) i++;
    int after = i < n_free && start + length == free_list[i].start;
    int before = i > 0 && free_list[i - 1].start + free_list[i - 1].length == start;
    if (before && after) {
        free_list[i - 1].length += length + free_list[i].length;
        memmove(&free_list[i], &free_list[i + 1], (n_free - i - 1) * sizeof(extent));
        n_free--;
    } else if (before) {
        free_list[i - 1].length += length;
    } else if (after) {
        free_list[i].start = start;
        free_list[i].length += length;
    } else {
        if (n_free == capacity) abort(); /* cannot happen: see the bound above */
        memmove(&free_list[i + 1], &free_list[i], (n_free - i) * sizeof(extent));
        free_list[i].start = start;
        free_list[i].length = length;
        n_free++;
    }
}

static void *hook_malloc(void *ctx, size_t n) {
    (void)ctx;
    if (n >= threshold && armed && !detached) {
        void *p = take(n);
        if (p != NULL) return p;
    }
    return wrapped.malloc(wrapped.ctx, n);
}

static void *hook_calloc(void *ctx, size_t nelem, size_t elsize) {
    (void)ctx;
    return wrapped.calloc(wrapped.ctx, nelem, elsize); /* zeroed objects stay in the process's heap */
}

static void *hook_realloc(void *ctx, void *p, size_t n) {
    (void)ctx;
    if (!inside(p)) return wrapped.realloc(wrapped.ctx, p, n); /* a growing object never moves in */
    size_t have = block_length(p) - HEADER;
    if (n <= have && (n >= threshold || n >= have / 2)) return p; /* fits: stays */
    void *q = wrapped.malloc(wrapped.ctx, n ? n : 1);
    if (q == NULL) return NULL;
    memcpy(q, p, n < have ? n : have);
    give(p);
    return q;
}

static void hook_free(void *ctx, void *p) {
    (void)ctx;
    if (inside(p))
        give(p);
    else
        wrapped.free(wrapped.ctx, p);
}

/* fork() (above): the snapshot taken in the parent (prepare), moved over the window in the child, dropped
 * by the parent. A detached process's window is private already. */
static char *snapshot;

static void before_fork(void) {
    if (base == NULL || detached) return;
    char *copy = mmap(NULL, window, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (copy == MAP_FAILED) return;
    size_t at = 0;
    for (size_t i = 0; i <= n_free; i++) {
        size_t end = i < n_free ? free_list[i].start : window;
        if (end > at) memcpy(copy + at, base + at, end - at);
        if (i < n_free) at = free_list[i].start + free_list[i].length;
    }
    snapshot = copy;
}

static void after_fork_in_parent(void) {
    if (snapshot != NULL) munmap(snapshot, window);
    snapshot = NULL;
}

static void after_fork_in_child(void) {
    if (base == NULL || detached) return;
    detached = 1;
    if (snapshot != NULL && mremap(snapshot, window, window, MREMAP_MAYMOVE | MREMAP_FIXED, base) != MAP_FAILED) {
        snapshot = NULL;
        return;
    }
    if (mmap(base, window, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) _exit(70);
}

/* Map `length` bytes of the file `fd` from `offset` (both whole pages), write each page once and
 * place the objects of `min_bytes` or more there from now on. Returns the window's address, or 0
 * (errno set) when it cannot be mapped, when one is already installed in this process, or when an
 * argument is not whole pages. */
uintptr_t moe_arena_objects_install(int fd, size_t offset, size_t length, size_t min_bytes) {
    page = (size_t)sysconf(_SC_PAGESIZE);
    if (base != NULL || length == 0 || offset % page || length % page || min_bytes < page) {
        errno = EINVAL;
        return 0;
    }
    capacity = length / min_bytes + 2;
    free_list = (extent *)PyMem_RawMalloc(capacity * sizeof(extent));
    if (free_list == NULL) {
        errno = ENOMEM;
        return 0;
    }
    void *at = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)offset);
    if (at == MAP_FAILED) {
        PyMem_RawFree(free_list);
        free_list = NULL;
        return 0;
    }
    volatile char *touch = (volatile char *)at;
    for (size_t i = 0; i < length; i += page) touch[i] = touch[i];
    window = length;
    threshold = min_bytes;
    free_list[0].start = 0;
    free_list[0].length = length;
    n_free = 1;
    base = (char *)at;
    if (pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child)) {
        munmap(at, length);
        base = NULL;
        PyMem_RawFree(free_list);
        free_list = NULL;
        errno = ENOMEM;
        return 0;
    }
    armed = 1;
    PyMemAllocatorEx hook = {NULL, hook_malloc, hook_calloc, hook_realloc, hook_free};
    PyMem_GetAllocator(PYMEM_DOMAIN_OBJ, &wrapped);
    PyMem_SetAllocator(PYMEM_DOMAIN_OBJ, &hook);
    return (uintptr_t)at;
}

/* Place the large objects the calling thread makes from now on (on != 0), or stop. The installing
 * thread is armed by the install. */
void moe_arena_objects_arm(int on) { armed = on != 0; }

/* What the window holds now and has done: [bytes in blocks, blocks, free extents, objects placed,
 * objects of min_bytes or more made by an armed thread that found no room]. */
void moe_arena_objects_stats(size_t out[5]) {
    out[0] = used;
    out[1] = blocks;
    out[2] = n_free;
    out[3] = placed_total;
    out[4] = refused_total;
}
