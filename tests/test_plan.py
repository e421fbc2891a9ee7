"""Plans as data: resolution of rules, composition, and the errors for plans that cannot apply."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import spmd
import strategies
from spmd import Plan, PlanError, PlanWarning

SIZES = {"data": 2, "fsdp": 2, "tensor": 2}


def sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def boxed(names, *shape):
    return nn.LogicallyPartitioned(sds(*shape), names)


# ------------------------------------------------------------------------------------------- path rules
def test_path_rules_first_match_wins_and_pads_trailing_dims():
    plan = Plan.from_rules([(r"attn/.*kernel", (None, "tensor")), (r"kernel", ("fsdp",))])
    tree = {"attn": {"q": {"kernel": sds(8, 4, 2)}}, "mlp": {"kernel": sds(8, 6)}, "bias": sds(6)}
    specs = plan.specs(tree, SIZES)
    assert specs["attn"]["q"]["kernel"] == P(None, "tensor", None)
    assert specs["mlp"]["kernel"] == P("fsdp", None)
    assert specs["bias"] == P(None)


def test_a_rule_that_matches_nothing_warns_and_strict_mode_raises():
    plan = Plan.from_rules([(r"kernel", ("fsdp",)), (r"no_such_param", ("tensor",))])
    with pytest.warns(PlanWarning, match=r"rule 'no_such_param' matched nothing"):
        plan.specs({"kernel": sds(4)}, SIZES)
    with pytest.raises(PlanError, match=r"strict plan: rules: rule 'no_such_param' matched nothing"):
        plan.with_strict().specs({"kernel": sds(4)}, SIZES)


def test_an_unmatched_rule_is_said_once_for_a_step_and_its_report():
    # A step resolves its parameters, gradients and optimizer state, and its report resolves them again: under
    # Python's default warning filters (a fresh process) the unmatched rule is one warning, not four.
    script = (
        "import spmd; spmd.emulate_devices(8); import jax, optax, strategies; from spmd import data, models\n"
        "model = models.get('gpt-tiny', layers=1)\n"
        "plan = strategies.data_parallel() + spmd.Plan.from_logical_rules([('kv_heads', 'tensor')])\n"
        "step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan,\n"
        "    spmd.make_mesh({'data': 4, 'tensor': 2}), params=jax.eval_shape(model.init, jax.random.key(0)))\n"
        "spmd.report(step, data.batch(0, 0, 8, 32, 256))\n"
    )
    root = str(Path(__file__).resolve().parent.parent)
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root}
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("rule 'kv_heads' matched nothing") == 1, r.stderr


def test_a_strategy_that_splits_nothing_in_the_model_is_said():
    # tensor_parallel knows logical names and common projection names; this model has neither, so 'tensor'
    # would only replicate the work: a warning names the axis and the strategy (and the report repeats it).
    params = {"conv": {"kernel": sds(3, 3, 3, 16)}, "dense": {"kernel": sds(1024, 10)}}
    plan = strategies.data_parallel() + strategies.tensor_parallel()
    mesh = spmd.make_mesh({"data": 2, "tensor": 4})
    loss = lambda p, b: jnp.sum(p["dense"]["kernel"]) * jnp.mean(b["x"])  # noqa: E731
    with pytest.warns(PlanWarning, match=r"tensor_parallel splits nothing in this model.*mesh axis 'tensor'"):
        step = spmd.TrainStep(loss, optax.sgd(0.1), plan, mesh, params=params)
    assert any("tensor_parallel splits nothing" in w for w in spmd.report(step, {"x": jnp.ones((8, 4))}).warnings)
    # Another strategy naming an axis that splits nothing is said as the idle axis.
    mine = spmd.Plan(parts=(spmd.rules.LogicalRules((("mlp", ("tensor",)),), "my_tp", report_unused=False),))
    with pytest.warns(PlanWarning, match=r"mesh axis 'tensor' \(4 devices\) splits no parameter.*my_tp"):
        spmd.TrainStep(loss, optax.sgd(0.1), strategies.data_parallel() + mine, mesh, params=params)
    # Where the rules match, the axis splits and nothing is said.
    named = {"fc1": {"kernel": sds(16, 64)}, "fc2": {"kernel": sds(64, 16)}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanWarning)
        spmd.TrainStep(lambda p, b: 0.0, optax.sgd(0.1), plan, mesh, params=named)


def test_strict_mode_rejects_an_uncovered_parameter():
    plan = Plan.from_rules([(r"kernel", ("fsdp",))]).with_strict()
    with pytest.raises(PlanError, match=r"strict plan: no rule covers bias \(4,\)"):
        plan.specs({"kernel": sds(4), "bias": sds(4)}, SIZES)


def test_spec_longer_than_rank_is_an_error():
    plan = Plan.from_rules([(r"bias", ("fsdp", "tensor"))])
    with pytest.raises(PlanError, match=r"rule 'bias' gives spec .* with 2 entries to 'bias' of shape \(4,\)"):
        plan.specs({"bias": sds(4)}, SIZES)


def test_bad_regex_is_reported():
    with pytest.raises(PlanError, match=r"rule regex '\(' does not compile"):
        Plan.from_rules([("(", ("fsdp",))])


# ------------------------------------------------------------------------------------------- logical rules
def test_logical_rules_on_linen_boxes_and_nnx_variables():
    plan = Plan.from_logical_rules([("mlp", "tensor"), ("embed", "fsdp")])
    tree = {"wi": boxed(("embed", "mlp"), 8, 16), "scale": boxed(("embed",), 8)}
    specs = plan.specs(tree, SIZES)
    assert specs == {"wi": P("fsdp", "tensor"), "scale": P("fsdp")}

    from flax import nnx

    var = nnx.Param(jnp.zeros((8, 16)), out_sharding=("embed", "mlp"), eager_sharding=False)
    assert plan.specs({"wi": var}, SIZES)["wi"] == P("fsdp", "tensor")


def test_logical_rule_skips_axes_already_used_in_the_array():
    plan = Plan.from_logical_rules([("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", "tensor")])
    assert plan.specs({"w": boxed(("embed", "mlp"), 8, 8)}, SIZES)["w"] == P("fsdp", "tensor")


@pytest.mark.parametrize("mesh", [SIZES, None])
def test_two_logical_rules_giving_one_array_the_same_axis_is_an_error_naming_both(mesh):
    # Without the error the kernel would silently keep one split of the two asked for; path rules raise too.
    plan = Plan.from_logical_rules([("mlp", "tensor"), ("embed", "tensor")])
    tree = {"wi": {"kernel": boxed(("embed", "mlp"), 8, 16)}, "scale": boxed(("embed",), 8)}
    message = (
        r"wi/kernel \(8, 16\) \(logical axes \('embed', 'mlp'\)\): mesh axis 'tensor' is used twice, on dimension 1 "
        r"by rule \('mlp', 'tensor'\) and on dimension 0 by rule \('embed', 'tensor'\) of logical rules; .* map "
        r"'embed' or 'mlp' to another mesh axis \(or to None"
    )
    with pytest.raises(PlanError, match=message):
        plan.specs(tree, mesh)
    # The same rules are legal where no array has both names, and a fallback the user wrote is no conflict.
    with pytest.warns(PlanWarning, match="rule 'mlp' matched nothing"):
        assert plan.specs({"scale": boxed(("embed",), 8)}, mesh) == {"scale": P("tensor")}
    fallback = Plan.from_logical_rules([("mlp", "tensor"), ("embed", "tensor"), ("embed", None)])
    assert fallback.specs(tree, mesh)["wi"]["kernel"] == P(None, "tensor")
    # Activations keep flax's convention: the first rule whose axes are free wins (heads before seq).
    assert plan.activation_spec(("embed", "mlp"), (8, 16), SIZES) == P(None, "tensor")


def test_one_mesh_axis_on_two_dimensions_is_an_error_without_a_mesh_too():
    with pytest.raises(PlanError, match=r"w \(4, 4\): mesh axis 'tensor' is used twice, on dimension 0 by rules"):
        Plan.from_rules([("w", ("tensor", "tensor"))]).specs({"w": sds(4, 4)})


# ------------------------------------------------------------------------------------------- composition
def test_plans_compose_per_dimension():
    tp = Plan.from_rules([(r"kernel", (None, "tensor"))])
    plan = strategies.fsdp(min_bytes=0) + tp
    specs = plan.specs({"kernel": sds(16, 8)}, SIZES)
    assert specs["kernel"] == P("fsdp", "tensor")  # fsdp takes the largest dimension tp left free
    assert plan.batch_axes == ("fsdp",)
    assert (strategies.data_parallel() + strategies.fsdp()).batch_axes == ("data", "fsdp")


def test_two_parts_disagreeing_on_a_dimension_is_an_error_naming_both():
    a = Plan.from_rules([(r"kernel", ("data",))], source="first")
    b = Plan.from_rules([(r"kernel", ("tensor",))], source="second")
    with pytest.raises(PlanError, match=r"kernel \(8, 8\): first puts dimension 0 on \('data',\) but second puts it"):
        (a + b).specs({"kernel": sds(8, 8)}, SIZES)


def test_one_mesh_axis_twice_in_a_spec_is_an_error_naming_both():
    a = Plan.from_rules([(r"kernel", ("tensor", None))], source="first")
    b = Plan.from_rules([(r"kernel", (None, "tensor"))], source="second")
    with pytest.raises(
        PlanError, match=r"mesh axis 'tensor' is used twice, on dimension 0 by first and on dimension 1"
    ):
        (a + b).specs({"kernel": sds(8, 8)}, SIZES)


def test_plans_are_frozen_comparable_data():
    assert strategies.fsdp() + strategies.tensor_parallel() == strategies.fsdp() + strategies.tensor_parallel()
    assert hash(strategies.from_names("dp+fsdp+tp"))
    with pytest.raises(AttributeError):
        strategies.fsdp().batch_axes = ("x",)


# ------------------------------------------------------------------------------------------- divisibility
def test_indivisible_dimension_is_an_error_with_both_ways_out():
    plan = Plan.from_rules([(r"kernel", ("tensor",))])
    with pytest.raises(PlanError) as e:
        plan.specs({"kernel": sds(5, 4)}, SIZES)
    msg = str(e.value)
    assert "kernel (5, 4): dimension 0 has size 5, not divisible by mesh axes ('tensor',) of size 2" in msg
    assert "change the rule" in msg and "allow_replication('^kernel$')" in msg


def test_opting_in_to_replication_is_recorded():
    plan = Plan.from_rules([(r"kernel", ("tensor",))]).allow_replication(r"kernel")
    layout = plan.resolve({"kernel": sds(5, 4)}, SIZES)
    assert layout.specs["kernel"] == P(None, None)
    assert "left replicated" in layout.leaves[0].note
    assert any("replication allowed" in n for n in plan.notes)


def test_fsdp_chooses_largest_divisible_free_dimension_and_errors_when_none_divides():
    plan = strategies.fsdp(min_bytes=0)
    specs = plan.specs({"a": sds(3, 16), "b": sds(8, 8), "c": sds(12, 8)}, {"fsdp": 4})
    assert specs == {"a": P(None, "fsdp"), "b": P("fsdp", None), "c": P("fsdp", None)}
    with pytest.raises(PlanError, match=r"odd \(3, 5\) .*no free dimension is divisible by mesh axis 'fsdp' of size 4"):
        plan.specs({"odd": sds(3, 5)}, {"fsdp": 4})
    assert strategies.fsdp(min_bytes=1 << 20).specs({"w": sds(8, 8)}, {"fsdp": 4})["w"] == P(None, None)


def test_fsdp_avoids_the_stacked_layers_dimension():
    specs = strategies.fsdp(min_bytes=0).specs({"w": boxed(("layers", "embed", "mlp"), 64, 8, 4)}, {"fsdp": 4})
    assert specs["w"] == P(None, "fsdp", None)


# ------------------------------------------------------------------------------------------- mesh axes
def test_unknown_mesh_axis_names_the_strategy():
    with pytest.raises(PlanError, match=r"tensor_parallel uses mesh axis 'tensor', but the mesh has only data=8"):
        strategies.tensor_parallel().specs({"w": sds(4)}, {"data": 8})
    with pytest.raises(ValueError, match=r"unknown strategy 'nope'; choose from dp, fsdp, tp"):
        strategies.from_names("dp+nope")


# ------------------------------------------------------------------------------------------- optimizer state
def test_optimizer_state_mirrors_parameters_and_counters_are_replicated():
    params = {"w": boxed(("embed", "mlp"), 8, 16)}
    plan = Plan.from_logical_rules([("mlp", "tensor")])
    opt = jax.eval_shape(optax.adam(1e-3).init, spmd.unbox(params))
    specs = plan.specs(opt, SIZES, params=params)
    assert specs[0].mu["w"] == P(None, "tensor") and specs[0].nu["w"] == P(None, "tensor")
    assert specs[0].count == P()


def test_batch_spec_and_batch_divisibility():
    plan = strategies.data_parallel() + strategies.fsdp()
    assert plan.batch_spec(3) == P(("data", "fsdp"), None, None)
    mesh = spmd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with pytest.raises(PlanError, match=r"batch of shape \(6, 4\) cannot be split over batch axes .* \(4 ways\)"):
        plan.batch_shardings({"tokens": np.zeros((6, 4))}, mesh)


def test_activation_constraint_resolves_logical_names():
    plan = strategies.data_parallel() + strategies.tensor_parallel()
    mesh = spmd.make_mesh({"data": 4, "tensor": 2})
    assert plan.activation_spec(("batch", "seq", "heads"), (8, 4, 2), mesh) == P("data", None, "tensor")

    @jax.jit
    def f(x):
        with spmd.activate(plan, mesh):
            return spmd.constrain(x * 2, ("batch", "mlp"))

    assert f(jnp.ones((8, 4))).sharding.spec == P("data", "tensor")


def test_fsdp_leaves_an_array_another_part_already_split_and_notes_it():
    plan = strategies.fsdp(min_bytes=0) + strategies.tensor_parallel()
    layout = plan.resolve({"bias": boxed(("mlp",), 256)}, SIZES)
    assert layout.specs["bias"] == P("tensor")
    assert layout.leaves[0].note == "not split by fsdp: no free dimension divisible by 'fsdp' (2)"
    assert str(plan) == (
        "batch over fsdp; fsdp(axis=fsdp, min_bytes=0) + tensor_parallel; layers rematerialised (matmul outputs saved)"
    )
