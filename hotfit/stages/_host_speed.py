"""What the host's speed depends on: its memory read bandwidth and the threads llama-server runs
(effectful; cached per machine). The planner's speed model (registry/speed.py) reads both.

Bandwidth without a C compiler at run time: ``bytearray.find`` of a byte the buffer lacks is glibc's
``memchr``, vectorised, reading every byte once and writing none — what a decode step does with the
weights. One such scan per thread, each in its own forked process (the GIL would serialise
threads) over its own buffer of ``BUFFER_BYTES / threads``, all released together by a barrier; the
best of ``PASSES`` passes. On the build machine it reads what scripts/membw.c (C, -O3 -march=native)
reads, within the VM's noise (docs/benchmarks.md, "Host bandwidth without a compiler").

The result is cached in one JSON file (``Settings.host_speed_file``) keyed by the machine's
fingerprint (CPU model, the CPUs this process may run on, memory total, machine id): a second
probe costs a file read; another machine, another affinity (``taskset``) or more memory measures again.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hotfit.core.log import get_logger
from hotfit.state.files import write_text_atomic

log = get_logger()

MiB = 1 << 20
# Large against any last-level cache (EPYC: 32 MiB per CCD; 256 MiB would still see a few per cent
# of cache hits on a 16-CCD part), small enough to take < 1 s per pass at 5 GB/s.
BUFFER_BYTES = 512 * MiB
PASSES = 4
CACHE_SCHEMA = 1
MEASURE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class HostSpeed:
    read_bandwidth_bytes_per_s: int
    threads: int
    basis: str


def physical_cores(cpuinfo: str, allowed: set[int]) -> int:
    """Distinct (package, core) pairs among the CPUs this process may run on: llama.cpp's default
    thread count is the physical cores, and an SMT sibling adds no decode speed."""
    cores: set[tuple[str, str]] = set()
    proc: int | None = None
    phys = core = None
    for line in [*cpuinfo.splitlines(), ""]:
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            proc = int(value)
        elif key == "physical id":
            phys = value
        elif key == "core id":
            core = value
        elif not line.strip() and proc is not None:
            if proc in allowed:
                cores.add((phys or "0", core if core is not None else str(proc)))
            proc = phys = core = None
    return max(1, min(len(cores) or len(allowed), len(allowed)))


def _scan(buffer_bytes: int, barrier: Any, passes: int, out: Any) -> None:
    buf = bytearray(buffer_bytes)
    buf[::4096] = b"\x01" * len(range(0, buffer_bytes, 4096))  # fault every page in before timing
    times = []
    for _ in range(passes):
        barrier.wait()
        t0 = time.perf_counter()
        buf.find(b"\x02")  # memchr over the whole buffer: absent, so every byte is read
        times.append(time.perf_counter() - t0)
        barrier.wait()
    out.put(times)


def measure_read_bandwidth(threads: int, buffer_bytes: int = BUFFER_BYTES, passes: int = PASSES) -> float:
    """Bytes/s ``threads`` forked readers stream together (the slowest reader of each pass bounds
    it; the best pass counts)."""
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(threads), ctx.Queue()
    per = buffer_bytes // threads
    procs = [ctx.Process(target=_scan, args=(per, barrier, passes, out), daemon=True) for _ in range(threads)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=MEASURE_TIMEOUT_S) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    best = min(max(r[i] for r in results) for i in range(passes))
    return per * threads / best


def machine_fingerprint(cpuinfo: str, allowed: set[int], mem_total_line: str, machine_id: str) -> str:
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 "")
    text = json.dumps([model, sorted(allowed), mem_total_line.strip(), machine_id.strip()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def host_speed(cache_file: Path | None, *, proc_root: Path = Path("/proc"), remeasure: bool = False) -> HostSpeed:
    """The host's bandwidth and threads: from the cache when this machine measured them, else
    measured now (about 2 s) and cached. A cache that cannot be read or written is measured around."""
    allowed = set(os.sched_getaffinity(0))
    cpuinfo = _read(proc_root / "cpuinfo")
    threads = physical_cores(cpuinfo, allowed)
    meminfo = next((line for line in _read(proc_root / "meminfo").splitlines() if line.startswith("MemTotal")), "")
    key = machine_fingerprint(cpuinfo, allowed, meminfo, _read(Path("/etc/machine-id")))
    if cache_file is not None and not remeasure:
        try:
            doc = json.loads(cache_file.read_text())
            if doc.get("schema") == CACHE_SCHEMA and doc.get("machine") == key:
                hs = HostSpeed(int(doc["read_bandwidth_bytes_per_s"]), int(doc["threads"]), str(doc["basis"]))
                if hs.read_bandwidth_bytes_per_s > 0 and hs.threads > 0:
                    return hs
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # absent or damaged: measured again below, and rewritten
    t0 = time.monotonic()
    bandwidth = measure_read_bandwidth(threads)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    hs = HostSpeed(round(bandwidth), threads,
                   f"measured by the probe {when}: {threads} reader(s) (memchr), best of {PASSES} passes over "
                   f"{BUFFER_BYTES // MiB} MiB")
    log.info("probe.host_speed", read_bandwidth_bytes_per_s=hs.read_bandwidth_bytes_per_s, threads=threads,
             seconds=round(time.monotonic() - t0, 2), cache=str(cache_file) if cache_file else None)
    if cache_file is not None:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(cache_file, json.dumps({"schema": CACHE_SCHEMA, "machine": key, **asdict(hs)},
                                                     indent=2) + "\n")
        except OSError as exc:
            log.warning("probe.host_speed_uncached", cache=str(cache_file), error=str(exc))
    return hs
