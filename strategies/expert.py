"""Expert parallelism: the experts of a mixture-of-experts layer split over one mesh axis, the batch over it too."""

from __future__ import annotations

from spmd import Plan
from spmd import axes as A
from spmd.rules import LogicalRules


def expert_parallel(*, axis: str = "expert") -> Plan:
    """Splits parameters and activations named ``"expert"`` over ``axis``, and the batch over ``axis`` as well
    (GShard's layout: experts and data share the axis, so each device holds ``experts / axis`` experts and
    ``1 / axis`` of the batch, and tokens travel to their experts and back by all-to-all).

    Acts on logically annotated mixture-of-experts models (the built-in ``moe-tiny``: expert kernels
    ``(expert, embed, mlp)`` and dispatched tokens ``(expert, group, capacity, embed)``); everything else stays
    replicated, so compose it with ``dp``, ``fsdp`` or ``tp`` on other axes. Its rule matching nothing warns.

    >>> import numpy as np
    >>> from flax import linen as nn
    >>> wi = nn.LogicallyPartitioned(np.zeros((8, 64, 256)), ("expert", "embed", "mlp"))
    >>> expert_parallel().specs({"wi": wi}, {"expert": 4})
    {'wi': P('expert', None, None)}
    >>> expert_parallel().batch_spec()
    P('expert', None)
    """
    rules = LogicalRules(((A.EXPERT, (axis,)),), "expert_parallel")
    return Plan(parts=(rules,), batch_axes=(axis,))
