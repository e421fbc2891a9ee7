"""The cost model reads the layouts, not spmd's own names: models that call their dimensions what they like
(``width``/``hid``, MaxText's, penzai's) and plans that split them with any kind of part (an FSDP strategy, a
logical rule, a path rule) get the FLOPs and collective traffic the compiled program has."""

import jax
import optax
import pytest

import spmd
import strategies
from spmd import costmodel, data, models
from spmd._hlo import matmul_flops
from spmd._matmuls import attention_parents
from tests._named_models import MAXTEXT, MAXTEXT_RULES, PENZAI, PENZAI_RULES, abstract, named_lm, named_mlp

BATCH = 16
TOLERANCE = costmodel.TOLERANCE


def _measure(model, plan, mesh_axes):
    """(analytic FLOPs, compiled matmul FLOPs, analytic traffic, compiled traffic, report) per device per step."""
    step = spmd.TrainStep(
        models.loss_fn(model), optax.adam(1e-3), plan, spmd.make_mesh(mesh_axes), params=abstract(model)
    )
    batch = data.batch(0, 0, BATCH, model.config.seq_len, model.config.vocab)
    report = spmd.report(step, batch)
    comm = report.comm_bytes_per_step
    compiled_flops = matmul_flops(step.compile(batch).as_text())
    return report.flops_per_device, compiled_flops, comm["analytic"], comm["compiled"], report


def _assert_agrees(measured):
    flops, compiled_flops, traffic, compiled_traffic, report = measured
    assert flops == pytest.approx(compiled_flops, rel=0.01), (flops, compiled_flops)
    assert abs(compiled_traffic / traffic - 1) <= TOLERANCE, (compiled_traffic, traffic, report.collectives)
    assert not [w for w in report.warnings if w.startswith("collective traffic")], report.warnings


# name -> (plan for the model's own names, the same plan in spmd's names, mesh)
MLP_PLANS = {
    "fsdp": (strategies.fsdp(), strategies.fsdp(), {"fsdp": 8}),
    "tp": (
        strategies.data_parallel() + spmd.Plan.from_logical_rules([("hid", "tensor")]),
        strategies.data_parallel() + spmd.Plan.from_logical_rules([("mlp", "tensor")]),
        {"data": 2, "tensor": 4},
    ),
}


@pytest.mark.parametrize("name", list(MLP_PLANS))
def test_an_mlp_with_its_own_names_is_priced_like_the_compiled_program(name):
    plan, twin, mesh = MLP_PLANS[name]
    measured = _measure(named_mlp(), plan, mesh)
    _assert_agrees(measured)
    # The same network named as spmd names it: the same FLOPs, whatever the words.
    builtin = models.get("mlp")
    rows = twin.resolve(abstract(builtin), mesh).leaves
    workload = costmodel.Workload(BATCH, builtin.config.seq_len)
    assert measured[0] == costmodel.flops_per_device(rows, twin, mesh, workload) > 0
    if name == "tp":  # Megatron's pair over the tensor axis, read off which kernel dimension it splits
        assert {t.axes for t in measured[4].analytic_collectives if t.kind == "all-reduce"} >= {("tensor",)}


def test_fsdp_written_as_a_logical_rule_gathers_and_scatters_like_fsdp():
    model = models.get("gpt-tiny", layers=2, remat=True)
    plan = spmd.Plan.from_logical_rules([("embed", "fsdp")]) + spmd.Plan(batch_axes=("fsdp",), remat=True)
    measured = _measure(model, plan, {"fsdp": 8})
    _assert_agrees(measured)
    kinds = {(t.kind, t.axes) for t in measured[4].analytic_collectives}
    assert {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",))} <= kinds


def test_parameters_split_over_a_batch_axis_by_a_path_rule_are_gathered():
    params = {"w": jax.ShapeDtypeStruct((256, 64), "float32"), "b": jax.ShapeDtypeStruct((64,), "float32")}
    plan = spmd.Plan.from_rules([("w", ("fsdp", None))]) + spmd.Plan(batch_axes=("fsdp",), remat=True)
    layout = spmd.resolve_state(plan, params, optax.sgd(0.1), {"fsdp": 4})
    by_kind = {t.kind: t for t in costmodel.data_parallel_traffic(layout, plan, {"fsdp": 4})}
    w = 256 * 64 * 4
    # Gathered twice (forward and the rematerialised backward), its gradient reduce-scattered; the bias,
    # replicated, all-reduces its gradient.
    assert by_kind["all-gather"].traffic_bytes == 2 * 3 / 4 * w
    assert by_kind["reduce-scatter"].traffic_bytes == 3 / 4 * w
    assert by_kind["all-reduce"].bytes == 64 * 4


@pytest.mark.parametrize(
    "names,rules,remat",
    [
        (MAXTEXT, MAXTEXT_RULES, False),
        pytest.param(MAXTEXT, MAXTEXT_RULES, True, marks=pytest.mark.slow),
        pytest.param(PENZAI, PENZAI_RULES, False, marks=pytest.mark.slow),
    ],
    ids=["maxtext", "maxtext-remat", "penzai"],
)
def test_maxtext_and_penzai_names_under_fsdp_and_tensor(names, rules, remat):
    model = named_lm(names, layers=2, remat=remat)
    plan = spmd.Plan.from_logical_rules(rules) + spmd.Plan(batch_axes=("fsdp",), remat=remat)
    measured = _measure(model, plan, {"fsdp": 4, "tensor": 2})
    _assert_agrees(measured)
    # Attention is found by its shape (one dimension projected onto two), whatever its heads are called.
    rows = plan.resolve(abstract(model), {"fsdp": 4, "tensor": 2}).leaves
    assert len(attention_parents(costmodel.matmuls(rows))) == 1


def test_remat_recomputes_what_the_compiled_program_recomputes():
    # A rematerialised layer runs its forward again, except the projection that ends it (its output is the next
    # layer's input, kept anyway): FLOPs and the tensor axis's forward all-reduces follow.
    model = models.get("gpt-tiny", layers=2, remat=True)
    _assert_agrees(_measure(model, strategies.from_names("dp+tp") + spmd.Plan(remat=True), {"data": 2, "tensor": 4}))


def test_matmul_roles_come_from_shapes_not_words():
    from flax import linen as nn

    def box(shape, names):
        return nn.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, "float32"), names)

    params = {
        "embedding": {"embedding": box((256, 64), ("vocab", "embed"))},
        # MaxText stacks its layers on dimension 1 (param_scan_axis).
        "query": {"kernel": box((64, 3, 4, 16), ("embed", "layers", "q_heads", "kv"))},
        "out": {"kernel": box((4, 3, 16, 64), ("heads", "layers", "kv", "embed"))},
        "wi": {"kernel": box((64, 3, 128), ("embed", "layers", "mlp"))},
        "conv": {"kernel": box((3, 64, 64), ("taps", "c_in", "c_out"))},  # [taps, in, out]: not a matmul
        "rel_bias": box((4, 32), ("heads", "buckets")),  # neither a kernel nor touching the residual stream
    }
    found = {m.parent: m for m in costmodel.matmuls(spmd.Plan().resolve(params).leaves)}
    assert set(found) == {"embedding/embedding", "query", "out", "wi"}
    assert (found["query"].in_dims, found["query"].out_dims, found["query"].layers) == ((0,), (2, 3), 3)
    assert (found["out"].in_dims, found["out"].out_dims) == ((0, 2), (3,))
    assert found["out"].writes_residual and found["wi"].reads_residual and found["embedding/embedding"].lookup
