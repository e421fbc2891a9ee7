"""Heterogeneous meshes: shares and stages from device profiles, uneven data parallelism that really loops
differently per device and still equals one device, the modelled speedup, and the command line."""

import json
import re

import jax
import numpy as np
import optax
import pytest

import spmd
from spmd import costmodel, data, models
from spmd.devices import Profile
from spmd.execution import Shares
from strategies import hetero
from tests.conftest import run_checked, run_cli, train_steps


def test_acceptance_shares_follow_the_speeds():
    shares = hetero.batch_shares(56, Profile.from_speeds([3, 3, 1, 1, 1, 1, 2, 2]), {"data": 8})
    assert shares == (12, 12, 4, 4, 4, 4, 8, 8)


@pytest.mark.parametrize("seed", range(6))
def test_shares_stay_within_five_percent_of_proportional(seed):
    rng = np.random.default_rng(seed)
    speeds = rng.uniform(0.5, 4.0, size=rng.integers(2, 9)).round(2)
    batch = int(rng.integers(400, 2000))
    shares = hetero.proportional_split(batch, speeds)
    exact = batch * speeds / speeds.sum()
    assert sum(shares) == batch and all(isinstance(s, int) for s in shares)
    assert np.all(np.abs(np.array(shares) - exact) <= 1)  # the largest remainders: within one example
    np.testing.assert_array_less(np.abs(np.array(shares) - exact), 0.05 * exact)


def test_memory_caps_take_work_from_a_fast_device_with_little_memory():
    speeds = [4, 1, 1, 1, 1]
    fast = hetero.batch_shares(40, Profile.from_speeds(speeds), {"data": 5})
    assert fast == (20, 5, 5, 5, 5)
    # Device 0 holds the model state (1000 bytes) plus 6 examples of 100 bytes; the others have room for 20.
    small = Profile.from_speeds(speeds, memory=[1600, 3000, 3000, 3000, 3000])
    capped = hetero.batch_shares(40, small, {"data": 5}, state_bytes=1000, example_bytes=100)
    assert capped == (6, 9, 9, 8, 8) and sum(capped) == 40
    with pytest.raises(ValueError, match=r"cannot place 40 units: the caps \[6, 6, 6, 6, 6\] hold only 30 in all"):
        hetero.batch_shares(40, small.reordered([0, 0, 0, 0, 0]), {"data": 5}, state_bytes=1000, example_bytes=100)
    with pytest.raises(ValueError, match=r"data position 0 \(device 0\) has 1.6 KiB .* state alone needs 4.9 KiB"):
        hetero.batch_shares(40, small, {"data": 5}, state_bytes=5000, example_bytes=100)


def test_a_profile_that_leaves_a_device_without_work_is_refused_naming_it(capsys):
    """Speeds 100:1 over a batch of 16 would give data positions 2 to 7 nothing: refused, naming the first
    and the batch that gives every position a microbatch."""
    with pytest.raises(ValueError, match=r"data position 1 \(devices 2, 3\) gets none .* at least 6\b"):
        hetero.batch_shares(2, Profile.from_speeds([5, 5, 1, 1]), {"data": 2, "tensor": 2})
    code, _, err = run_cli(
        capsys, "plan", "--model", "gpt-tiny", "--mesh", "data=8", "--strategy", "dp", "--batch-size", "16",
        "--device-speeds", "100,1,1,1,1,1,1,1",
    )  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "data position 2 (device 2) gets none of the batch of 16" in err and "at least 107" in err


@pytest.mark.parametrize("speeds", [[2, 2, 2, 2, 1, 1, 1, 1], [3, 3, 3, 3, 1, 1, 1, 1], [4, 4, 2, 2, 2, 1, 1, 1]])
def test_modelled_speedup_reaches_the_ideal_when_compute_bound(speeds):
    shares = hetero.batch_shares(512, Profile.from_speeds(speeds), {"data": 8})
    t = hetero.modelled_step_times(1.0, speeds, shares)
    assert t["ideal"] == pytest.approx(sum(speeds) / (8 * min(speeds)))
    assert 0.97 * t["ideal"] <= t["speedup"] <= t["ideal"] + 1e-9


def test_stage_layers_and_kind_order():
    assert hetero.stage_layers(8, Profile.from_speeds([3, 3, 3, 3, 1, 1, 1, 1]), {"stage": 4, "data": 2}) == (
        3,
        3,
        1,
        1,
    )
    # Kinds interleaved in device order: reordered so each tensor pair is one kind.
    profile = Profile.from_speeds([2, 1] * 4, kinds=["h100", "a100"] * 4)
    order = hetero.kind_order(profile, {"data": 4, "tensor": 2})
    pairs = np.array([profile.kinds[i] for i in order]).reshape(4, 2)
    assert all(len(set(pair)) == 1 for pair in pairs)


def test_uneven_data_parallel_loops_differently_and_equals_one_device():
    model = models.get("gpt-tiny", layers=2)
    shares = (12, 12, 4, 4, 4, 4, 8, 8)
    plan = hetero.uneven_data_parallel(shares)
    params = jax.eval_shape(model.init, jax.random.key(0))
    step = spmd.TrainStep(
        models.loss_fn(model), optax.sgd(0.1, momentum=0.9), plan, spmd.make_mesh({"data": 8}), params=params
    )
    state = step.init(model.init, jax.random.key(0))
    batch = data.batch(0, 0, 56, model.config.seq_len, model.config.vocab)
    # Read from the executed program: the iterations each device's loop ran.
    np.testing.assert_array_equal(step.executor.engine.executed_loops(state.params, batch), [3, 3, 1, 1, 1, 1, 2, 2])
    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    ref = spmd.TrainStep(models.loss_fn(model), optax.sgd(0.1, momentum=0.9), spmd.Plan(), one, params=params)
    ref_state = ref.init(model.init, jax.random.key(0))
    for i in range(2):
        batch = data.batch(0, i, 56, model.config.seq_len, model.config.vocab)
        state, loss = step(state, batch)
        ref_state, ref_loss = ref(ref_state, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"the batch has 48 examples but the shares .* add up to 56"):
        step.executor.engine.value_and_grad(state.params, data.batch(0, 0, 48, 32, 256))


def test_cli_run_uneven_data_parallel_checked(capsys):
    code, out, _ = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--mesh", "data=8", "--strategy", "dp", "--device-speeds",
        "3,3,1,1,1,1,2,2", "--batch-size", "56", "--steps", "2", "--check", "--json",
    )  # fmt: skip
    j = json.loads(out)
    assert code == 0 and j["batch_shares"] == [12, 12, 4, 4, 4, 4, 8, 8] and j["max_abs_diff"] <= 1e-4


@pytest.mark.parametrize(
    ("mesh", "speeds", "shares"),
    [
        ("data=4,fsdp=2", "3,3,1,1,1,1,2,2", [24, 8, 8, 16]),
        pytest.param("data=2,fsdp=4", "2,2,2,2,1,1,1,1", [36, 20], marks=pytest.mark.slow),
    ],
)
def test_cli_run_uneven_shares_inside_fsdp_checked(capsys, mesh, speeds, shares):
    """Shares by speed per data rank, each rank's microbatches split over its fsdp devices, the parameters
    gathered over fsdp at every iteration of a rank's own loop: equal to one device."""
    args = ("--model", "gpt-tiny", "--mesh", mesh, "--strategy", "dp+fsdp", "--device-speeds", speeds,
            "--batch-size", "56", "--json")  # fmt: skip
    code, out, err = run_cli(capsys, "run", *args, "--steps", "2", "--check")
    j = json.loads(out)
    assert code == 0 and j["batch_shares"] == shares and j["max_abs_diff"] <= 1e-4, err


def test_uneven_fsdp_traffic_and_work_are_the_busiest_ranks(capsys):
    """The compiled program's counts weigh the loop by the busiest rank's iterations: its FSDP gathers and
    reduce-scatters are the cost model's (one per iteration), its matmul FLOPs its share over the even one."""
    code, out, err = run_cli(
        capsys, "plan", "--model", "gpt-tiny", "--layers", "2", "--mesh", "data=4,fsdp=2", "--strategy", "dp+fsdp",
        "--device-speeds", "3,3,1,1,1,1,2,2", "--batch-size", "56", "--json",
    )  # fmt: skip
    assert code == 0, err
    j = json.loads(out)
    over_fsdp = lambda rows: sum(c["traffic_bytes"] for c in rows if c["axes"] == ["fsdp"])  # noqa: E731
    assert over_fsdp(j["collectives"]) == pytest.approx(over_fsdp(j["analytic_collectives"]), rel=0.1)
    # The busiest rank takes 24 of the 56 examples, the even split 14.
    assert j["compiled_flops_per_device"] == pytest.approx(j["flops_per_device"] * 24 / 14, rel=0.02)
    # Each rank's own loop: its compiled FLOPs follow its share.
    by_rank = np.array(j["compiled_flops_by_position"])
    np.testing.assert_allclose(by_rank / by_rank[0], np.array([24, 8, 8, 16]) / 24, rtol=0.02)


def test_cli_run_uneven_pipeline_stages_checked(capsys):
    code, out, _ = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--mesh", "stage=4,data=2", "--strategy", "pp+dp", "--device-speeds",
        "3,3,3,3,1,1,1,1", "--microbatches", "8", "--batch-size", "16", "--steps", "2", "--check", "--json",
    )  # fmt: skip
    j = json.loads(out)
    assert code == 0 and j["layers_per_stage"] == [3, 3, 1, 1] and j["max_abs_diff"] <= 1e-4


def test_a_pipelines_data_positions_run_their_own_microbatches_and_equal_one_device():
    """Speeds 3:1:1:2 along data, the same on both stages: each data position runs its own 1F1B with
    microbatches by its speed (7, 2, 2, 5 of one size), read back from the executed program, and two steps
    equal one device's."""
    import strategies

    model = models.get("gpt-tiny", layers=2)
    params = jax.eval_shape(model.init, jax.random.key(0))
    sizes = {"stage": 2, "data": 4}
    plan = strategies.pipeline("1f1b", stages=2, microbatches=4) + strategies.data_parallel()
    plan = hetero.apply_profile(
        plan, sizes, Profile.from_speeds([3, 1, 1, 2] * 2), params=params, workload=costmodel.Workload(32, 32),
        optimizer=optax.sgd(0.1),
    )  # fmt: skip
    assert plan.execution.rank_microbatches == (7, 2, 2, 5) and plan.execution.layers_per_stage == (1, 1)
    losses, state, step = train_steps(model, plan, spmd.make_mesh(sizes), steps=2, batch_size=32)
    codes = step.executor.engine.executed(state.params, data.batch(0, 0, 32, model.config.seq_len, 256))
    # [tick, data position, stage device]: every stage device of a position runs its microbatches' F once.
    np.testing.assert_array_equal((codes == 1).sum(axis=0), [[7, 7], [2, 2], [2, 2], [5, 5]])
    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    ref_losses, ref_state, ref = train_steps(model, spmd.Plan(), one, steps=2, batch_size=32)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(step.params_of(state)), jax.tree.leaves(ref.params_of(ref_state)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"a batch of 24 rows does not split into 16"):
        step.executor.engine.value_and_grad(state.params, data.batch(0, 0, 24, 32, 256))


@pytest.mark.parametrize(
    ("mesh", "strategy", "speeds", "counts"),
    [
        # The API test above checks this mesh in the default tier.
        pytest.param("stage=2,data=4", "pp+dp", "3,1,1,2,3,1,1,2", [7, 2, 2, 5], marks=pytest.mark.slow),
        pytest.param("stage=2,data=2,tensor=2", "pp+dp+tp", "2,2,1,1,2,2,1,1", [5, 3], marks=pytest.mark.slow),
        pytest.param("stage=2,data=2,fsdp=2", "pp+dp+fsdp", "3,3,1,1,3,3,1,1", [6, 2], marks=pytest.mark.slow),
    ],
)
def test_cli_run_a_pipelines_data_positions_by_speed_checked(capsys, mesh, strategy, speeds, counts):
    """Microbatches per data position by its speed (tensor or FSDP groups inside each position): the
    pipeline keeps the devices in the order given, and trains equal to one device."""
    j = run_checked(capsys, mesh, strategy, speeds, 32)
    assert j["rank_microbatches"] == counts and j["max_abs_diff"] <= 1e-4


def test_a_pipeline_data_position_without_a_microbatch_is_refused_naming_it(capsys):
    code, _, err = run_cli(
        capsys, "plan", "--model", "gpt-tiny", "--mesh", "stage=2,data=4", "--strategy", "pp+dp",
        "--device-speeds", "9,1,1,1,9,1,1,1", "--microbatches", "1", "--batch-size", "16",
    )  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "data position 2 (devices 2, 6) gets no microbatch" in err and "--microbatches 3" in err
    table = spmd.pipeline.Schedule("mine", 1, (("F0", "BW0"), ("F0", "BW0")))
    with pytest.raises(ValueError, match="the table 'mine' fixes its microbatches"):
        hetero.rank_microbatches(table, Profile.from_speeds([2, 1] * 2), {"stage": 2, "data": 2})


def test_data_schedules_must_be_the_plans_schedule_and_loop_chunks_are_priced():
    """A position's schedule of another kind would leave the program without its W slots: refused. An
    interleaved pipeline (even layers, chunks looping over the stages) with data schedules is priced."""
    import strategies
    from strategies.pipeline import pipeline_schedule

    spec = strategies.pipeline("1f1b", stages=2, microbatches=2).execution
    other = (pipeline_schedule("zb-h1", stages=2, microbatches=3), pipeline_schedule("1f1b", stages=2, microbatches=1))
    with pytest.raises(ValueError, match=r"position 0 is zb-h1 .* the plan's 1f1b"):
        spmd.execution.PipelineSpec("stage", spec.schedule, data_schedules=other)
    with pytest.raises(ValueError, match="data_schedules is empty"):
        spmd.execution.PipelineSpec("stage", spec.schedule, data_schedules=())
    sizes, profile = {"stage": 2, "data": 2}, Profile.from_speeds([2, 1] * 2)
    plan = strategies.pipeline("interleaved", stages=2, microbatches=4, virtual=2) + strategies.data_parallel()
    model = models.get("gpt-tiny", layers=4)
    params = jax.eval_shape(model.init, jax.random.key(0))
    plan = hetero.apply_profile(
        plan, sizes, profile, params=params, workload=costmodel.Workload(32, 32), optimizer=optax.sgd(0.1)
    )
    assert plan.execution.rank_microbatches == (6, 2) and plan.execution.layers_per_stage is None
    step = costmodel.StepTime(compute_s=1.0, comm_s=0.0, hardware="cpu")
    s = hetero.summary(plan, sizes, profile, 32, 1e9, step)
    assert s["rank_microbatches"] == [6, 2] and 1 < s["simulated_speedup"] <= s["ideal_speedup"] == 1.5


def test_data_positions_need_the_parameters_whole_over_data_and_a_data_axis(capsys):
    """Data positions of different speeds run their own schedules with the parameters whole along data: a
    plan splitting them over it (pp+zero3) is refused with one line naming an array it splits, through the API
    and the command line; a spec whose data axis is not on the mesh, or a program manual over other axes too,
    are refused by the engine, each with its own fix."""
    import strategies
    from spmd._pipeline import Pipeline, pipeline_executor
    from spmd._positions import DataPositions
    from spmd.execution import Task
    from strategies.pipeline import pipeline_schedule

    model = models.get("gpt-tiny", layers=2)
    params = jax.eval_shape(model.init, jax.random.key(0))
    sizes, profile = {"stage": 2, "data": 4}, Profile.from_speeds([3, 1, 1, 2] * 2)
    zero3 = strategies.pipeline("1f1b", stages=2, microbatches=4) + strategies.zero3()
    with pytest.raises(ValueError, match=r"splits params/\S+ over 'data' \(ZeRO-3 or FSDP over data\)"):
        hetero.apply_profile(
            zero3, sizes, profile, params=params, workload=costmodel.Workload(32, 32), optimizer=optax.sgd(0.1)
        )
    code, _, err = run_cli(
        capsys, "plan", "--model", "gpt-tiny", "--mesh", "stage=2,data=4", "--strategy", "pp+zero3",
        "--device-speeds", "3,1,1,2,3,1,1,2", "--batch-size", "32",
    )  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1 and "over an axis of their own" in err, err
    # The same spec by hand: the executor's engine refuses the program, naming the cause.
    schedules = tuple(pipeline_schedule("1f1b", stages=2, microbatches=m) for m in (7, 2, 2, 5))
    spec = spmd.execution.PipelineSpec("stage", zero3.execution.schedule, data_schedules=schedules)
    task = Task(None, spmd.Plan(batch_axes=zero3.batch_axes, parts=zero3.parts, execution=spec),
                spmd.make_mesh(sizes), params, staged=model.staged)  # fmt: skip
    with pytest.raises(
        spmd.PlanError,
        match="needs 'data' to split the batch and the parameters whole along it, and the plan splits them",
    ):
        pipeline_executor(spec, task)
    with pytest.raises(spmd.PlanError, match=r"also split over \['fsdp'\]"):
        Pipeline(None, spec, spmd.make_mesh(sizes), layers=2, data_axes=("data", "fsdp"))
    with pytest.raises(spmd.PlanError, match="the mesh has no axis 'data'"):
        Pipeline(None, spec, spmd.make_mesh({"stage": 2, "fsdp": 4}), layers=2)
    # The executed program's ticks and slots are the longest position's, padded; the figures say so.
    engine = Pipeline(None, spec, spmd.make_mesh(sizes), layers=2, data_axes=("data",))
    assert isinstance(engine.positions, DataPositions)
    figures = engine.figures()
    assert figures["ticks"] == engine.positions.table().shape[1] == engine.positions.ticks
    assert figures["slots"] == max(p.slots for p in engine.positions.programs)


def test_a_pipeline_keeps_the_order_given_unless_its_inner_groups_mix_kinds():
    """Devices of one kind together for plans other than pipelines; a pipeline keeps the order given where its
    tensor groups are of one kind, and otherwise gives each data position devices of one kind. One axis, or
    one kind, keeps the order given."""
    order_of = hetero.device_order
    sizes = {"stage": 2, "data": 2, "tensor": 2}
    kept = Profile.from_speeds([2, 2, 1, 1, 2, 2, 1, 1])  # each tensor pair one kind already
    assert order_of(kept, sizes, pipelined=True) == tuple(range(8))
    mixed = Profile.from_speeds([2, 1, 2, 1, 2, 1, 2, 1])  # every tensor pair mixes the kinds
    order = order_of(mixed, sizes, pipelined=True)
    grid = np.array(mixed.reordered(order).speeds).reshape(2, 2, 2)
    assert all(len(set(grid[:, d].ravel())) == 1 for d in range(2)), grid  # one kind per data position
    assert order_of(mixed, {"stage": 2, "data": 4}, pipelined=True) == tuple(range(8))  # no inner groups
    assert order_of(mixed, sizes, pipelined=False) == hetero.kind_order(mixed, sizes) != tuple(range(8))
    assert order_of(mixed, {"data": 8}) == order_of(Profile.from_speeds([1] * 8), sizes) == tuple(range(8))
    with pytest.raises(ValueError, match="outer='dta' is not an axis of the mesh"):
        hetero.kind_order(mixed, sizes, outer="dta")


def test_the_planner_prices_the_devices_in_the_order_a_run_lays_them_out():
    """On data=4 × tensor=2 with the kinds alternating, spmd run puts each tensor pair on one kind: the planner
    prices that layout (batch shares by kind, tensor units even), not mixed pairs with uneven units."""
    from strategies import suggest

    params = jax.eval_shape(models.get("gpt-tiny").init, jax.random.key(0))
    ranked, _ = suggest.rank(
        params, costmodel.Workload(64, 32), costmodel.HARDWARE["h100"], devices=8, memory_per_device=1 << 34,
        optimizer=optax.adam(1e-3), max_tensor=2, remats=(), profile=Profile.from_speeds([2, 1] * 4),
    )  # fmt: skip
    tp = next(s for s in ranked if s.strategy == "dp+tp" and s.mesh == {"data": 4, "tensor": 2} and s.plan.execution)
    assert isinstance(tp.plan.execution, Shares) and tp.plan.execution.shares == (21, 21, 11, 11)


@pytest.mark.slow  # shares and their caps are checked through the API in the default tier
def test_cli_plan_json_and_memory(capsys, tmp_path):
    args = ["plan", "--model", "gpt-tiny", "--mesh", "data=8", "--strategy", "dp", "--batch-size", "56", "--json"]
    code, out, _ = run_cli(capsys, *args, "--device-speeds", "3,3,1,1,1,1,2,2")
    j = json.loads(out)
    assert code == 0 and j["batch_shares"] == [12, 12, 4, 4, 4, 4, 8, 8] and sum(j["batch_shares"]) == 56
    assert j["ideal_speedup"] == pytest.approx(14 / 8)
    assert set(j["simulated_step_time"]) == {"even", "hetero"} and 1 < j["simulated_speedup"] <= j["ideal_speedup"]
    # The same speeds with a small memory on device 0: it takes fewer examples than its equally fast twin.
    profile = {"devices": [{"kind": "fast", "speed": 3, "memory": "8MiB"}, {"kind": "fast", "speed": 3}]}
    profile["devices"] += [{"kind": "slow", "speed": s} for s in (1, 1, 1, 1, 2, 2)]
    (tmp_path / "p.json").write_text(json.dumps(profile))
    code, out, _ = run_cli(capsys, *args, "--device-profile", str(tmp_path / "p.json"))
    shares = json.loads(out)["batch_shares"]
    assert code == 0 and sum(shares) == 56 and shares[0] < shares[1]
    # A device with a slow link on the data axis paces its all-reduces: the modelled communication is the
    # analytic traffic over that link's bandwidth, and the uneven plan's step time includes it.
    profile["devices"][5]["bandwidth"] = {"data": 1e8}
    (tmp_path / "p.json").write_text(json.dumps(profile))
    code, out, _ = run_cli(capsys, *args, "--device-profile", str(tmp_path / "p.json"))
    j = json.loads(out)
    latency = costmodel.HARDWARE["cpu"].ici_latency
    expected = sum(t["traffic_bytes"] / 1e8 + t["count"] * latency for t in j["analytic_collectives"])
    assert code == 0 and j["modelled_step_time"]["comm_s"] == pytest.approx(expected, rel=1e-6) and expected > 0
    assert j["simulated_step_time"]["hetero"] > expected
    # --even keeps the homogeneous split and prices it against the profile: no speedup.
    code, out, _ = run_cli(capsys, *args, "--device-speeds", "3,3,1,1,1,1,2,2", "--even")
    j = json.loads(out)
    assert j["batch_shares"] is None and j["simulated_speedup"] == pytest.approx(1.0)


def test_cli_profile_measures_devices(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "profile", "--size", "64", "--out", str(tmp_path / "p.json"))
    j = json.loads(out)
    assert code == 0 and len(j["devices"]) == 8 and all(d["speed"] > 0 for d in j["devices"])
    assert Profile.load(str(tmp_path / "p.json")).speeds == tuple(float(d["speed"]) for d in j["devices"])


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--device-speeds", "3,3,1"], r"3 devices given but the mesh has 8"),
        (["--device-speeds", "3,x,1,1,1,1,1,1"], r"--device-speeds '3,x,1,1,1,1,1,1': give one positive number"),
        (["--device-speeds", "1,1,1,1,1,1,1,1", "--device-profile", "p.json"], r"either --device-profile or"),
        (["--device-profile", "missing.json"], r"--device-profile 'missing.json': no such file"),
        (["--device-memory", "1KiB", "--device-speeds", "2,1,1,1,1,1,1,1"], r"the model state alone needs"),
        (["--device-speeds", "2,1,1,1,1,1,1,1", "--strategy", "fsdp", "--mesh", "fsdp=8"], r"needs a data axis"),
        (["--device-speeds", "2,1,1,1,1,1,1,1", "--microbatch", "3"], r"batch of 40 cannot be split into micro"),
    ],
)
def test_cli_profile_mistakes(capsys, extra, message):
    code, _, err = run_cli(capsys, "plan", "--model", "gpt-tiny", "--mesh", "data=8", "--batch-size", "40", *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_suggest_ranks_plans_by_their_step_on_the_profiles_devices(capsys):
    """With a profile, every data-parallel composition takes shares by its ranks' speeds and is ranked by its
    modelled step on those devices: the uneven split beats the even one, which the slowest device paces, and
    the pick's run command names the devices it was priced on."""
    from strategies import suggest

    model = models.get("gpt-small", layers=2)
    params = jax.eval_shape(model.init, jax.random.key(0))
    speeds = [3, 3, 1, 1, 1, 1, 2, 2]
    options = {"devices": 8, "memory_per_device": 80 << 30, "optimizer": optax.adam(1e-3), "max_tensor": 2}
    workload, h100 = costmodel.Workload(56, model.config.seq_len), costmodel.HARDWARE["h100"]
    ranked, _ = suggest.rank(params, workload, h100, **options, profile=Profile.from_speeds(speeds))
    even, _ = suggest.rank(params, workload, h100, **options)
    best = ranked[0]
    assert best.mesh == {"data": 8} and best.plan.execution.shares == (12, 12, 4, 4, 4, 4, 8, 8)
    plain = next(s for s in even if s.mesh == {"data": 8} and s.strategy == "dp" and not s.flags)
    t = plain.estimate.time  # modelled at the fastest device's speed
    assert best.step_s < t.compute_s * 3 + t.comm_s  # even, every device waits for the slowest (1/3 as fast)
    # Shares by speed: the compute of the whole batch at the devices' summed speed, Σs = 14 of the 8 · 3 fastest.
    assert best.step_s == pytest.approx(t.compute_s * 8 * 3 / sum(speeds) + t.comm_s, rel=0.01)

    code, out, err = run_cli(
        capsys, "suggest", "--model", "gpt-tiny", "--layers", "1", "--device-speeds", ",".join(map(str, speeds)),
        "--batch-size", "56", "--memory-per-device", "1GiB", "--confirm", "1", "--max-tensor", "1",
        "--max-context", "1",
    )  # fmt: skip
    assert code == 0 and "--device-speeds 3,3,1,1,1,1,2,2" in out.replace("\n", " "), out + err
