"""What tensor_parallel says about a model it cannot split as Megatron does: nothing it recognises, a column layer
without its row partner, or rules contradicting the model's logical names."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spmd
import strategies


def test_a_model_tensor_parallel_does_not_recognise_is_said_to_split_nothing_once():
    params = {"blocks": {"mix": {"kernel": jax.ShapeDtypeStruct((64, 256), "float32")},
                         "unmix": {"kernel": jax.ShapeDtypeStruct((256, 64), "float32")}}}  # fmt: skip
    loss = lambda p, b: jnp.sum(b["x"] @ p["blocks"]["mix"]["kernel"] @ p["blocks"]["unmix"]["kernel"])  # noqa: E731
    mesh = spmd.make_mesh({"data": 4, "tensor": 2})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", spmd.PlanWarning)
        spmd.TrainStep(loss, optax.sgd(0.1), strategies.data_parallel() + strategies.tensor_parallel(), mesh,
                       params=params)  # fmt: skip
    said = [str(w.message) for w in seen]
    nothing = [m for m in said if "tensor_parallel splits nothing in this model" in m]
    assert len(nothing) == 1, said
    assert "mesh axis 'tensor'" in nothing[0] and "tensor_parallel(rules=" in nothing[0]
    assert not any("matched no array of this model" in m for m in said)  # said once, not again as an idle axis
    # A strict plan still only warns: the model's own activation constraints may use the axis.
    strict = (strategies.fsdp(min_bytes=0) + strategies.tensor_parallel()).with_strict()
    with pytest.warns(spmd.PlanWarning, match="tensor_parallel splits nothing in this model"):
        assert strict.specs(params, {"fsdp": 4, "tensor": 2})["blocks"]["mix"]["kernel"] == P(None, "fsdp")
    # With rules for the model's own names, it splits them and says nothing.
    rules = [(r"/mix/kernel$", (None, "tensor")), (r"/unmix/kernel$", ("tensor", None))]
    with warnings.catch_warnings():
        warnings.simplefilter("error", spmd.PlanWarning)
        plan = strategies.data_parallel() + strategies.tensor_parallel(rules=rules)
        step = spmd.TrainStep(loss, optax.sgd(0.1), plan, mesh, params=params)
    assert step.layout.params.specs["blocks"]["mix"]["kernel"] == P(None, "tensor")


def test_a_column_layer_without_its_row_partner_is_said_once():
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, "float32")  # noqa: E731
    params = {"mlp": {"up_proj": {"kernel": sds(64, 256), "bias": sds(256)}, "proj": {"kernel": sds(256, 64)}}}
    loss = lambda p, b: jnp.sum((b["x"] @ p["mlp"]["up_proj"]["kernel"]) @ p["mlp"]["proj"]["kernel"])  # noqa: E731
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", spmd.PlanWarning)
        plan = strategies.data_parallel() + strategies.tensor_parallel()
        step = spmd.TrainStep(loss, optax.adam(0.1), plan, spmd.make_mesh({"data": 4, "tensor": 2}), params=params)
    said = [str(w.message) for w in seen]
    alone = [m for m in said if "has no row-parallel partner" in m]
    assert len(alone) == 1, said
    assert re.search(r"column-parallel layer 'mlp/up_proj' .*tensor_parallel\(rules=", alone[0])
    assert step.layout.params.specs["mlp"]["up_proj"]["kernel"] == P(None, "tensor")  # still split as asked
    assert alone[0] in step.layout.params.advice  # and the report lists it


def test_a_row_partner_laid_out_by_a_rule_is_a_partner():
    tree = {"attn": {"q_proj": {"kernel": np.zeros((8, 32))}, "o_proj": {"kernel": np.zeros((32, 8))}}}
    plan = strategies.tensor_parallel(rules=[(r"o_proj/kernel$", ("tensor", None))])
    with warnings.catch_warnings():
        warnings.simplefilter("error", spmd.PlanWarning)
        specs = plan.specs(tree, {"tensor": 2})
    assert specs["attn"] == {"o_proj": {"kernel": P("tensor", None)}, "q_proj": {"kernel": P(None, "tensor")}}


def test_tensor_parallel_rules_that_contradict_the_logical_names_are_an_error():
    from flax import linen as nn

    wi = nn.LogicallyPartitioned(np.zeros((8, 32), np.float32), ("embed", "mlp"))
    plan = strategies.tensor_parallel(rules=[(r"wi$", (None, "other"))])
    with pytest.raises(spmd.PlanError, match=r"wi \(8, 32\): tensor_parallel's logical rules put dimension 1 on"):
        plan.specs({"wi": wi}, {"tensor": 2, "other": 2})


def test_sequence_parallel_splitting_nothing_is_said_once():
    params = {"blocks": {"mix": {"kernel": jax.ShapeDtypeStruct((64, 256), "float32")}}}
    loss = lambda p, b: jnp.sum(b["x"] @ p["blocks"]["mix"]["kernel"])  # noqa: E731
    mesh = spmd.make_mesh({"data": 4, "tensor": 2})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", spmd.PlanWarning)
        plan = strategies.data_parallel() + strategies.sequence_parallel()
        spmd.TrainStep(loss, optax.sgd(0.1), plan, mesh, params=params)
    said = [str(w.message) for w in seen]
    assert sum("tensor_parallel splits nothing" in m for m in said) == 1, said
    assert not any("mesh axis 'tensor' (2 devices) splits no parameter" in m for m in said), said
