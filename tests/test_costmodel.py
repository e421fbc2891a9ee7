"""The analytic cost model against hand formulas and against the compiled program: activation traffic of 2-D
tensor parallelism, FLOPs, activation memory, block padding, hardware links, and the ATP axis choice."""

import dataclasses

import jax
import optax
import pytest

import spmd
import strategies
from spmd import costmodel, data, models

BATCH = 16
H100 = costmodel.HARDWARE["h100"]


def _step(model, plan, mesh_axes, optimizer=None):
    params = jax.eval_shape(model.init, jax.random.key(0))
    mesh = spmd.make_mesh(mesh_axes)
    return spmd.TrainStep(models.loss_fn(model), optimizer or optax.adam(1e-3), plan, mesh, params=params)


def _batch(model):
    return data.batch(0, 0, BATCH, model.config.seq_len, model.config.vocab)


def test_tensor_parallel_2d_traffic_compiled_against_analytic():
    model = models.get("gpt-tiny", layers=2)
    report = spmd.report(_step(model, strategies.tensor_parallel_2d(), {"tensor": 2, "tensor2": 4}), _batch(model))
    comm = report.comm_bytes_per_step
    assert 0.95 <= comm["compiled"] / comm["analytic"] <= 1.05, comm
    # Both axes carry activation all-reduces, and nothing else runs: no parameter is gathered.
    assert {(c.kind, c.axes) for c in report.collectives} == {("all-reduce", ("tensor",)), ("all-reduce", ("tensor2",))}
    by_axis = {t.axes: t.traffic_bytes for t in report.analytic_collectives}
    compiled = {c.axes: c.traffic_bytes for c in report.collectives}
    for axes, expected in by_axis.items():
        assert compiled[axes] == pytest.approx(expected, rel=0.05), axes


def test_tensor_2d_roles_follow_the_bandwidth():
    params = jax.eval_shape(models.get("gpt-tiny", layers=2).init, jax.random.key(0))
    mesh = {"tensor": 4, "tensor2": 4}
    workload = costmodel.Workload(BATCH, 32)

    def embed_axis(hardware):
        plan = strategies.choose_tensor_2d(params, mesh, workload, hardware)
        wi = plan.specs(params, mesh)["params"]["layers"]["mlp"]["wi"]["kernel"]
        return wi[1]

    # Equal sizes: the embed role carries about twice the other's volume, so it goes to the faster axis.
    assert embed_axis(H100.with_axis_bandwidth({"tensor": 10e9})) == "tensor2"
    assert embed_axis(H100.with_axis_bandwidth({"tensor2": 10e9})) == "tensor"


def test_flops_match_the_hand_count():
    c = models.get("gpt-tiny", layers=2).config
    params = jax.eval_shape(models.get("gpt-tiny", layers=2).init, jax.random.key(0))
    plan = strategies.data_parallel()
    rows = plan.resolve(params, {"data": 8}).leaves
    workload = costmodel.Workload(BATCH, c.seq_len)
    tokens = BATCH * c.seq_len / 8
    matmul = c.layers * (4 * c.d_model**2 + 2 * c.d_model * c.mlp) + c.d_model * c.vocab  # the lookups are free
    attention = c.layers * 2 * c.seq_len * c.d_model  # q·k and p·v per token
    expected = 3 * 2 * tokens * (matmul + attention)
    assert costmodel.flops_per_device(rows, plan, {"data": 8}, workload) == pytest.approx(expected)
    # Tensor parallelism splits the blocks' matmul work; remat adds a forward pass.
    tp = strategies.data_parallel() + strategies.tensor_parallel()
    tp_rows = tp.resolve(params, {"data": 2, "tensor": 4}).leaves
    tp_flops = costmodel.flops_per_device(tp_rows, tp, {"data": 2, "tensor": 4}, workload)
    head = c.d_model * c.vocab  # the lm_head is not split by tensor parallelism
    assert tp_flops == pytest.approx(3 * 2 * (4 * tokens) * ((matmul - head + attention) / 4 + head))
    # Full remat runs each layer's forward again, but for the projection ending it (``wo``, whose output is the
    # next layer's input and is kept); the head, outside the layers, is not recomputed.
    remat = strategies.zero3()
    remat_rows = remat.resolve(params, {"data": 8}).leaves
    recomputed = 2 * tokens * (c.layers * (4 * c.d_model**2 + c.d_model * c.mlp) + attention)
    full = dataclasses.replace(remat, remat="full")
    assert costmodel.flops_per_device(remat_rows, full, {"data": 8}, workload) == pytest.approx(expected + recomputed)
    # FSDP's default keeps every matmul output: nothing is recomputed. Keeping q, k, v and the MLP's hidden layer
    # recomputes the out projection and the attention products.
    assert costmodel.flops_per_device(remat_rows, remat, {"data": 8}, workload) == pytest.approx(expected)
    names = dataclasses.replace(remat, remat="names:query_proj,key_proj,value_proj,mlp_hidden")
    out_proj = 2 * tokens * c.layers * c.d_model**2
    assert costmodel.flops_per_device(remat_rows, names, {"data": 8}, workload) == pytest.approx(
        expected + out_proj + attention * 2 * tokens
    )


def test_activation_estimate_shrinks_with_remat_and_tensor_parallelism():
    params = jax.eval_shape(models.get("gpt-tiny", layers=4).init, jax.random.key(0))
    workload = costmodel.Workload(BATCH, 32)

    def kept(plan, mesh):
        return costmodel.activation_bytes(plan.resolve(params, mesh).leaves, plan, mesh, workload)

    dp = kept(strategies.data_parallel(), {"data": 2})
    assert kept(strategies.data_parallel() + spmd.Plan(remat=True), {"data": 2}) < 0.6 * dp
    assert kept(strategies.data_parallel() + strategies.tensor_parallel(), {"data": 2, "tensor": 4}) < 0.6 * dp


def test_block_padding_is_what_the_compiled_program_receives():
    # 16-row blocks over 8 devices: every d_model (64) dimension is padded to 128 rows; the compiled step's
    # arguments are exactly the padded state the cost model counts.
    model = models.get("gpt-tiny", layers=2, remat=True)
    step = _step(model, strategies.fsdp(block=16), {"fsdp": 8})
    report = spmd.report(step, _batch(model))
    assert report.compiled_memory["argument_bytes"] == report.analytic_memory["argument_bytes"]
    padded = [row for row in report.params if row.padded_shape]
    assert padded and all(128 in row.padded_shape for row in padded)
    pad = sum(row.padding_bytes_per_device for row in padded)
    assert report.analytic_memory["padding_bytes"] == 4 * pad  # the parameter, its gradient, Adam's two moments
    assert "→128" in str(report)


def test_estimate_agrees_with_the_training_step_layout():
    model = models.get("gpt-tiny", layers=2)
    params = jax.eval_shape(model.init, jax.random.key(0))
    for name, mesh in (("zero2", {"data": 8}), ("dp+fsdp+tp", {"data": 2, "fsdp": 2, "tensor": 2})):
        plan = strategies.from_names(name)
        est = costmodel.estimate(
            plan, params, mesh, costmodel.Workload(BATCH, 32), optimizer=optax.adam(1e-3), hardware=H100
        )
        layout = _step(model, plan, mesh).layout
        assert est.per_device_bytes == costmodel.model_state_bytes(layout), name
        assert est.traffic == tuple(costmodel.traffic(layout, plan, mesh, costmodel.Workload(BATCH, 32)))


def test_links_and_step_time():
    mesh = {"data": 4, "tensor": 8}
    assert H100.link(("tensor",), mesh) == (H100.ici_bandwidth, H100.ici_latency)
    assert H100.link(("data", "tensor"), mesh) == (H100.dcn_bandwidth, H100.dcn_latency)  # the slowest link
    assert costmodel.HARDWARE["tpu-v5p"].link(("data",), mesh)[0] == costmodel.HARDWARE["tpu-v5p"].ici_bandwidth
    assert H100.with_axis_bandwidth({"data": 1e9}).link(("data",), mesh)[0] == 1e9
    t = costmodel.step_time(0.0, [costmodel.Traffic("all-gather", ("data",), 0, 5e9, count=2)], H100, mesh)
    assert t.comm_s == pytest.approx(5e9 / H100.dcn_bandwidth + 2 * H100.dcn_latency)
    with pytest.raises(ValueError, match="unknown device kind 'tpu-v9'"):
        costmodel.hardware("tpu-v9")
