"""NUMA memory policy and CPU affinity through raw Linux system calls (ctypes).

Why not a library: libnuma's Python bindings are unmaintained and the PyPI ``numa``
package does not build on Python 3.11, so this module calls ``mbind``,
``set_mempolicy``, ``get_mempolicy`` and ``move_pages`` through libc's ``syscall()``, with
``argtypes``/``restype`` declared, and uses :func:`os.sched_setaffinity` for threads.

Contract:

* Node numbers are checked against the nodes online here first, so binding to a node that
  does not exist raises :class:`NumaNodeError` (a :class:`KVTierUsageError`) naming the
  node and the nodes that do exist.
* A failing system call raises :class:`NumaError` naming the call, the errno and the fix
  (``EPERM``: moving other processes' pages needs ``CAP_SYS_NICE``; ``EINVAL``: a node
  outside this process's cpuset; ...).
* Off Linux, or on an architecture whose syscall numbers are unknown,
  :func:`unavailable_reason` says why and every call raises :class:`NumaError`.

``mbind`` works on whole pages: :func:`bind_buffer` binds the pages that lie entirely
inside the buffer (a buffer from ``mmap`` is page-aligned, so that is all of it).
Binding only decides where pages are placed when first touched (or, with ``move=True``,
migrates those already there); call it before the memory is written or pinned.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from kvtier.errors import KVTierError, KVTierUsageError

PAGE_SIZE = mmap.PAGESIZE
#: Bits in the node masks we pass (the kernel's MAX_NUMNODES is at most 1024).
_MASK_BITS = 1024
_WORD_BITS = ctypes.sizeof(ctypes.c_ulong) * 8
_MASK_WORDS = _MASK_BITS // _WORD_BITS

# (mbind, set_mempolicy, get_mempolicy, move_pages) per architecture.
_SYSCALLS: dict[str, tuple[int, int, int, int]] = {
    "x86_64": (237, 238, 239, 279),
    "aarch64": (235, 237, 236, 239),  # the generic table (arm64, riscv64)
    "arm64": (235, 237, 236, 239),
    "riscv64": (235, 237, 236, 239),
    "ppc64le": (259, 261, 260, 301),
}

# get_mempolicy flags and mbind flags (linux/mempolicy.h).
MPOL_F_NODE = 1
MPOL_F_ADDR = 2
MPOL_MF_STRICT = 1
MPOL_MF_MOVE = 2


class MemPolicy(IntEnum):
    """Linux memory policy modes."""

    DEFAULT = 0
    PREFERRED = 1
    BIND = 2
    INTERLEAVE = 3
    LOCAL = 4


class NumaError(KVTierError):
    """A NUMA system call failed, or NUMA calls are not possible on this machine."""


class NumaNodeError(KVTierUsageError):
    """A node number that does not exist here (or that this process may not use)."""


@dataclass(frozen=True)
class PolicyInfo:
    """A memory policy read back by :func:`get_mempolicy`.

    Attributes:
        mode: the policy mode.
        nodes: the nodes in its mask (empty for ``DEFAULT``/``LOCAL``).
    """

    mode: MemPolicy
    nodes: tuple[int, ...]


def _syscall_numbers() -> tuple[int, int, int, int] | None:
    if not sys.platform.startswith("linux"):
        return None
    return _SYSCALLS.get(platform.machine())


def unavailable_reason() -> str | None:
    """Why NUMA calls cannot work here, or ``None`` when they can."""
    if not sys.platform.startswith("linux"):
        return f"NUMA policy calls need Linux (this is {sys.platform})"
    if _syscall_numbers() is None:
        return f"syscall numbers unknown for architecture {platform.machine()!r}"
    return None


_libc: Any = None


def _lib() -> Any:
    global _libc
    reason = unavailable_reason()
    if reason is not None:
        raise NumaError(reason)
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        # syscall(long number, ...): variadic; every argument is passed with an explicit
        # ctypes type below, and the return value is a long.
        lib.syscall.restype = ctypes.c_long
        _libc = lib
    return _libc


_NodeMask = ctypes.c_ulong * _MASK_WORDS


def _mask(nodes: Iterable[int]) -> ctypes.Array[ctypes.c_ulong]:
    mask = _NodeMask()
    for n in nodes:
        mask[n // _WORD_BITS] |= 1 << (n % _WORD_BITS)
    return mask


def _unmask(mask: ctypes.Array[ctypes.c_ulong]) -> tuple[int, ...]:
    return tuple(
        w * _WORD_BITS + b
        for w in range(_MASK_WORDS)
        if mask[w]
        for b in range(_WORD_BITS)
        if mask[w] >> b & 1
    )


def _read_nodelist(path: str) -> tuple[int, ...]:
    from kvtier.topology import parse_cpulist  # same list syntax as CPU lists

    try:
        with open(path) as f:
            return parse_cpulist(f.read())
    except OSError:
        return (0,)  # a kernel without NUMA support: node 0 is all there is


def online_nodes() -> tuple[int, ...]:
    """Nodes online here (``/sys/devices/system/node/online``; ``(0,)`` without NUMA)."""
    return _read_nodelist("/sys/devices/system/node/online")


def memory_nodes() -> tuple[int, ...]:
    """Online nodes that have memory (``has_memory``; falls back to :func:`online_nodes`)."""
    nodes = _read_nodelist("/sys/devices/system/node/has_memory")
    return nodes or online_nodes()


def allowed_memory_nodes() -> tuple[int, ...]:
    """Nodes this process's cpuset lets it allocate from (``Mems_allowed_list``)."""
    from kvtier.topology import parse_cpulist

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Mems_allowed_list:"):
                    return parse_cpulist(line.split(":", 1)[1])
    except OSError:
        pass
    return memory_nodes()


def check_nodes(nodes: Iterable[int]) -> tuple[int, ...]:
    """Validate node numbers; returns them sorted and unique.

    Raises :class:`NumaNodeError` for an empty set, a negative or non-integer node, a node
    that does not exist, or one this process's cpuset forbids.
    """
    out = sorted(set(nodes))
    if not out:
        raise NumaNodeError("no NUMA node given")
    for n in out:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise NumaNodeError(f"NUMA node must be an integer >= 0, got {n!r}")
    online = online_nodes()
    missing = [n for n in out if n not in online]
    if missing:
        raise NumaNodeError(
            f"NUMA node {', '.join(map(str, missing))} does not exist on this machine "
            f"(online nodes: {', '.join(map(str, online))})"
        )
    allowed = allowed_memory_nodes()
    forbidden = [n for n in out if n not in allowed]
    if forbidden:
        raise NumaNodeError(
            f"NUMA node {', '.join(map(str, forbidden))} is outside this process's cpuset "
            f"(allowed memory nodes: {', '.join(map(str, allowed))})"
        )
    return tuple(out)


def _fail(call: str, err: int, detail: str = "") -> NumaError:
    hints = {
        errno.EPERM: "moving pages shared with other processes needs CAP_SYS_NICE",
        errno.EINVAL: "a node outside this process's cpuset, a bad mode or an unaligned range",
        errno.EFAULT: "the address range is not mapped",
        errno.ENOMEM: "the kernel ran out of memory for the policy",
        errno.EIO: "pages could not be moved (MPOL_MF_STRICT)",
        errno.ENOSYS: "the kernel was built without NUMA support",
    }
    hint = hints.get(err, "")
    msg = f"{call} failed: {os.strerror(err)} (errno {errno.errorcode.get(err, err)})"
    if detail:
        msg += f" {detail}"
    if hint:
        msg += f": {hint}"
    return NumaError(msg)


def _address_of(buf: Any) -> tuple[int, int]:
    """(address, length) of a writable contiguous buffer (numpy array, mmap, bytearray)."""
    try:
        import numpy as np

        if isinstance(buf, np.ndarray):
            if not buf.flags.c_contiguous:
                raise KVTierUsageError("buffer to bind must be C-contiguous")
            return int(buf.ctypes.data), int(buf.nbytes)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    try:
        view = memoryview(buf)
    except TypeError:
        raise KVTierUsageError(
            f"cannot bind a {type(buf).__name__}: need a numpy array or a writable buffer"
        ) from None
    if view.readonly:
        raise KVTierUsageError("buffer to bind must be writable")
    if not view.c_contiguous:
        raise KVTierUsageError("buffer to bind must be C-contiguous")
    char = (ctypes.c_char * view.nbytes).from_buffer(view)
    return ctypes.addressof(char), view.nbytes


def page_range(address: int, length: int) -> tuple[int, int]:
    """The whole pages inside ``[address, address + length)``: (start, length)."""
    start = -(-address // PAGE_SIZE) * PAGE_SIZE
    end = (address + length) // PAGE_SIZE * PAGE_SIZE
    return start, max(0, end - start)


def mbind(
    address: int,
    length: int,
    nodes: Iterable[int],
    mode: MemPolicy = MemPolicy.BIND,
    *,
    move: bool = False,
    strict: bool = False,
) -> None:
    """Set the memory policy of the page-aligned range ``[address, address + length)``.

    ``move`` migrates pages already placed elsewhere; ``strict`` makes that an error when
    a page cannot move. Raises :class:`NumaNodeError` for bad nodes, :class:`NumaError` for
    a failing call, :class:`KVTierUsageError` for an unaligned address.
    """
    if address % PAGE_SIZE:
        raise KVTierUsageError(f"mbind address {address:#x} is not {PAGE_SIZE}-byte aligned")
    if length <= 0:
        raise KVTierUsageError(f"mbind length must be > 0, got {length}")
    if mode in (MemPolicy.DEFAULT, MemPolicy.LOCAL):
        node_list: tuple[int, ...] = ()
        mask = None
    else:
        node_list = check_nodes(nodes)
        mask = _mask(node_list)
    nr = _syscall_numbers()
    lib = _lib()
    assert nr is not None
    flags = (MPOL_MF_MOVE if move else 0) | (MPOL_MF_STRICT if strict else 0)
    rc = lib.syscall(
        ctypes.c_long(nr[0]),
        ctypes.c_void_p(address),
        ctypes.c_ulong(length),
        ctypes.c_int(int(mode)),
        mask,
        ctypes.c_ulong(_MASK_BITS + 1 if mask is not None else 0),
        ctypes.c_uint(flags),
    )
    if rc != 0:
        raise _fail("mbind", ctypes.get_errno(), f"for nodes {list(node_list)} ({mode.name})")


def bind_buffer(
    buf: Any,
    nodes: Iterable[int],
    mode: MemPolicy = MemPolicy.BIND,
    *,
    move: bool = True,
) -> int:
    """Bind the whole pages of ``buf`` to ``nodes``; returns how many bytes were bound.

    ``buf`` is a writable C-contiguous buffer (numpy array, mmap, bytearray). Pages only
    partly inside it (the allocator's header page of a malloc'd array) are left alone.
    ``move`` (default) migrates pages already touched. Raises as :func:`mbind`.
    """
    address, nbytes = _address_of(buf)
    start, length = page_range(address, nbytes)
    if length == 0:
        return 0
    mbind(start, length, nodes, mode, move=move)
    return length


def get_mempolicy(address: int | None = None) -> PolicyInfo:
    """The policy of the page at ``address``, or of the calling thread when ``None``."""
    nr = _syscall_numbers()
    lib = _lib()
    assert nr is not None
    mode = ctypes.c_int(-1)
    mask = _NodeMask()
    rc = lib.syscall(
        ctypes.c_long(nr[2]),
        ctypes.byref(mode),
        mask,
        ctypes.c_ulong(_MASK_BITS + 1),
        ctypes.c_void_p(address or 0),
        ctypes.c_ulong(MPOL_F_ADDR if address is not None else 0),
    )
    if rc != 0:
        raise _fail("get_mempolicy", ctypes.get_errno())
    # The kernel may OR mode flags (MPOL_F_STATIC_NODES...) into the high bits.
    raw = mode.value & 0xFF
    try:
        policy = MemPolicy(raw)
    except ValueError:
        raise NumaError(f"get_mempolicy returned unknown mode {mode.value}") from None
    return PolicyInfo(policy, _unmask(mask))


def node_of_address(address: int) -> int:
    """The node holding the page at ``address`` (faults the page in if needed)."""
    nr = _syscall_numbers()
    lib = _lib()
    assert nr is not None
    node = ctypes.c_int(-1)
    rc = lib.syscall(
        ctypes.c_long(nr[2]),
        ctypes.byref(node),
        None,
        ctypes.c_ulong(0),
        ctypes.c_void_p(address),
        ctypes.c_ulong(MPOL_F_NODE | MPOL_F_ADDR),
    )
    if rc != 0:
        raise _fail("get_mempolicy", ctypes.get_errno(), f"at {address:#x}")
    return node.value


def set_mempolicy(mode: MemPolicy, nodes: Iterable[int] = ()) -> None:
    """Set the calling thread's policy for its future allocations."""
    nr = _syscall_numbers()
    lib = _lib()
    assert nr is not None
    if mode in (MemPolicy.DEFAULT, MemPolicy.LOCAL):
        node_list: tuple[int, ...] = ()
        mask = None
    else:
        node_list = check_nodes(nodes)
        mask = _mask(node_list)
    rc = lib.syscall(
        ctypes.c_long(nr[1]),
        ctypes.c_int(int(mode)),
        mask,
        ctypes.c_ulong(_MASK_BITS + 1 if mask is not None else 0),
    )
    if rc != 0:
        raise _fail("set_mempolicy", ctypes.get_errno(), f"for nodes {list(node_list)}")


@contextmanager
def thread_policy(mode: MemPolicy, nodes: Iterable[int] = ()) -> Iterator[PolicyInfo]:
    """Run the block with the calling thread's allocation policy set to ``mode``/``nodes``,
    then restore the previous policy (even on error). Yields the previous policy.

    For memory that is faulted in by the allocator itself (``cudaHostAlloc``, torch
    ``pin_memory``): such pages are locked at once and can no longer be moved by
    :func:`bind_buffer`, so the policy must be in force while they are allocated.
    """
    before = get_mempolicy()
    set_mempolicy(mode, nodes)
    try:
        yield before
    finally:
        set_mempolicy(before.mode, before.nodes)


def move_pages(addresses: Sequence[int], nodes: Sequence[int] | None = None) -> list[int]:
    """Move the pages at ``addresses`` to ``nodes`` (one per address) in this process, or,
    with ``nodes=None``, only query where they are.

    Returns one status per page: the node it is on, or a negative errno (``-ENOENT``: not
    yet touched; ``-EFAULT``: not mapped). Raises :class:`NumaError` when the call fails.
    """
    count = len(addresses)
    if nodes is not None:
        if len(nodes) != count:
            raise KVTierUsageError(f"move_pages: {len(nodes)} nodes for {count} pages")
        check_nodes(nodes)
    if count == 0:
        return []
    nr = _syscall_numbers()
    lib = _lib()
    assert nr is not None
    pages = (ctypes.c_void_p * count)(*addresses)
    target = (ctypes.c_int * count)(*nodes) if nodes is not None else None
    status = (ctypes.c_int * count)(*([-1] * count))
    rc = lib.syscall(
        ctypes.c_long(nr[3]),
        ctypes.c_int(0),
        ctypes.c_ulong(count),
        pages,
        target,
        status,
        ctypes.c_int(0),
    )
    if rc < 0:
        raise _fail("move_pages", ctypes.get_errno())
    return list(status)


def buffer_page_nodes(buf: Any) -> list[int]:
    """Where each whole page of ``buf`` is (see :func:`move_pages` for the statuses)."""
    address, nbytes = _address_of(buf)
    start, length = page_range(address, nbytes)
    return move_pages(range(start, start + length, PAGE_SIZE))


# -- CPU affinity ----------------------------------------------------------------------


def thread_affinity() -> tuple[int, ...]:
    """CPUs the calling thread may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def pin_thread(cpus: Iterable[int]) -> None:
    """Restrict the calling thread (not the whole process) to ``cpus``.

    Raises :class:`KVTierUsageError` for an empty set or CPUs that do not exist or lie
    outside the process's allowed set, :class:`NumaError` when the call fails.
    """
    wanted = set(cpus)
    if not wanted:
        raise KVTierUsageError("cannot pin a thread to an empty CPU set")
    allowed = os.sched_getaffinity(os.getpid())
    outside = sorted(wanted - allowed)
    if outside:
        raise KVTierUsageError(
            f"CPU {', '.join(map(str, outside))} is not available to this process "
            f"(allowed: {', '.join(map(str, sorted(allowed)))})"
        )
    try:
        os.sched_setaffinity(0, wanted)  # pid 0 = the calling thread on Linux
    except OSError as exc:
        raise _fail("sched_setaffinity", exc.errno or 0) from exc
