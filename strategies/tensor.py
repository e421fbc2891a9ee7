"""Megatron-style tensor parallelism: attention split by heads, the MLP column- then row-parallel."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from spmd import Plan, costmodel
from spmd import axes as A
from spmd.rules import LogicalRules, PathRules
from strategies.tensor_layouts import TensorParallelRules


def tensor_parallel(*, axis: str = "tensor", rules: Sequence[tuple[str, Any]] = ()) -> Plan:
    """Splits attention heads and the MLP hidden dimension over ``axis`` (Megatron's column/row split).

    Logically annotated models (the built-in ones, or any using ``heads``/``mlp`` names) are split through
    logical rules. Unannotated models are split by path: ``rules`` first (your model's names), then the layouts of
    common third-party models (:data:`strategies.tensor_layouts.LAYOUTS`): BERT/RoBERTa/ViT
    (``attention/self/{query,key,value}`` and ``intermediate/dense`` column-parallel, ``attention/output/dense``
    and the MLP's ``output/dense`` row-parallel), T5 (``SelfAttention``/``EncDecAttention`` ``q``/``k``/``v`` →
    ``o``, ``DenseReluDense`` ``wi``/``wi_0``/``wi_1`` → ``wo``), GPT-2 (``attn/c_attn`` → ``attn/c_proj``,
    ``mlp/c_fc`` → ``mlp/c_proj``, ``Conv1D`` kernels stored ``[out, in]``), Llama/Mistral/Gemma (``q_proj``/
    ``k_proj``/``v_proj`` → ``o_proj``, ``gate_proj``/``up_proj`` → ``down_proj``), and the ``query``/
    ``out_proj``/``fc1``/``fc2``/``fc_in``/``fc_out`` names of OPT, BART, CLIP, GPT-Neo, GPT-J and flax's
    attention. A column-parallel kernel ``[in, out]`` is split on ``out`` and its bias with it; a
    row-parallel one on ``in``, its bias kept whole.

    Warns (:class:`spmd.PlanWarning`) when a column-parallel layer has no row-parallel partner in its block, and
    when nothing in the model is split: give ``rules`` for the model's own layer names then.

    >>> import numpy as np
    >>> mlp = {"fc1": {"kernel": np.zeros((8, 32))}, "fc2": {"kernel": np.zeros((32, 8))}}
    >>> tensor_parallel().specs(mlp, {"tensor": 2})
    {'fc1': {'kernel': P(None, 'tensor')}, 'fc2': {'kernel': P('tensor', None)}}
    """
    parsed = PathRules.parse(rules, "tensor_parallel rules")
    return Plan(parts=(TensorParallelRules(axis, parsed),))


def sequence_parallel(*, axis: str = "tensor") -> Plan:
    """Megatron sequence parallelism: tensor parallelism, plus the regions between the blocks (residual stream,
    layer norms, dropout) split on the sequence dimension over the same ``axis``. The compiler then turns each
    block's activation all-reduce into a reduce-scatter (into the sequence shards) and an all-gather (before the
    next block), and the norm regions' activations take 1/``axis`` of the memory.

    Acts through activation constraints named ``seq`` in model code (:func:`spmd.constrain`); parameters are laid
    out as by :func:`tensor_parallel`.

    >>> from spmd import Plan
    >>> sequence_parallel().activation_spec(("batch", "seq", "embed"), (8, 32, 64), {"tensor": 2})
    P(None, 'tensor', None)
    """
    seq = Plan(parts=(LogicalRules(((A.SEQ, (axis,)),), "sequence_parallel", report_unused=False),))
    return tensor_parallel(axis=axis) + seq


def tensor_parallel_2d(*, axes: tuple[str, str] = ("tensor", "tensor2")) -> Plan:
    """2-D tensor parallelism (ATP, Optimus): every weight split over two mesh axes at once.

    ``axes[0]`` splits the residual stream's ``embed`` dimension — of the activations between blocks and of
    every weight touching them — and ``axes[1]`` splits attention heads, the MLP hidden dimension and the
    vocabulary. Each matmul then contracts a split dimension: ``query``/``key``/``value``/``wi``/``lm_head``
    all-reduce their outputs over ``axes[0]`` and their input gradients over ``axes[1]``, ``out``/``wo`` the
    other way round. Which physical axis should take which role depends on the links: see
    :func:`choose_tensor_2d`, which asks the cost model.

    >>> import numpy as np
    >>> from flax import linen as nn
    >>> wi = nn.LogicallyPartitioned(np.zeros((64, 256)), ("embed", "mlp"))
    >>> tensor_parallel_2d().specs({"wi": wi}, {"tensor": 2, "tensor2": 2})
    {'wi': P('tensor', 'tensor2')}
    """
    embed_axis, model_axis = axes
    if embed_axis == model_axis:
        raise ValueError(f"tensor_parallel_2d: the two axes must differ, got {axes}")
    rules = (
        (A.HEADS, (model_axis,)),
        (A.MLP, (model_axis,)),
        (A.VOCAB, (model_axis,)),
        (A.EMBED, (embed_axis,)),
    )
    return Plan(parts=(LogicalRules(rules, "tensor_parallel_2d", report_unused=False),))


def choose_tensor_2d(
    params: Any,
    mesh_axes: Mapping[str, int],
    workload: costmodel.Workload,
    hardware: costmodel.Hardware,
    *,
    axes: tuple[str, str] = ("tensor", "tensor2"),
    base: Plan | None = None,
    optimizer: Any = None,
) -> Plan:
    """ATP's choice for :func:`tensor_parallel_2d`: of the two ways to give ``axes`` their roles, the one whose
    modelled communication time (per-axis bandwidth and latency of ``hardware``) is lower, composed onto
    ``base``. The plan's notes record both times.

    In a transformer the ``embed`` axis carries about twice the all-reduce volume of the other (the MLP's
    hidden activations, split over the other axis), so the choice weighs each role's volume, which shrinks
    with the other axis's size, against each axis's bandwidth: a fast axis usually takes ``embed``.

    >>> import jax, spmd
    >>> from spmd import models
    >>> params = jax.eval_shape(models.get("gpt-tiny", layers=1).init, jax.random.key(0))
    >>> slow_tensor = costmodel.HARDWARE["h100"].with_axis_bandwidth({"tensor": 5e9})
    >>> plan = choose_tensor_2d(params, {"tensor": 2, "tensor2": 4}, costmodel.Workload(8, 32), slow_tensor)
    >>> plan.notes[0].startswith("tensor_parallel_2d: embed over tensor2")
    True
    """
    import optax

    base = base or Plan()
    optimizer = optimizer or optax.sgd(0.0)
    timed = []
    for roles in (tuple(axes), tuple(axes)[::-1]):
        plan = base + tensor_parallel_2d(axes=roles)
        est = costmodel.estimate(plan, params, mesh_axes, workload, optimizer=optimizer, hardware=hardware)
        timed.append((est.time.comm_s, roles, plan))
    (best_s, (embed_axis, model_axis), plan), (other_s, *_) = sorted(timed, key=lambda t: t[0])
    note = (
        f"tensor_parallel_2d: embed over {embed_axis}, heads/mlp/vocab over {model_axis}: modelled communication "
        f"{best_s * 1e3:.3g} ms per step on {hardware.name}, against {other_s * 1e3:.3g} ms the other way round"
    )
    return dataclasses.replace(plan, notes=plan.notes + (note,))
