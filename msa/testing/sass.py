"""Offline SASS of msa's kernels: what an sm_90 GPU executes, read without a GPU.

    python -m msa.testing.sass <stage> [name regex] [--dump]

Each matching kernel variant of ``msa.testing.variants`` is compiled to PTX (``msa.testing.ptx``,
NVVM), then to a cubin for ``sm_90a`` by ``ptxas``, and disassembled by ``cuobjdump -sass``
(which calls ``nvdisasm``). Per kernel it prints the registers, spill bytes and stack that
``ptxas -v`` reports, the instruction count, and every loop (a backward branch and the code it
jumps back over) with its instruction mix by class (``CLASSES``). ``--dump`` prints the SASS.

The counts are static: a loop body counts once whatever its trip count, and both sides of each
branch inside it count (a rare path, e.g. masking a non-finite key, inflates them); an inner
loop counts inside its outer one too. Multiply by trip counts and read the code to weigh them.
What they show well: the instructions an idea costs per tile (address arithmetic beside the
``HMMA``/``LDSM`` it serves), dependency chains, and spills, before any GPU time is spent.

Tools: ``ptxas`` from ``$CUDA_HOME/bin`` or ``PATH``; ``cuobjdump`` and ``nvdisasm`` from
``PATH``, ``$CUOBJDUMP``/``$NVDISASM_PATH``, or the ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm`` wheels (``pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm``).
``tools()`` says which is missing.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

# SASS opcode (before its first ".") -> class; anything else is "other"
CLASSES = {
    "tensor": ("HMMA", "HGMMA", "IMMA", "WARPGROUP"),
    "ldmatrix": ("LDSM",),
    "shared": ("LDS", "STS", "ATOMS"),
    "async copy": ("LDGSTS", "LDGDEPBAR", "UBLKCP", "UTMALDG", "SYNCS"),
    "global": ("LDG", "STG", "RED", "ATOMG", "LD", "ST"),
    "local": ("LDL", "STL"),
    "constant": ("LDC", "ULDC"),
    "integer": ("IMAD", "IADD3", "IADD", "LEA", "LOP3", "SHF", "SHL", "SHR", "ISETP", "SEL",
                "IABS", "IMNMX", "VIADD", "VIMNMX", "PRMT", "SGXT", "POPC", "FLO", "BMSK",
                "BREV", "I2I", "MOV", "IMUL", "P2R", "R2P", "PLOP3", "S2R", "CS2R", "S2UR"),
    "uniform": ("UIADD3", "UIMAD", "ULOP3", "USHF", "UMOV", "ULEA", "USEL", "UISETP", "UPRMT",
                "R2UR", "UFLO", "UPOPC"),
    "float": ("FFMA", "FADD", "FMUL", "FSEL", "FSETP", "FMNMX", "F2FP", "F2F", "I2F", "F2I",
              "HADD2", "HMUL2", "HFMA2", "FCHK", "FRND", "FSWZADD"),
    "mufu": ("MUFU",),
    "shuffle": ("SHFL", "VOTE", "MATCH", "REDUX"),
    "barrier": ("BAR", "WARPSYNC", "DEPBAR", "BSSY", "BSYNC", "MEMBAR", "ERRBAR", "FENCE",
                "CCTL"),
    "branch": ("BRA", "BRX", "EXIT", "CALL", "RET", "JMP", "NOP"),
}
_CLASS_OF = {op: cls for cls, ops in CLASSES.items() for op in ops}
_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")
_TARGET = re.compile(r"\b(?:BRA|BRX)\b.*?0x([0-9a-f]+)")


def class_of(opcode: str) -> str:
    """The class (``CLASSES``) of a SASS opcode such as ``IMAD.WIDE.U32``."""
    return _CLASS_OF.get(opcode.split(".")[0], "other")


def instructions(sass: str):
    """``[(address, opcode, text)]`` of one kernel's ``cuobjdump -sass`` listing (a
    predicate guard is dropped from the opcode, kept in the text)."""
    out = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            text = m.group(2)
            out.append((int(m.group(1), 16), _PRED.sub("", text).split()[0], text))
    return out


def loops(ins):
    """``[(start, end)]``: for each backward branch, the addresses it jumps back over (its
    target up to the branch), in order of the branch."""
    spans = []
    for address, opcode, text in ins:
        if opcode.split(".")[0] == "BRA":
            m = _TARGET.search(text)
            if m and int(m.group(1), 16) <= address:
                spans.append((int(m.group(1), 16), address))
    return spans


def mix(ins, start=None, end=None) -> collections.Counter:
    """Instructions by class between two addresses (inclusive; default: all)."""
    return collections.Counter(class_of(op) for a, op, _ in ins
                               if (start is None or a >= start) and (end is None or a <= end))


def _wheel_bin(module: str, name: str):
    try:
        mod = __import__(module, fromlist=["_"])
    except ImportError:
        return None
    for root in getattr(mod, "__path__", []):
        for sub in ("bin", os.path.join("cu13", "bin"), os.path.join("cu12", "bin")):
            path = os.path.join(root, sub, name)
            if os.path.isfile(path):
                return path
    return None


def tools():
    """``{"ptxas": path or None, "cuobjdump": ..., "nvdisasm": ...}``."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or ""
    ptxas = os.path.join(cuda_home, "bin", "ptxas") if cuda_home else ""
    found = {"ptxas": ptxas if os.path.isfile(ptxas) else shutil.which("ptxas")}
    nvd_dir = os.environ.get("NVDISASM_PATH")
    found["cuobjdump"] = (os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
                          or _wheel_bin("nvidia", "cuobjdump"))
    found["nvdisasm"] = ((os.path.join(nvd_dir, "nvdisasm") if nvd_dir else None)
                         or shutil.which("nvdisasm") or _wheel_bin("nvidia", "nvdisasm"))
    for name, path in found.items():  # wheels may install their binaries without the x bit
        if path and not os.access(path, os.X_OK):
            try:
                os.chmod(path, 0o755)
            except OSError:  # a read-only install: the tool's run will say so
                pass
    return found


def compile_sass(ptx: str):
    """``(sass, ptxas_info)`` of an sm_90 PTX text: ``ptxas -arch=sm_90a -v``, then
    ``cuobjdump -sass``. Raises RuntimeError naming a missing tool."""
    found = tools()
    missing = [name for name, path in found.items() if not path]
    if missing:
        raise RuntimeError(f"msa.testing.sass needs {', '.join(missing)} (see its docstring)")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:  # wgmma is sm_90a's: the arch-specific target
            f.write(re.sub(r"^\.target sm_90\b", ".target sm_90a", ptx, flags=re.MULTILINE))
        info = subprocess.run([found["ptxas"], "-arch=sm_90a", "-v", src, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(found["nvdisasm"]) + os.pathsep + env.get("PATH", "")
        sass = subprocess.run([found["cuobjdump"], "-sass", cubin], capture_output=True,
                              text=True, check=True, env=env).stdout
    return sass, info


def summary(name: str, sass: str, info: str) -> str:
    """The report ``main`` prints for one kernel."""
    ins = instructions(sass)
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    stack = re.search(r"(\d+) bytes stack frame", info)
    lines = [f"{name}: {len(ins)} instructions, {regs.group(1) if regs else '?'} registers, "
             f"stack {stack.group(1) if stack else '?'} B, spills "
             f"{spill.group(1) if spill else '?'} / {spill.group(2) if spill else '?'} B "
             f"(stores / loads)"]

    def fmt(counter):
        return ", ".join(f"{cls} {n}" for cls, n in counter.most_common())

    lines.append(f"  all: {fmt(mix(ins))}")
    for start, end in loops(ins):
        body = mix(ins, start, end)
        lines.append(f"  loop {start:#07x}-{end:#07x}: {sum(body.values())} instructions; "
                     f"{fmt(body)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    from . import variants
    from .ptx import compile_sm90

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=list(variants.STAGES))
    ap.add_argument("pattern", nargs="?", default="", help="regex over the variant names")
    ap.add_argument("--dump", action="store_true", help="print the SASS too")
    args = ap.parse_args(argv)
    for name, kernel, sig in variants.of(args.stage):
        if not re.search(args.pattern, name):
            continue
        sass, info = compile_sass(compile_sm90(kernel, sig))
        print(summary(name, sass, info), flush=True)
        if args.dump:
            print(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
