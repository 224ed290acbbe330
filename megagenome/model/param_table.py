"""What every non-transformer cost model derives from its parameter table (layer L1, standard library only).

A cost model (model/hyena/costs.py HyenaShape, model/caduceus/costs.py CaduceusShape, model/gpn/costs.py GPNShape)
lists each parameter tensor in model order as (shape one of `tp` tensor-parallel ranks holds, decays, is a
vocabulary matrix) in param_table(tp); ParamTable turns that list into what the planner asks of it (the element
counts, the optimizer's two groups, the shapes Muon and the optimizer states depend on, the total).
"""

from __future__ import annotations

import math


class ParamTable:
    """Mixin of a cost model with a param_table(tp) (module docstring)."""

    def param_table(self, tp: int = 1) -> list[tuple[tuple[int, ...], bool, bool]]:
        raise NotImplementedError

    def param_numels(self, tp: int = 1) -> list[int]:
        """Elements of each parameter tensor one of `tp` tensor-parallel ranks holds, in model order."""
        return [math.prod(s) for s, _, _ in self.param_table(tp)]

    def param_groups(self, tp: int = 1) -> tuple[list[int], list[int]]:
        """Elements of the parameters in the optimizer's two groups (decay, no decay), in model order."""
        table = self.param_table(tp)
        return [math.prod(s) for s, d, _ in table if d], [math.prod(s) for s, d, _ in table if not d]

    def param_shapes(self, tp: int = 1) -> list[tuple[tuple[int, ...], bool]]:
        """(shape, is a hidden matrix: 2-D and not a vocabulary matrix, what Muon takes) of each parameter a rank
        holds: what optimizer-state bytes depend on (engine/optimizers.py tag_muon's rule)."""
        return [(s, len(s) == 2 and not vocab) for s, _, vocab in self.param_table(tp)]

    def n_params(self, tp: int = 1) -> int:
        return sum(self.param_numels(tp))
