"""Expert parallelism on the built-in mixture-of-experts GPT (moe-tiny): layouts, equivalence with one device,
the compiler's all-to-alls, training, and the CLI."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
import strategies
from spmd import cli, data, models
from spmd.models.moe import route
from tests.conftest import assert_trees_close, train_steps

STEPS, BATCH, LAYERS = 3, 16, 2
# (mesh, strategy): experts and batch on one axis; and data parallel across expert-parallel groups.
CASES = [({"expert": 8}, "ep"), ({"data": 2, "expert": 4}, "dp+ep")]
IDS = ["expert8-ep", "data2xexpert4-dp+ep"]


def _model():
    return models.get("moe-tiny", layers=LAYERS)


def _train(plan, mesh):
    return train_steps(_model(), plan, mesh, steps=STEPS, batch_size=BATCH)


@pytest.fixture(scope="module")
def reference():
    return _train(spmd.Plan(), spmd.make_mesh({"data": 1}, devices=jax.devices()[:1]))


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def sharded(request):
    axes, name = request.param
    mesh = spmd.make_mesh(axes)
    return (mesh, name, *_train(strategies.from_names(name), mesh))


def test_route_respects_capacity_and_priority():
    # 4 tokens, 2 experts, top-2, 3 slots: all first choices claim slots before any second choice.
    logits = jnp.array([[[3.0, 0.0], [2.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    dispatch, combine = route(logits, top_k=2, slots=3)
    per_expert = dispatch.sum(axis=(0, 1, 3))
    assert per_expert.tolist() == [3.0, 3.0]  # both full
    assert dispatch.sum(axis=-1).max() == 1.0  # a token takes at most one slot per expert
    # Expert 0: first choices of tokens 0, 1, 3 fill it, so token 2's second choice is dropped.
    assert dispatch[0, :, 0].sum(axis=-1).tolist() == [1.0, 1.0, 0.0, 1.0]
    # Expert 1: token 2's first choice takes slot 0, then second choices in sequence order until it is full.
    assert dispatch[0, :3, 1].argmax(axis=-1).tolist() == [1, 2, 0]
    assert dispatch[0, 3, 1].sum() == 0.0  # token 3's second choice is dropped
    # Gates: a token that kept both choices sums to one; a dropped choice loses its share.
    gates = combine.sum(axis=(2, 3))[0]
    np.testing.assert_allclose(gates[:2], 1.0, rtol=1e-6)
    assert 0.5 < gates[2] < 1.0 and 0.5 < gates[3] < 1.0


def test_expert_params_are_split_over_the_expert_axis(sharded):
    mesh, name, _, state, step = sharded
    moe = state.params["params"]["layers"]["moe"]
    for kernel in ("wi", "wo"):
        assert moe[kernel].sharding.spec == jax.sharding.PartitionSpec(None, "expert", None, None), kernel
        assert moe[kernel].addressable_shards[0].data.shape[1] == 8 // mesh.shape["expert"]
    assert moe["router"].sharding.spec == jax.sharding.PartitionSpec(None, None, None)
    # Momentum mirrors its parameter; everything else stays replicated.
    trace = state.opt_state[0].trace["params"]["layers"]["moe"]["wi"]
    assert trace.sharding.spec == moe["wi"].sharding.spec
    attn = state.params["params"]["layers"]["attn"]["query"]["kernel"]
    assert all(e is None for e in attn.sharding.spec)
    assert step.plan.batch_spec() == jax.sharding.PartitionSpec("expert" if name == "ep" else ("data", "expert"), None)


def test_sharded_step_equals_single_device(sharded, reference):
    _, _, losses, state, _ = sharded
    ref_losses, ref_state, _ = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.opt_state, ref_state.opt_state, rtol=1e-5, atol=1e-5, relative_to_max=True)


def test_report_shows_the_all_to_alls(sharded):
    mesh, name, _, _, step = sharded
    batch = data.batch(0, 0, BATCH, 32, 256)
    collectives = spmd.report(step, batch).to_dict()["collectives"]
    a2a = [c for c in collectives if c["kind"] == "all-to-all"]
    assert len(a2a) == 1 and a2a[0]["axes"] == ["expert"], collectives
    # Tokens to their experts and back, forward and backward, in each of the scanned layers.
    assert a2a[0]["count"] == 4 * LAYERS
    assert a2a[0]["group_size"] == mesh.shape["expert"]
    # Each moves one device's block of float32 dispatched tokens: all 8 experts' 10 slots for its own groups.
    assert a2a[0]["bytes"] == a2a[0]["count"] * 8 * (BATCH // mesh.size) * 10 * 64 * 4
    # Routing stays local: no gather of the router's probabilities (lax.top_k would gather them).
    assert not [c for c in collectives if c["kind"] == "all-gather"], collectives
    if name == "dp+ep":  # the expert kernels' gradients are summed across the data replicas only
        assert any(c["kind"] == "all-reduce" and c["axes"] == ["data"] for c in collectives), collectives
    # The cost model expects exactly these all-to-alls (the same bytes), and the whole step's traffic.
    report = spmd.report(step, batch)
    (analytic,) = [t for t in report.analytic_collectives if t.kind == "all-to-all"]
    assert analytic.count == a2a[0]["count"] and analytic.bytes == a2a[0]["bytes"]
    comm = report.comm_bytes_per_step
    assert 0.99 <= comm["compiled"] / comm["analytic"] <= 1.01, comm


def test_composes_with_tensor_parallelism_without_gathering_the_batch():
    # ep+tp: expert kernels split over expert and their hidden dimension over tensor; tokens still travel by
    # all-to-all (unless dispatched group-major first, XLA gathers the whole batch onto every device here).
    model, mesh = _model(), spmd.make_mesh({"expert": 4, "tensor": 2})
    params = jax.eval_shape(model.init, jax.random.key(0))
    step = spmd.TrainStep(models.loss_fn(model), optax.sgd(0.1), strategies.from_names("ep+tp"), mesh, params=params)
    layout = step.layout
    wi = next(row for row in layout.params.leaves if row.path == "params/layers/moe/wi")
    assert wi.spec == jax.sharding.PartitionSpec(None, "expert", None, "tensor")
    collectives = spmd.report(step, data.batch(0, 0, BATCH, 32, 256)).to_dict()["collectives"]
    kinds = {(c["kind"], tuple(c["axes"])) for c in collectives}
    assert ("all-to-all", ("expert",)) in kinds and not any(k == "all-gather" for k, _ in kinds), collectives


@pytest.mark.slow  # the default tier checks ep's numerics through the API above
def test_cli_run_check_and_loss_falls(capsys):
    # One CLI run serves two checks (each run compiles two training steps): Adam's loss falls on the Markov data
    # over 20 steps, and the expert-parallel run matches one device's (the check stays ~4e-6 over 20 steps).
    args = ["run", "--model", "moe-tiny", "--layers", str(LAYERS), "--mesh", "expert=8", "--strategy", "ep"]
    assert cli.main([*args, "--steps", "20", "--check", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "moe-tiny" and out["mesh"] == {"expert": 8}
    assert out["max_abs_diff"] <= 1e-4, out
    losses = np.array(out["losses"])
    assert np.all(np.isfinite(losses)) and losses[-3:].mean() < losses[0] - 1.0, losses
