"""The pipeline executor: every schedule trains exactly like the unpipelined model, on two mesh shapes; the
ticks it executes are the simulator's; uneven stages; the report; the CLI; mistakes."""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest

import spmd
import strategies
from spmd import costmodel, data, models
from spmd._ticks import CODES, FIELDS, IDLE, Placement
from spmd.pipeline import Costs, ScheduleError, simulate, simulate_lockstep, tick_program
from tests.conftest import assert_trees_close, run_cli, train_steps

STEPS, BATCH, LAYERS = 2, 16, 8
MESHES = {
    "stage4xdata2": ({"stage": 4, "data": 2}, "dp", 8),
    "stage2xfsdp2xtensor2": ({"stage": 2, "fsdp": 2, "tensor": 2}, "fsdp+tp", 4),
}
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("bfs", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)]
# The default tier runs 1F1B, ZB-H1 and ZB-V on the first mesh; the slow tier the rest: every schedule runs on both.
DEFAULT = {("stage4xdata2", name) for name in ("1f1b", "zb-h1", "zb-v")}
CASES = [
    pytest.param(mesh, name, v, marks=() if (mesh, name) in DEFAULT else (pytest.mark.slow,), id=f"{mesh}-{name}")
    for mesh in MESHES
    for name, v in SCHEDULES
]


def _train(plan, mesh, name="gpt-tiny"):
    return train_steps(models.get(name, layers=LAYERS, remat=plan.remat), plan, mesh, steps=STEPS, batch_size=BATCH)


@pytest.fixture(scope="module")
def reference():
    losses, state, step = _train(spmd.Plan(), spmd.make_mesh({"data": 1}, devices=jax.devices()[:1]))
    return losses, step.params_of(state)


def _pipeline_plan(mesh, name, virtual, counts=None):
    mesh_axes, others, m = MESHES[mesh]
    options = strategies.PipelineOptions(name, m, virtual, counts)
    return strategies.from_names(f"pp+{others}", mesh_axes, pipeline_options=options), mesh_axes


@pytest.fixture(scope="module")
def runs():
    """One training run per (mesh, schedule), shared by the tests that look at it."""
    cache = {}

    def get(mesh, name, virtual, counts=None):
        key = (mesh, name, virtual, counts)
        if key not in cache:
            plan, mesh_axes = _pipeline_plan(mesh, name, virtual, counts)
            cache[key] = _train(plan, spmd.make_mesh(mesh_axes))
        return cache[key]

    return get


def _assert_matches(run, reference):
    losses, state, step = run
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(step.params_of(state), ref_params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh,name,virtual", CASES)
def test_pipelined_training_equals_the_unpipelined_model(runs, reference, mesh, name, virtual):
    run = runs(mesh, name, virtual)
    _assert_matches(run, reference)
    _, state, step = run
    # The stacked layers live [stage, chunk, layer, ...], split over the stages (and fsdp/tensor where planned).
    kernel = state.params["params"]["layers"]["mlp"]["wi"]["kernel"]
    p = MESHES[mesh][0]["stage"]
    assert kernel.shape[:3] == (p, virtual, LAYERS // (p * virtual))
    axes = {a for e in kernel.sharding.spec if e for a in ((e,) if isinstance(e, str) else e)}
    assert kernel.sharding.spec[0] == "stage"
    assert axes == ({"stage", "fsdp", "tensor"} if "fsdp" in mesh else {"stage"})


@pytest.mark.parametrize(
    "mesh,name,virtual",
    [
        ("stage4xdata2", "zb-h1", 1),
        ("stage4xdata2", "zb-v", 2),
        pytest.param("stage2xfsdp2xtensor2", "interleaved", 2, marks=pytest.mark.slow),
    ],
)
def test_executed_ticks_are_the_simulators(runs, mesh, name, virtual):
    _, state, step = runs(mesh, name, virtual)
    batch = data.batch(0, 0, BATCH, 32, 256)
    engine = step.executor.engine
    executed = engine.executed(state.params, batch)
    schedule = step.plan.execution.schedule
    ticks = simulate(schedule, Costs(F=virtual, B=virtual, W=virtual, BW=virtual)).ticks()
    codes = {"F": 1, "B": 2, "W": 3, "BW": 4}
    expected = np.array([[IDLE if a is None else codes[a.kind] for a in row] for row in ticks])
    np.testing.assert_array_equal(executed, expected)
    assert engine.program.actions() == [[str(a) if a else None for a in row] for row in ticks]
    # Each device's idle ticks inside its span are the lock-step simulation's idle time at one tick per action.
    lockstep = simulate_lockstep(schedule, Costs(F=virtual, B=virtual, W=virtual, BW=virtual))
    busy = [np.flatnonzero(column != IDLE) for column in executed.T]
    idle = [int(np.sum(column[b[0] : b[-1] + 1] == IDLE)) for column, b in zip(executed.T, busy, strict=True)]
    assert idle == [int(i) for i in lockstep.idle] and lockstep.makespan == len(executed)


@pytest.mark.parametrize("mesh,name,virtual", CASES)
def test_no_action_computes_a_forward_again(runs, mesh, name, virtual):
    # The zero-bubble papers' costs: B and W each about one forward, B + W one backward. B carries attention's
    # backward (its matmuls have no weights), so it is a little above one forward and W a little below.
    _, _, step = runs(mesh, name, virtual)
    batch = data.batch(0, 0, BATCH, 32, 256)
    flops = step.executor.engine.branch_flops(step.compile(batch).as_text())
    assert 0.8 <= flops["B"] / flops["F"] <= 1.25 and 1.8 <= flops["BW"] / flops["F"] <= 2.25, flops
    if any(a.kind == "W" for row in step.plan.execution.schedule.actions for a in row):
        assert 0.8 <= flops["W"] / flops["F"] <= 1.25, flops
    else:  # a schedule without W keeps nothing for one: its W branch is never taken and does nothing
        assert flops["W"] == 0, flops
    # What the slots keep (inputs, output gradients, residuals, what B hands W) at the schedule's peak, and
    # one tick's working set, is what the compiled program holds.
    report = spmd.report(step, batch)
    temp = report.compiled_memory["temp_bytes"] / report.analytic_memory["temp_bytes"]
    assert 0.8 <= temp <= 1.25, (temp, report.execution.figures["slot_parts"])


def test_a_pipeline_does_a_data_parallel_steps_matmul_work(runs):
    # On the average device (the loss on one stage in four), pp+dp's compiled matmul FLOPs are data
    # parallelism's over the same 8 devices, model and batch: nothing is computed twice.
    _, _, step = runs("stage4xdata2", "zb-h1", 1)
    batch = data.batch(0, 0, BATCH, 32, 256)
    dp = _train(strategies.data_parallel(), spmd.make_mesh({"data": 8}))[2]
    piped, plain = spmd.report(step, batch), spmd.report(dp, batch)
    assert 0.95 <= piped.compiled_flops / plain.compiled_flops <= 1.05, (piped.compiled_flops, plain.compiled_flops)
    # The cost model agrees: the layers' work split over the stages, the head's on one stage of four.
    assert piped.flops_per_device == pytest.approx(piped.compiled_flops, rel=0.05)


def test_offloaded_residuals_wait_in_host_slots_and_train_like_one_device(reference):
    # PipeOffload: what an offload remat policy offloads waits in host-memory slots between F and the backward.
    plan, mesh_axes = _pipeline_plan("stage4xdata2", "zb-h1", 1)
    offload = dataclasses.replace(plan, remat="offload:mlp_hidden,attn_out")
    run = _train(offload, spmd.make_mesh(mesh_axes))
    _assert_matches(run, reference)
    step, batch = run[2], data.batch(0, 0, BATCH, 32, 256)
    # The slot buffers, [slots + 1, layers of a stage, rows, ...], are host arrays in the traced step: mlp_hidden
    # [rows, seq, mlp] and attn_out [rows, seq, heads, head_dim] of one row of a microbatch per device.
    n = step.executor.engine.program.slots + 1
    text = str(step.trace(batch).jaxpr)
    assert f"f32<host>[{n},2,1,32,256]" in text and f"f32<host>[{n},2,1,32,4,16]" in text
    compiled = step.compile(batch)
    if jax.default_backend() == "cpu":  # the CPU backend lowers no memory spaces (see tests/test_remat.py)
        assert "S(5)" not in compiled.as_text()
    # The cost model: those bytes leave the device's slots for the host's; each F sends them, each B fetches
    # them (W reads only what B hands it), one tick's move at a time.
    per_layer = 4 * 32 * (256 + 64)  # mlp_hidden and attn_out of one row, float32
    parts = step.executor.summary(step.layout, batch).figures["slot_parts"]
    on_device = spmd.TrainStep(
        models.loss_fn(models.get("gpt-tiny", layers=LAYERS)),
        optax.sgd(0.1),
        dataclasses.replace(plan, remat="names:mlp_hidden,attn_out"),
        spmd.make_mesh(mesh_axes),
        params=step.model_params,
        staged=models.get("gpt-tiny", layers=LAYERS).staged,
    )
    kept = on_device.executor.summary(on_device.layout, batch).figures["slot_parts"]["kept"]
    assert parts["offloaded"] == 2 * per_layer and kept == parts["kept"] + parts["offloaded"]
    memory = spmd.report(step, batch).analytic_memory
    assert memory["host_activation_bytes"] == n * parts["offloaded"]
    assert memory["host_transfer_bytes"] == 2 * 8 * parts["offloaded"]  # 8 microbatches out and back


@pytest.mark.slow  # the nnx GPT; the default tier pipelines the linen one
def test_an_nnx_model_pipelines_like_its_unpipelined_self():
    assert models.get("gpt-tiny-nnx").kind == "nnx"  # its staged form runs its own nnx modules
    one_device = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    ref_losses, ref_state, ref_step = _train(spmd.Plan(), one_device, "gpt-tiny-nnx")
    plan, mesh_axes = _pipeline_plan("stage4xdata2", "1f1b", 1)
    _assert_matches(
        _train(plan, spmd.make_mesh(mesh_axes), "gpt-tiny-nnx"), (ref_losses, ref_step.params_of(ref_state))
    )


@pytest.mark.slow  # the default tier checks uneven stages through the CLI (tests/test_hetero.py)
def test_uneven_stages_train_like_the_unpipelined_model(runs, reference):
    run = runs("stage4xdata2", "1f1b", 1, (3, 3, 1, 1))
    _assert_matches(run, reference)
    _, state, step = run
    kernel = state.params["params"]["layers"]["mlp"]["wi"]["kernel"]
    assert kernel.shape[:3] == (4, 1, 3)  # padded to the longest stage; the padding never changes
    np.testing.assert_array_equal(np.asarray(kernel)[2:, 0, 1:], 0)
    assert step.executor.engine.placement.branches == (1, 3)


@pytest.mark.parametrize(
    "name,p,m,v",
    [("1f1b", 4, 8, 1), ("gpipe", 4, 8, 1), ("zb-h2", 4, 8, 1), ("bfs", 3, 4, 2), ("interleaved", 4, 8, 2)],
)
def test_input_slots_are_never_overwritten_while_needed(name, p, m, v):
    schedule = strategies.pipeline_schedule(name, stages=p, microbatches=m, virtual=v)
    program = tick_program(schedule, Placement(schedule, (1,) * (p * v)))
    col = {f: i for i, f in enumerate(FIELDS)}
    held = [{} for _ in range(p)]  # per device: slot -> the (microbatch, chunk) it holds
    for t, rows in enumerate(program.table):
        for d, row in enumerate(rows):
            kind, mb, chunk, slot, first = row[:5]
            if kind == IDLE:
                continue
            if kind == CODES["F"] and first:  # the first stage takes its slot with its own F
                assert slot not in held[d], (t, d, slot, held[d])
                held[d][slot] = (mb, chunk)
            assert held[d].get(slot) == (mb, chunk), (t, d, slot, held[d])
            if kind in (CODES["W"], CODES["BW"]):  # after its last backward the slot is free
                del held[d][slot]
        for d, row in enumerate(rows):  # results sent this tick, stored at its end
            for route, sender in (("up", (d - 1) % p), ("down", (d + 1) % p), ("self", d)):
                at = row[col[f"{route}_slot"]]
                if at < 0:
                    continue
                kind, mb, chunk = rows[sender][:3]
                stage = schedule.stage_of(sender, chunk)
                to = (
                    stage
                    if kind == CODES["F"] and stage == p * v - 1
                    else stage + 1
                    if kind == CODES["F"]
                    else stage - 1
                )
                got = schedule.where(to)
                assert got[0] == d and held[d].get(at, (mb, got[1])) == (mb, got[1]), (t, d, route, at)
                held[d][at] = (mb, got[1])
    assert all(not h for h in held)
    # A slot is taken when the input arrives, up to a tick before its F starts: never more than one above the
    # simulator's count of held microbatches.
    peak = max(simulate(schedule, Costs(F=v, B=v, W=v, BW=v)).peak_held)
    assert peak - 1 <= program.slots <= peak + 1, (program.slots, peak)


def test_report_counts_the_pipeline_exchanges(runs):
    _, _, step = runs("stage4xdata2", "zb-h1", 1)
    batch = data.batch(0, 0, BATCH, 32, 256)
    report = spmd.report(step, batch)
    assert report.execution.kind == "pipeline"
    pipeline = report.execution.figures
    comm = report.comm_bytes_per_step
    assert comm["compiled"] == pytest.approx(comm["analytic"], rel=0.01), report.collectives
    kinds = {(c.kind, c.axes): c for c in report.collectives}
    ticks = pipeline["ticks"]
    assert kinds["collective-permute", ("stage",)].count == 2 * ticks
    # Data parallelism inside the pipeline reduces the stage's gradients once per step, not once per W.
    assert kinds["all-reduce", ("data",)].count == 1
    assert pipeline["bubble_fraction"] == pytest.approx(3 / 27) and pipeline["slots"] >= 4
    # The modelled step runs in lock-step: 27 ticks for 24 actions (F = B = W, as the executor's cost alike).
    assert pipeline["lockstep_makespan"] == 27 and pipeline["lockstep_bubble_fraction"] == pytest.approx(3 / 27)
    workload = costmodel.Workload(batch=BATCH, seq_len=32)
    assert step.executor.costs(step.layout, batch, workload).compute_factor == pytest.approx(27 / 24)
    assert "pipeline: zb-h1 on 4 stages" in str(report)


def test_report_counts_fsdp_inside_the_stages():
    # FSDP stays automatic inside the stages: every action gathers its chunk's layers afresh (no action keeps
    # them: a slot holds activations only) and every W or BW reduces their gradient.
    mesh_axes = {"stage": 4, "fsdp": 2}
    plan = strategies.from_names("pp+fsdp", mesh_axes, pipeline_options=strategies.PipelineOptions("1f1b", 4))
    model = models.get("gpt-tiny", layers=LAYERS, remat=plan.remat)
    params = jax.eval_shape(model.init, jax.random.key(0))
    mesh = spmd.make_mesh(mesh_axes)
    step = spmd.TrainStep(models.loss_fn(model), optax.sgd(0.1), plan, mesh, params=params, staged=model.staged)
    report = spmd.report(step, data.batch(0, 0, BATCH, 32, 256))
    assert report.execution.kind == "pipeline"
    pipeline = report.execution.figures
    assert step.executor.engine.weight_uses() == (8.0, 4.0)  # 4 F and 4 BW per device
    compiled = {(c.kind, c.axes): c for c in report.collectives}
    analytic = {(t.kind, t.axes): t for t in report.analytic_collectives}
    # One device's chunks of the FSDP-split layers, gathered.
    stack = sum(r.bytes_per_device * 2 for r in report.params if r.names and r.names[0] == "stage" and "fsdp" in r.spec)
    assert compiled["reduce-scatter", ("fsdp",)].bytes == 4 * stack
    gathers = compiled["all-gather", ("fsdp",)].bytes
    assert 8 * stack <= gathers <= 1.1 * 8 * stack
    assert gathers == pytest.approx(analytic["all-gather", ("fsdp",)].bytes, rel=0.05)
    # Stage inputs are split over fsdp too, as the model lays out activations: half of a microbatch's each.
    permutes = compiled["collective-permute", ("stage",)]
    assert (
        permutes.bytes
        == analytic["collective-permute", ("stage",)].bytes
        == 2 * pipeline["ticks"] * pipeline["slot_bytes"]
    )
    assert pipeline["slot_bytes"] == (BATCH // 4) * 32 * 64 * 4 // 2
    comm = report.comm_bytes_per_step
    assert comm["compiled"] == pytest.approx(comm["analytic"], rel=0.1)
    assert not [w for w in report.warnings if w.startswith("collective traffic")]
    # Memory: every slot (the spare one too) with what it keeps, and one tick's working set: about twice what a
    # chunk's backward uses, and the chunk's gathered layers with their gradient.
    parts = pipeline["slot_parts"]
    gathered = costmodel.pipeline_gathered_bytes(step.layout.params.leaves, plan, mesh_axes)
    assert gathered == 2 * stack and parts["carried"] == 0 and parts["kept"] > 10 * parts["inputs"]
    slots = (pipeline["slots"] + 1) * sum(parts.values())
    assert slots + gathered + 2 * parts["kept"] < report.analytic_memory["activation_bytes"]
    assert 0.8 <= report.compiled_memory["temp_bytes"] / report.analytic_memory["temp_bytes"] <= 1.25


def test_w_gathers_only_the_weights_it_reads_and_two_stages_exchange_once_a_tick():
    # A matmul's weight gradient needs its input and output cotangent, not the weight: under FSDP, W gathers
    # only what its own equations read. On two stages both rings are one pair: one exchange per tick.
    mesh_axes = {"stage": 2, "fsdp": 4}
    plan = strategies.from_names("pp+fsdp", mesh_axes, pipeline_options=strategies.PipelineOptions("zb-h1", 4))
    model = models.get("gpt-tiny", layers=LAYERS, remat=plan.remat)
    params = jax.eval_shape(model.init, jax.random.key(0))
    step = spmd.TrainStep(
        models.loss_fn(model), optax.sgd(0.1), plan, spmd.make_mesh(mesh_axes), params=params, staged=model.staged
    )
    report = spmd.report(step, data.batch(0, 0, BATCH, 32, 256))
    compiled = {(c.kind, c.axes): c for c in report.collectives}
    analytic = {(t.kind, t.axes): t for t in report.analytic_collectives}
    stack = sum(r.bytes_per_device * 4 for r in report.params if r.names and r.names[0] == "stage" and "fsdp" in r.spec)
    gathers = compiled["all-gather", ("fsdp",)].bytes
    assert 8 * stack <= gathers < 10 * stack  # 4 F and 4 B gather all, 4 W a little (12 · stack if W did too)
    assert gathers == pytest.approx(analytic["all-gather", ("fsdp",)].bytes, rel=0.05)
    ticks = report.execution.figures["ticks"]
    assert compiled["collective-permute", ("stage",)].count == analytic["collective-permute", ("stage",)].count == ticks


def test_cli_run_pipelined_check(capsys):
    code, out, _ = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--mesh", "stage=4,data=2", "--strategy", "pp+dp", "--schedule",
        "zb-h1", "--microbatches", "8", "--batch-size", "32", "--steps", "2", "--check", "--json",
    )  # fmt: skip
    j = json.loads(out)
    assert code == 0 and len(j["losses"]) == 2 and j["max_abs_diff"] <= 1e-4


@pytest.mark.parametrize(
    "args,message",
    [
        (["--mesh", "data=8", "--strategy", "pp+dp"], r"strategy pp puts pipeline stages on mesh axis 'stage'"),
        (["--mesh", "stage=4,data=2", "--strategy", "pp", "--model", "mlp"], r"model 'mlp' cannot be pipelined"),
        (["--mesh", "stage=4,data=2", "--strategy", "pp", "--layers", "6"], r"6 layers do not split evenly over 4"),
        (
            ["--mesh", "stage=4,data=2", "--strategy", "pp", "--layers-per-stage", "3,3,1"],
            r"layers per stage \[3, 3, 1\] must be 4 non-negative counts summing to the model's 8 layers",
        ),
        (
            ["--mesh", "stage=4,data=2", "--strategy", "pp+dp", "--microbatches", "8", "--batch-size", "12"],
            r"batch of 12 rows cannot be split into 8 microbatches",
        ),
        (["--mesh", "stage=4,data=2", "--strategy", "pp", "--virtual", "2"], r"for --virtual 2 use interleaved or bfs"),
        (["--mesh", "stage=4,data=2", "--strategy", "pp", "--layers-per-stage", "a"], r"give one count per global"),
    ],
)
def test_cli_pipeline_mistakes(capsys, args, message):
    import re

    code, _, err = run_cli(capsys, "plan", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_api_mistakes():
    model = models.get("gpt-tiny")
    plan = strategies.pipeline("1f1b", stages=4, microbatches=4)
    params = jax.eval_shape(model.init, jax.random.key(0))
    with pytest.raises(spmd.PlanError, match="pass staged=model.staged"):
        spmd.TrainStep(
            models.loss_fn(model), optax.sgd(0.1), plan, spmd.make_mesh({"stage": 4, "data": 2}), params=params
        )
    with pytest.raises(ScheduleError, match="schedule 1f1b is for 4 stages but mesh axis 'stage' has 2 devices"):
        spmd.TrainStep(
            models.loss_fn(model),
            optax.sgd(0.1),
            plan,
            spmd.make_mesh({"stage": 2, "data": 4}),
            params=params,
            staged=model.staged,
        )
    with pytest.raises(spmd.PlanError, match="two pipeline parts"):
        plan + strategies.pipeline("gpipe", stages=4, microbatches=4)
