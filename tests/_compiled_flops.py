"""Matmul FLOPs of a compiled program, read from its optimised HLO text: every ``dot`` (inside fusions too),
2 · output elements · contracted elements, weighted by how often its computation runs (``while`` trip counts),
the truth the cost model's FLOPs are checked against."""

import math
import re

from spmd._hlo import _dims, _multipliers, _operand_shapes, _parse_module

_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def matmul_flops(hlo_text: str) -> float:
    """FLOPs of the dots one device runs per execution of the compiled program ``hlo_text``."""
    computations, entry = _parse_module(hlo_text)
    total = 0.0
    for comp, times in _multipliers(computations, entry, {}).items():
        instrs = computations[comp]
        shapes = {i.name: i.shape for i in instrs}
        for instr in instrs:
            if instr.opcode != "dot":
                continue
            lhs = _dims(_operand_shapes(instr.operands, shapes)[0])
            found = _LHS_CONTRACTING.search(instr.attrs)
            contracted = [int(d) for d in found.group(1).split(",") if d] if found else []
            total += times * 2 * math.prod(_dims(instr.shape)) * math.prod(lhs[d] for d in contracted)
    return total
