"""The planner searches pipelines: a stage axis of each size, each schedule and microbatch count asked for, priced
by the pipeline executor (its bubble, sends and slots), and on a device profile with layers per stage by speed."""

import jax
import jax.numpy as jnp
import optax
import pytest

import spmd
import strategies
from spmd import costmodel, models
from spmd.devices import Profile
from spmd.pipeline import simulate_lockstep
from strategies import suggest
from tests.test_bad_input import one_error_line

MODEL = models.get("gpt-tiny")
PARAMS = jax.eval_shape(MODEL.init, jax.random.key(0))
WORKLOAD = costmodel.Workload(64, MODEL.config.seq_len)
BATCH = {"tokens": jax.ShapeDtypeStruct((64, MODEL.config.seq_len), jnp.int32)}
OPTIMIZER = optax.adam(1e-3)


def price(mesh_axes, plan):
    """What suggest's command line prices a pipeline by: the executor of a step built for it."""
    step = spmd.TrainStep(
        models.loss_fn(MODEL), OPTIMIZER, plan, spmd.make_mesh(mesh_axes), params=PARAMS, staged=MODEL.staged
    )
    return step.layout, step.executor.costs(step.layout, BATCH, WORKLOAD)


def ranked_pipelines(profile=None, per_stage=(2, 4)):
    options = {"devices": 8, "memory_per_device": 1 << 40, "optimizer": OPTIMIZER, "max_tensor": 1}
    ranked, skipped = suggest.rank(
        PARAMS, WORKLOAD, costmodel.HARDWARE["h100"], **options, stages=(2,), schedules=("1f1b", "zb-h1"),
        microbatches_per_stage=per_stage, profile=profile, price=price, remats=(), accumulations=(1,),
    )  # fmt: skip
    assert not skipped, skipped
    return [s for s in ranked if "stage" in s.mesh]


def test_the_planner_prices_each_schedule_and_microbatch_count_by_the_executors_bubble():
    found = {(s.strategy, tuple(s.mesh), s.flags): s for s in ranked_pipelines()}
    zb, eight = ("--schedule", "zb-h1"), ("--microbatches", "8")
    meshes = {"pp+dp": [("stage", "data"), ("data", "stage")], "pp+dp+fsdp": [("stage", "data", "fsdp")]}
    meshes["pp+dp+fsdp"].append(("data", "stage", "fsdp"))  # the stage axis outermost, or inside data
    tried = {(), zb, eight, zb + eight}
    assert set(found) == {(s, m, f) for s, ms in meshes.items() for m in ms for f in tried}
    factors = {}
    for (strategy, _, flags), s in found.items():
        spec = s.plan.execution
        # The run line's flags ask for the plan that was priced.
        schedule = flags[flags.index("--schedule") + 1] if "--schedule" in flags else "1f1b"
        microbatches = int(flags[flags.index("--microbatches") + 1]) if "--microbatches" in flags else 4
        options = strategies.PipelineOptions(schedule, microbatches)
        asked = strategies.from_names(strategy, s.mesh, pipeline_options=options)
        assert spec.schedule == asked.execution.schedule and s.to_dict()["schedule"] == schedule
        # Compute is the executor's: its work, times the lock-step bubble of the schedule.
        lockstep = simulate_lockstep(spec.schedule)
        bubble = float(lockstep.makespan / max(lockstep.busy))
        busy = s.estimate.flops / (costmodel.HARDWARE["h100"].flops * costmodel.HARDWARE["h100"].utilisation)
        assert s.estimate.time.compute_s == pytest.approx(busy * bubble, rel=1e-12)
        factors[strategy, schedule, microbatches] = bubble
    for strategy in ("pp+dp", "pp+dp+fsdp"):
        # Zero-bubble schedules fill the bubble; more microbatches shrink it.
        assert factors[strategy, "zb-h1", 4] < factors[strategy, "1f1b", 4]
        assert factors[strategy, "1f1b", 8] < factors[strategy, "1f1b", 4]


def test_the_planner_gives_a_pipelines_stages_layers_by_speed_and_prices_the_bubble_once():
    # On equal devices the profiled step is the estimate's: the schedule's lock-step simulation replaces the
    # executor's bubble (compute compared alone: communication is most of gpt-tiny's step).
    for s in ranked_pipelines(Profile.from_speeds([1] * 8), per_stage=(2,)):
        t = s.estimate.time
        assert s.profiled_s - t.comm_s == pytest.approx(t.compute_s, rel=1e-9), (s.strategy, s.mesh, s.flags)
    # The first four devices twice as fast. With the stage axis outermost they are the first stage, which takes
    # more of gpt-tiny's layers; inside the data axis they are the first two data positions, which take more
    # microbatches. With the stages uneven and no per-layer communication (pp+dp) the step is shorter than the
    # even split's on the same devices. FSDP inside the stages gathers every stage's layers padded to the
    # deepest's, and a data position's extra microbatches add ticks, each with its sends, which on a model this
    # small cost more than the compute saved: the planner weighs both against the even split.
    ranked = ranked_pipelines(Profile.from_speeds([2] * 4 + [1] * 4), per_stage=(2,))
    even = {(s.strategy, tuple(s.mesh), s.flags): s for s in ranked if "--even" in s.flags}
    uneven = [s for s in ranked if "--even" not in s.flags]
    assert len(uneven) == len(even) == 8  # two strategies, each on two meshes under two schedules
    for s in uneven:
        split = s.to_dict()
        if next(iter(s.mesh)) == "stage":
            layers = split["layers_per_stage"]
            assert layers[0] > layers[1] and sum(layers) == MODEL.config.layers and not split["rank_microbatches"]
        else:
            ranks = split["rank_microbatches"]
            half = len(ranks) // 2  # the fast positions first
            assert min(ranks[:half]) > max(ranks[half:]) and sum(ranks) == len(ranks) * split["microbatches"]
        if s.strategy == "pp+dp" and next(iter(s.mesh)) == "stage":
            assert s.profiled_s < even[s.strategy, tuple(s.mesh), (*s.flags, "--even")].profiled_s


def test_pipelines_are_priced_only_by_an_executor_and_schedules_are_named():
    with pytest.raises(ValueError, match="prices pipelines by their executor: pass price="):
        suggest.rank(
            PARAMS, WORKLOAD, costmodel.HARDWARE["h100"], devices=8, memory_per_device=1 << 30,
            optimizer=OPTIMIZER, stages=(1, 2),
        )  # fmt: skip


def test_suggest_refuses_an_unknown_schedule(capsys):
    from tests.conftest import run_cli

    code, _, err = run_cli(capsys, "suggest", "--memory-per-device", "1GiB", "--schedules", "1f1b,gpipe2")
    one_error_line(code, err, r"--schedules '1f1b,gpipe2': unknown schedule 'gpipe2'; name some of gpipe, 1f1b, ")
    # A run's pipeline flags would be ignored by the search: they are refused, saying what it searches.
    code, _, err = run_cli(capsys, "suggest", "--memory-per-device", "1GiB", "--schedule", "zb-h1")
    one_error_line(code, err, r"--schedule does not apply to suggest: it searches the schedules of --schedules")
    code, _, err = run_cli(capsys, "suggest", "--memory-per-device", "1GiB", "--max-stages", "0")
    one_error_line(code, err, r"--max-stages")
    code, _, err = run_cli(capsys, "suggest", "--memory-per-device", "1GiB", "--microbatches", "8")
    one_error_line(code, err, r"--microbatches does not apply to suggest: it tries 2 and 4 microbatches a stage")
