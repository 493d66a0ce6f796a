"""Memory and I/O pressure for the sandbox node's faults (sandbox/faults.py), run as a program in
the node's batch cgroup, where a co-located job would run:

    python -m sandbox.pressure hold   --node CGROUP [--psi FILE] [--target 0.10] --seconds S [--retry-s T]
    python -m sandbox.pressure grow   --mb-per-s R [--procs N] --seconds S [--retry-s T]
    python -m sandbox.pressure stream --dir D --size-mb N --seconds S
    python -m sandbox.pressure write  --dir D --size-mb N --seconds S

  hold    allocates and touches anonymous memory until the memory stall (PSI `some`, read from
          FILE every HOLD_PERIOD_S) exceeds --target, then holds there: it grows while the stall is
          below the target (fast while the node's memory cgroup, --node, has room without
          reclaim, then a slow step at a time) and gives a step back while the stall is above
          HOLD_CEILING x the target
  grow    allocates at a steady rate with no end but --seconds: past what the node has, the kernel
          must kill someone (the `oom` cell). With --procs, in that many processes at once, each
          smaller than the whole (a data loader's workers): when one is killed, the job ends
  stream  reads a sparse file of --size-mb through the page cache, over and over: every read
          fills the cache with pages used once (a data loader, a model download), no disk I/O
  write   writes --size-mb over and over into one file with an fsync per chunk: the disk busy with
          small synchronous writes (a checkpointing job)

With --retry-s, a small parent runs the job again that long after each end (a batch scheduler's
retry, after the kernel killed it, say). Every mode is bounded: in time (--seconds, and by the
parent's kill), in memory by the cgroup it runs in (never run it outside one: the node's parent
cgroup's limit stands for the node's RAM), and on disk by --size-mb; files it creates it
deletes, also on SIGTERM. Files go in --dir, which must not be a tmpfs (tmpfs pages cannot be
reclaimed without swap). Progress lines go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from turbonode.memory_cgroups import MemoryHierarchy

MIB = 1 << 20
HOLD_PERIOD_S = 0.5  # how often `hold` reads the stall and decides
HOLD_CEILING = 3.0  # above this multiple of the target, `hold` gives memory back
FAST_STEP_MB = 64  # `hold` grows by this while the node has room...
SLOW_STEP_MB = 4  # ...by 4x this while it reclaims without a stall, by this once it stalls (and gives back this much)
CHUNK = MIB  # `stream` reads and `write` writes this much at a time
TMPFS_MAGIC = 0x01021994
_memset = ctypes.CDLL(None).memset
_memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)


class Stop(Exception):
    """SIGTERM: unwind, so the files are deleted."""


def _on_term(signum, frame) -> None:
    raise Stop


def touched(mb: int) -> mmap.mmap:
    """`mb` MiB of private anonymous memory (a process's heap, not shmem), every page written
    (charged to our cgroup now, not later)."""
    mem = mmap.mmap(-1, mb * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    _memset(address, 1, mb * MIB)
    return mem


def stall_total_us(psi: str) -> float:
    """The `some` line's total (microseconds stalled) of a PSI file."""
    with open(psi) as f:
        for line in f:
            if line.startswith("some "):
                return float(line.rsplit("total=", 1)[1])
    raise ValueError(f"{psi}: no 'some' line")


def hold(node: str, psi: str, target: float, seconds: float) -> None:
    """Grow fast while the node's memory cgroup `node` has room without reclaim, then a slow step
    at a time while the stall stays below `target`; give a step back while it is above
    HOLD_CEILING x the target. The band where the node stalls is narrow (a worker's hot file pages
    are a few tens of MiB): past it, the next step is an OOM, and the kernel kills this job (the
    largest process), which `retried` starts again."""
    h = MemoryHierarchy.find()
    chunks: list[mmap.mmap] = []
    deadline = time.monotonic() + seconds
    last_t, last_total = time.monotonic(), stall_total_us(psi)
    while time.monotonic() < deadline:
        time.sleep(HOLD_PERIOD_S)
        now, total = time.monotonic(), stall_total_us(psi)
        stall = (total - last_total) / 1e6 / (now - last_t)
        last_t, last_total = now, total
        room = (int(Path(h.limit_file(node)).read_text()) - h.usage(node)) // MIB
        cache = h.file_pages(node) // MIB
        if stall > target * HOLD_CEILING and chunks:
            chunks.pop().close()
        elif stall < target:
            near = SLOW_STEP_MB if stall > target / 10 else 4 * SLOW_STEP_MB  # finer once it stalls
            chunks.append(touched(FAST_STEP_MB if room > 2 * FAST_STEP_MB else near))
        size = sum(len(c) for c in chunks) // MIB
        print(f"hold {size} MiB room {room} MiB file pages {cache} MiB stall {stall:.3f}", flush=True)


def retried(argv: list[str], seconds: float, retry_s: float) -> None:
    """Run `argv` (a job of this program), again `retry_s` after each end, for `seconds` in all
    (each run's --seconds is what is left; the last one given in argv wins)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        child = subprocess.Popen([*argv, "--seconds", f"{left:.1f}"])
        try:
            code = child.wait()
        except Stop:
            child.kill()
            child.wait()
            raise
        print(f"the job ended ({code}): again in {retry_s:g} s", flush=True)
        time.sleep(min(retry_s, max(0.0, deadline - time.monotonic())))


def grow(mb_per_s: float, seconds: float, procs: int = 1) -> None:
    """Grow in `procs` processes (a data loader's workers, say) at `mb_per_s` together; when the
    kernel kills one, the job is over: the others are stopped too."""
    children = []
    for _ in range(procs - 1):
        pid = os.fork()
        if pid == 0:
            try:
                _grow(mb_per_s / procs, seconds)
            finally:
                os._exit(0)
        children.append(pid)
    try:
        _grow(mb_per_s / procs, seconds, children)
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _grow(mb_per_s: float, seconds: float, children: list[int] | None = None) -> None:
    chunks: list[mmap.mmap] = []
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        want = int(elapsed * mb_per_s) - len(chunks) * SLOW_STEP_MB
        while want >= SLOW_STEP_MB:
            chunks.append(touched(SLOW_STEP_MB))
            want -= SLOW_STEP_MB
        if children is not None:  # the job's first process
            if any(os.waitpid(pid, os.WNOHANG) != (0, 0) for pid in children):
                print("grow: a process of the job died: the job is over", flush=True)
                return
            print(f"grow {len(chunks) * SLOW_STEP_MB} MiB x {len(children) + 1} processes", flush=True)
        time.sleep(0.25)


@contextlib.contextmanager
def scratch_file(directory: str) -> Iterator[int]:
    """A file of ours in `directory` (never a tmpfs), open for reading and writing; removed after."""
    if _is_tmpfs(directory):
        raise SystemExit(f"{directory} is a tmpfs: its pages cannot be reclaimed without swap")
    path = os.path.join(directory, f"pressure-{os.getpid()}.dat")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)
        os.unlink(path)


def _is_tmpfs(directory: str) -> bool:
    """Whether `directory` lies on a tmpfs (or ramfs): from the mount table, longest prefix first."""
    best, fstype = "", ""
    real = os.path.realpath(directory)
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mount, kind, *_ = line.split()
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, fstype = mount, kind
    return fstype in ("tmpfs", "ramfs")


def stream(directory: str, size_mb: int, seconds: float) -> None:
    with scratch_file(directory) as fd:
        os.ftruncate(fd, size_mb * MIB)  # sparse: reading it costs page cache, not disk
        deadline, passes = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            os.lseek(fd, 0, os.SEEK_SET)
            while time.monotonic() < deadline and os.read(fd, CHUNK):
                pass
            passes += 1
            print(f"stream pass {passes} of {size_mb} MiB", flush=True)


def write(directory: str, size_mb: int, seconds: float) -> None:
    block = os.urandom(CHUNK)  # not zeros: nothing on the way may compress or skip them
    with scratch_file(directory) as fd:
        deadline, written = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            if written % size_mb == 0:  # the file never grows past --size-mb
                os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, block)
            os.fsync(fd)
            written += 1
            if written % 64 == 0:
                print(f"write {written} MiB", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sandbox.pressure", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--seconds", type=float, required=True, help="exit after this long")
    common.add_argument(
        "--retry-s",
        type=float,
        default=0.0,
        help="run the job again this long after each end, until --seconds (0: once)",
    )
    sub = ap.add_subparsers(dest="mode", required=True)
    h = sub.add_parser("hold", parents=[common])
    h.add_argument("--psi", default="/proc/pressure/memory")
    h.add_argument("--target", type=float, default=0.10)
    h.add_argument("--node", required=True, help="the node's memory cgroup (its limit stands for the node's RAM)")
    g = sub.add_parser("grow", parents=[common])
    g.add_argument("--mb-per-s", type=float, default=200.0)
    g.add_argument("--procs", type=int, default=1, help="processes that grow together (each a share of the rate)")
    for name in ("stream", "write"):
        p = sub.add_parser(name, parents=[common])
        p.add_argument("--dir", required=True)
        p.add_argument("--size-mb", type=int, required=True)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    try:
        if args.retry_s > 0:
            job = [a for i, a in enumerate(argv) if a != "--retry-s" and argv[i - 1 : i] != ["--retry-s"]]
            retried([sys.executable, "-m", "sandbox.pressure", *job], args.seconds, args.retry_s)
        elif args.mode == "hold":
            hold(args.node, args.psi, args.target, args.seconds)
        elif args.mode == "grow":
            grow(args.mb_per_s, args.seconds, args.procs)
        elif args.mode == "stream":
            stream(args.dir, args.size_mb, args.seconds)
        else:
            write(args.dir, args.size_mb, args.seconds)
    except Stop:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
