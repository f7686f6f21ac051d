"""What a compiled program does per step, read from its optimised HLO text.

    analysis = analyze(compiled.as_text())
    analysis.flops                  # matmul FLOPs per device per execution
    analysis.collectives            # {"all-reduce": Collective(count, bytes), ...}
    analysis.count("conditional")   # executed instructions of one opcode

Why not `compiled.cost_analysis()`: it counts a while loop's body once (a scanned 32-layer model
looks like a 1-layer one), gives nothing for GPU programs, and has no collectives. Here every
computation is weighed by how often one execution of the program runs it: a while loop's body
by its trip count (XLA's `known_trip_count`; a loop without one, such as the sampler's
stop-token loop, by `unknown_trips`), a conditional by its costliest branch (an upper bound),
fusions, calls and async wrappers once.

FLOPs are those of the matrix units, the work that sets a step's time: 2 x (output elements) x
(contracted size) for every `dot`, every `convolution` (TPU writes matmuls as 1x1
convolutions; their window and feature groups are accounted for), every cuBLAS GEMM call on
GPU, and every TPU Pallas/Mosaic kernel (ragged_dot, megablox) by the FLOPs of its cost
estimate; kernels without one (splash attention) count 0 and are counted as `UNCOSTED`.
Elementwise work is left out; `tests/test_aot.py` checks the figure against the compiler's
own count on a loop-free program and against 6 N T on a dense model, scanned and unrolled.

Collective bytes per op are the size of the full (unsharded-side) array the collective works
on, per device: an all-reduce's operand, an all-gather's result, a reduce-scatter's operand,
an all-to-all's or collective-permute's operand, a ragged-all-to-all's rows to send (an
upper bound: only the routed rows travel). On TPU a reduce-scatter may be compiled into
a fusion calling an `all-reduce-scatter` computation (an all-reduce and the slice each device
keeps); it is counted as one reduce-scatter of the fusion's operand.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
DTYPE_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}
GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul")

_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+[a-z]*)?)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations|calls)=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    depth = 0
    pairs = {"(": ")", "{": "}", "[": "]"}
    closing = set(pairs.values())
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in closing:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in an HLO type (an array or a tuple of them)."""
    out = []
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in DTYPE_BITS and not dtype.startswith("f8"):
            continue
        out.append((dtype, tuple(int(d.strip("<=")) for d in dims.split(",") if d.strip())))
    return out


def nbytes(type_text: str) -> int:
    return sum(math.prod(dims) * DTYPE_BITS.get(dtype, 8) // 8 for dtype, dims in arrays(type_text))


@dataclass
class Instruction:
    name: str
    type: str  # the result's HLO type
    opcode: str
    operands: list[str]  # names
    attrs: str  # everything after the operands
    called: list[str] = field(default_factory=list)


@dataclass
class Collective:
    count: int = 0
    bytes: int = 0


@dataclass
class Analysis:
    flops: float
    collectives: dict[str, Collective]
    opcodes: Counter  # executed count of every opcode
    unknown_trip_loops: int  # while loops counted at `unknown_trips` iterations
    scoped_loops: int = 0  # while loops counted at their name scope's `scoped_trips`

    def count(self, opcode: str) -> int:
        return self.opcodes.get(opcode, 0)


def parse(text: str) -> tuple[dict[str, list[Instruction]], str, dict[str, str]]:
    """-> (computations by name, the entry's name, every instruction's type by name)."""
    comps: dict[str, list[Instruction]] = {}
    types: dict[str, str] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and line.rstrip().endswith("{") and "(" in line:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.groups()
        end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")  # tuple or array
        type_text, rest = rest[:end], rest[end:].strip()
        op = re.match(r"([\w\-]+)\(", rest)
        if not op:
            continue
        args_end = _balanced(rest, op.end() - 1)
        args = _split_top(rest[op.end() : args_end - 1])
        operands = [a.strip().split()[-1].lstrip("%") for a in args]
        attrs = rest[args_end:]
        called = _CALLED.findall(attrs)
        for group in _CALLED_LIST.findall(attrs):
            called += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
        inst = Instruction(name, type_text, op.group(1), operands, attrs, called)
        comps[current].append(inst)
        types[name] = type_text
    return comps, entry, types


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _dims(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _matmul_flops(inst: Instruction, types: dict[str, str]) -> float:
    out = arrays(inst.type)
    if not out or not inst.operands:
        return 0.0
    lhs = arrays(types.get(inst.operands[0], ""))
    if not lhs:
        return 0.0
    lhs_dims, out_elems = lhs[0][1], math.prod(out[0][1])
    if inst.opcode == "dot":
        contracted = math.prod(lhs_dims[d] for d in _dims(inst.attrs, "lhs_contracting_dims"))
        return 2.0 * out_elems * contracted
    if inst.opcode == "convolution":
        return _convolution_flops(inst, lhs_dims, out[0][1])
    if inst.opcode == "custom-call" and '"tpu_custom_call"' in inst.attrs:
        # Pallas / Mosaic kernels (ragged_dot and megablox's grouped matmuls, splash
        # attention) state their FLOPs in their cost estimate: for the grouped matmuls that
        # is every row of the operand, groups or not (an upper bound where rows are unused).
        m = re.search(r'"cost_estimate":\{"flops":"(\d+)"', inst.attrs)
        return float(m.group(1)) if m else 0.0
    if inst.opcode == "custom-call" and any(f'"{t}"' in inst.attrs for t in GEMM_CALLS):
        m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attrs)
        dims = [int(x.strip('" ')) for x in m.group(1).split(",") if x.strip()] if m else []
        return 2.0 * out_elems * math.prod(lhs_dims[d] for d in dims)
    return 0.0


def _window(attrs: str, key: str, n: int, default: int) -> list[int]:
    m = re.search(rf"\b{key}=([\dx_\-]+)", attrs)
    return [int(v) for v in m.group(1).split("x")] if m else [default] * n


def _convolution_flops(inst: Instruction, lhs_dims, out_dims) -> float:
    """A convolution's multiply-adds x 2, counting only window taps that land on the input
    (not on padding or between dilated elements), as XLA's own cost analysis does. TPU
    writes matmuls, batched ones included, as convolutions; their batch dimensions often
    become windows over padded input, where counting every tap would overstate the work."""
    labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", inst.attrs)
    if not labels:
        return 0.0
    lhs_l, _, out_l = labels.groups()
    spatial = sorted(c for c in lhs_l if c.isdigit())
    n = len(spatial)
    features = lhs_dims[lhs_l.index("f")]
    groups = re.search(r"feature_group_count=(\d+)", inst.attrs)
    features //= int(groups.group(1)) if groups else 1
    window = re.search(r"window=\{([^}]*)\}", inst.attrs)
    w = window.group(1) if window else ""
    size = _window(w, "size", n, 1)
    stride = _window(w, "stride", n, 1)
    lhs_dilate = _window(w, "lhs_dilate", n, 1)
    rhs_dilate = _window(w, "rhs_dilate", n, 1)
    pad = re.search(r"\bpad=([\dx_\-]+)", w)
    pad_lo = [int(p.split("_")[0]) for p in pad.group(1).split("x")] if pad else [0] * n
    taps = 1  # (output position, window tap) pairs that read the input, over all spatial dims
    out_spatial = 1
    for i, d in enumerate(spatial):
        size_in, size_out = lhs_dims[lhs_l.index(d)], out_dims[out_l.index(d)]
        out_spatial *= size_out
        o = np.arange(size_out)[:, None]
        k = np.arange(size[i])[None, :]
        pos = o * stride[i] + k * rhs_dilate[i] - pad_lo[i]  # in the dilated input
        hits = (pos >= 0) & (pos <= (size_in - 1) * lhs_dilate[i]) & (pos % lhs_dilate[i] == 0)
        taps *= int(hits.sum())
    return 2.0 * (math.prod(out_dims) // max(out_spatial, 1)) * features * taps


def _collective_kind(inst: Instruction, comps: dict[str, list[Instruction]]) -> str | None:
    op = inst.opcode.removesuffix("-start")
    if op in COLLECTIVES:
        return op
    if inst.opcode == "fusion" and any(c.startswith("all-reduce-scatter") for c in inst.called):
        return "reduce-scatter"
    return None


def _collective_bytes(inst: Instruction, types: dict[str, str]) -> int:
    if inst.opcode.removesuffix("-start") == "ragged-all-to-all":
        # operands: the rows to send, the receive buffer, offsets and sizes; what travels is at
        # most the rows to send (the buffer is sized for the worst case that never arrives)
        return nbytes(types.get(inst.operands[0], ""))
    operand = sum(nbytes(types.get(o, "")) for o in inst.operands)
    result = nbytes(inst.type)
    if inst.opcode.endswith("-start") and inst.type.startswith("("):
        result -= operand  # an async start's result holds its operands next to its output
    return max(operand, result)


def _trip_count(
    loop: Instruction, comps: dict[str, list[Instruction]], producers: dict[str, Instruction]
) -> int | None:
    """XLA's `known_trip_count`, or (TPU drops it when it rewrites a loop) the count read from
    the loop's condition: `counter < N` (or `N > counter`) on a tuple element that the loop's
    input starts at a constant (0 where it is not one), stepping by one as JAX's loops do."""
    m = _TRIPS.search(loop.attrs)
    if m:
        return int(m.group(1))
    cond = re.search(r"\bcondition=%?([\w.\-]+)", loop.attrs)
    body = comps.get(cond.group(1), []) if cond else []
    root = body[-1] if body else None
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", root.attrs)
    a, b = (producers.get(o) for o in root.operands)
    if direction and direction.group(1) == "GT":
        a, b = b, a
    elif not direction or direction.group(1) != "LT":
        return None
    if not (a and b and a.opcode == "get-tuple-element" and b.opcode == "constant"):
        return None
    index = re.search(r"index=(\d+)", a.attrs)
    limit = _constant(b)
    if not index or not re.fullmatch(r"-?\d+", limit):
        return None
    start = 0
    init = producers.get(loop.operands[0]) if loop.operands else None
    if init is not None and init.opcode == "tuple" and int(index.group(1)) < len(init.operands):
        first = producers.get(init.operands[int(index.group(1))])
        if first is not None and re.fullmatch(r"-?\d+", _constant(first)):
            start = int(_constant(first))
    return max(int(limit) - start, 0)


def _constant(inst: Instruction) -> str:
    """A scalar constant's literal ("" for anything else)."""
    return inst.operands[0] if inst.opcode == "constant" and inst.operands else ""


SCOPED_LOOP = "scoped-loop"  # Analysis.opcodes' count of loops counted by their name scope
UNCOSTED = "uncosted-kernel"  # Analysis.count(UNCOSTED): kernels whose FLOPs are not counted


def _uncosted_kernel(inst: Instruction) -> bool:
    """A kernel whose FLOPs are not known here and count 0: a TPU Pallas/Mosaic kernel with no
    cost estimate (jax 0.10.2's splash attention), or cuDNN's fused attention on GPU."""
    if inst.opcode != "custom-call":
        return False
    if '"__cudnn$fmha' in inst.attrs:
        return True
    return (
        '"tpu_custom_call"' in inst.attrs
        and '"cost_estimate"' not in inst.attrs
        and "ragged-dot-metadata" not in inst.name  # ragged_dot's group bookkeeping, no FLOPs
    )


def _scope_trips(loop: Instruction, scoped_trips: dict[str, int]) -> int | None:
    """The trips given for the loop's innermost name scope (op_name ".../SCOPE/while")."""
    m = re.search(r'op_name="[^"]*?([\w.\-]+)/while"', loop.attrs)
    return scoped_trips.get(m.group(1)) if m else None


def analyze(
    text: str, unknown_trips: int = 1, scoped_trips: dict[str, int] | None = None
) -> Analysis:
    """`scoped_trips`: loops of unknown trip count in these name scopes run this many times
    (the ragged exchange's extra rounds: `exchange_rounds.ROUND_LOOP_SCOPE`); the others run
    `unknown_trips` times."""
    scoped_trips = scoped_trips or {}
    comps, entry, types = parse(text)
    producers = {i.name: i for body in comps.values() for i in body}
    memo: dict[str, tuple[float, dict, Counter, int]] = {}

    def visit(name: str):
        if name in memo:
            return memo[name]
        memo[name] = (0.0, {}, Counter(), 0)  # guards against cycles (none in valid HLO)
        flops, coll, ops, unknown = 0.0, {}, Counter(), 0  # ops["scoped-loop"]: scoped_trips

        def add(sub, times=1):
            nonlocal flops, unknown
            f, c, o, u = sub
            flops += times * f
            unknown += u
            for k, v in c.items():
                mine = coll.setdefault(k, Collective())
                mine.count += times * v.count
                mine.bytes += times * v.bytes
            for k, v in o.items():
                ops[k] += times * v

        for inst in comps.get(name, []):
            ops[inst.opcode] += 1
            if _uncosted_kernel(inst):
                ops[UNCOSTED] += 1
            kind = _collective_kind(inst, comps)
            if kind:
                c = coll.setdefault(kind, Collective())
                c.count += 1
                c.bytes += _collective_bytes(inst, types)
                if inst.opcode == "fusion":  # an all-reduce-scatter: its insides are the op
                    continue
            flops += _matmul_flops(inst, types)
            if inst.opcode.endswith("-done") or inst.opcode == "async-update":
                continue  # the start names the same computation
            if inst.opcode == "while":
                trips = _trip_count(inst, comps, producers)
                if trips is None and (trips := _scope_trips(inst, scoped_trips)) is not None:
                    ops[SCOPED_LOOP] += 1
                unknown += trips is None
                for sub in inst.called:
                    add(visit(sub), unknown_trips if trips is None else trips)
            elif inst.opcode == "conditional":
                branches = [visit(b) for b in inst.called]
                if branches:
                    add(max(branches, key=lambda b: (b[0], sum(c.bytes for c in b[1].values()))))
            else:
                for sub in inst.called:
                    add(visit(sub))
        memo[name] = (flops, coll, ops, unknown)
        return memo[name]

    flops, coll, ops, unknown = visit(entry)
    return Analysis(flops, coll, ops, unknown, ops[SCOPED_LOOP])


def collectives_json(coll: dict[str, Collective]) -> dict[str, dict[str, int]]:
    return {k: {"count": v.count, "bytes": v.bytes} for k, v in sorted(coll.items())}


def weight_gathers(text: str, n_weights: int) -> list[Instruction]:
    """The all-gathers of a program that gather its weights: computed from its first
    `n_weights` parameters (the weights, where jit takes them first) and constants alone,
    whether before a loop (XLA:CPU hoists loop-invariant gathers there) or inside one, where
    they gather the same bytes at every trip. A loop body's tuple element counts as a weight
    where the loop starts it as one and the body passes it on unchanged; a called
    computation's parameter where the call's operand is one. A gather of activations (rows
    looked up in a weight, tokens routed by one) depends on other values too: not counted."""
    comps, entry, _ = parse(text)
    found: list[Instruction] = []

    def visit(name: str, is_weight) -> None:
        """`is_weight(inst)`: whether the parameter, or the parameter's tuple element, that
        `inst` reads is computed from the weights alone."""
        body, pure = comps.get(name, []), set()
        producers = {i.name: i for i in body}
        for inst in body:
            reads_param = inst.opcode == "parameter" or (
                inst.opcode == "get-tuple-element"
                and getattr(producers.get(inst.operands[0]), "opcode", "") == "parameter"
            )
            ok = is_weight(inst) if reads_param else all(o in pure for o in inst.operands)
            if ok and inst.opcode not in ("rng", "rng-bit-generator"):
                pure.add(inst.name)
                if inst.opcode.removesuffix("-start") == "all-gather":
                    found.append(inst)
            if inst.opcode == "while":
                loop_body = re.search(r"\bbody=%?([\w.\-]+)", inst.attrs)
                init = producers.get(inst.operands[0])
                if loop_body and init is not None and init.opcode == "tuple":
                    kept = _passed_on(comps.get(loop_body.group(1), []))
                    flags = [o in pure and i in kept for i, o in enumerate(init.operands)]
                    visit(loop_body.group(1), lambda g, f=flags: _flag(g, f, "index"))
            elif inst.opcode == "call" and inst.called:
                flags = [o in pure for o in inst.operands]
                visit(inst.called[0], lambda p, f=flags: _flag(p, f, None))

    visit(entry, lambda p: p.opcode == "parameter" and int(p.operands[0]) < n_weights)
    return found


def _passed_on(body: list[Instruction]) -> set[int]:
    """The tuple elements a while body returns as it got them (its root: tuple(..., gte(param,
    index=i) at i, ...))."""
    if not body or body[-1].opcode != "tuple":
        return set()
    producers = {i.name: i for i in body}
    params = {i.name for i in body if i.opcode == "parameter"}
    kept = set()
    for i, name in enumerate(body[-1].operands):
        g = producers.get(name)
        if g is None or g.opcode != "get-tuple-element" or g.operands[0] not in params:
            continue
        if re.search(rf"\bindex={i}\b", g.attrs):
            kept.add(i)
    return kept


def _flag(inst: Instruction, flags: list[bool], key: str | None) -> bool:
    """flags[i] for a parameter(i) (`key` None) or a get-tuple-element index=i (`key` "index")."""
    if key is None:
        if inst.opcode != "parameter":
            return False
        i = int(inst.operands[0])
    else:
        m = re.search(r"\bindex=(\d+)", inst.attrs)
        if inst.opcode != "get-tuple-element" or m is None:
            return False
        i = int(m.group(1))
    return i < len(flags) and flags[i]
