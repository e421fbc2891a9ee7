"""Context parallelism: the sequence split over a ``context`` axis, attention across it by all-gather, ring or
all-to-all, head-tail load balancing; training equal to one device, the cost model against the compiled program."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import spmd
import strategies
from spmd import costmodel, data, models
from spmd._context_attention import causal_attention
from spmd._context_parallel import MASKED, SKIP, attention_share, block_kinds, halves, sources
from tests.conftest import assert_trees_close, run_cli, train_steps

METHODS = ("allgather", "ring", "alltoall")


def _sharded_attention(plan, mesh, q, k, v):
    """``spmd.attention`` under ``plan``, the sequence balanced before and restored after as a model does."""

    def f(q, k, v):
        with spmd.activate(plan, mesh):
            q, k, v = (spmd.balance_sequence(x) for x in (q, k, v))
            return spmd.restore_sequence(spmd.attention(q, k, v))

    sharding = jax.sharding.NamedSharding(mesh, plan.batch_spec(4))
    return f, [jax.device_put(x, sharding) for x in (q, k, v)]


SHAPES = {"context4": {"data": 2, "context": 4}, "context2-tensor2": {"data": 2, "context": 2, "tensor": 2}}
ATTENTION_CASES = [
    pytest.param(method, balanced, shape, id=f"{name}-{method}-{'balanced' if balanced else 'in-order'}",
                 marks=() if balanced and name == "context4" else (pytest.mark.slow,))
    for name, shape in SHAPES.items() for method in METHODS for balanced in (True, False)
]  # fmt: skip


@pytest.mark.parametrize(("method", "balanced", "shape"), ATTENTION_CASES)
def test_attention_and_its_gradients_equal_one_device(method, balanced, shape):
    _check_attention(method, balanced, shape)


@pytest.mark.parametrize(
    "shape", [{"data": 1, "context": 8}, {"data": 2, "context": 4}, {"data": 2, "context": 2, "tensor": 2}]
)
def test_the_ring_between_neighbour_pairs_equals_one_device(monkeypatch, shape):
    """Inside a pipeline's branches the ring passes its blocks by all-gathers over pairs of neighbours (a
    collective-permute would wait for the other stages); here it runs outside one, forced as a pipeline would."""
    monkeypatch.setattr(spmd._context_attention, "_in_branches", lambda: True)
    _check_attention("ring", True, shape)


def test_the_ring_between_neighbour_pairs_needs_an_even_context_axis(monkeypatch):
    monkeypatch.setattr(spmd._context_attention, "_in_branches", lambda: True)
    mesh = spmd.make_mesh({"context": 3}, devices=jax.devices()[:3])
    x = jnp.zeros((1, 12, 2, 4))
    with pytest.raises(spmd.PlanError, match=r"needs an even number of devices there \(3\)"):
        with spmd.activate(strategies.context_parallel(method="ring", load_balance=False), mesh):
            jax.eval_shape(spmd.attention, x, x, x)


def _check_attention(method, balanced, shape):
    mesh = spmd.make_mesh(shape)
    plan = strategies.context_parallel(method=method, load_balance=balanced)
    plan = plan + strategies.data_parallel() + (strategies.tensor_parallel() if "tensor" in shape else spmd.Plan())
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32) for _ in range(3))
    f, placed = _sharded_attention(plan, mesh, q, k, v)
    np.testing.assert_allclose(jax.jit(f)(*placed), causal_attention(q, k, v), atol=1e-5)

    def loss(attend):
        return lambda q, k, v: (attend(q, k, v) ** 2 * jnp.arange(16)[None, :, None, None]).sum()

    got = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(*placed)
    want = jax.grad(loss(causal_attention), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("ways", [2, 4, 8])
def test_the_block_table_is_the_causal_mask_and_balances_it(ways):
    """Each block's kind is what the mask says of its positions; head-tail makes every device's work equal
    (2c + 1 of its 4c blocks), in order the last device does 4c − 1."""
    length, h = 4 * ways, 2  # half-chunks of 2 positions
    mask = np.tril(np.ones((length, length), bool))
    for balanced in (True, False):
        for ring in (True, False):
            kinds = block_kinds(ways, balanced, ring=ring)
            for d in range(ways):
                for t in range(ways):
                    src = (d - t) % ways if ring else t
                    for a, qh in enumerate(halves(d, ways, balanced)):
                        for b, kh in enumerate(halves(src, ways, balanced)):
                            block = mask[qh * h : (qh + 1) * h, kh * h : (kh + 1) * h]
                            expected = SKIP if not block.any() else MASKED if not block.all() else 2
                            assert kinds[d, t, a, b] == expected
            for paired in (True, False) if ring else ():
                order = sources(ways, ring=True, paired=paired)
                assert all(sorted(row) == list(range(ways)) for row in order.tolist())
                assert (block_kinds(ways, balanced, ring=True, paired=paired) != SKIP).sum() == (kinds != SKIP).sum()
            work = (kinds != SKIP).sum(axis=(1, 2, 3))
            if balanced:
                assert set(work.tolist()) == {2 * ways + 1}
            else:
                assert work.max() == 4 * ways - 1 and work.min() == 3
    assert attention_share(strategies.context_parallel().context, ways) == (2 * ways + 1) / (4 * ways)


def _steps(plan, shape, model, batch=2):
    mesh = spmd.make_mesh(shape, devices=jax.devices()[: int(np.prod(list(shape.values())))])
    return train_steps(model, plan, mesh, steps=2, batch_size=batch)


@pytest.mark.parametrize(
    ("strategy", "method", "shard"),
    [
        ("dp+cp", "allgather", True),
        *(pytest.param("dp+cp", m, False, marks=pytest.mark.slow) for m in METHODS),
        pytest.param("zero3+cp", "ring", False, marks=pytest.mark.slow),
    ],
)
def test_dp_cp_trains_like_one_device_with_a_batch_smaller_than_the_devices(strategy, method, shard):
    """Batch 2 on 8 devices; with ``shard_params`` the context axis splits the training state too (FSDP over
    it), each device storing a quarter of what it stores with the parameters replicated over context."""
    model = models.get("gpt-tiny", layers=2)
    options = strategies.ContextOptions(method, shard_params=shard)
    plan = strategies.from_names(strategy, {"data": 2, "context": 4}, context_options=options)
    losses, state, step = _steps(plan, {"data": 2, "context": 4}, model)
    ref_losses, ref, _ = _steps(spmd.Plan(), {"data": 1}, model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(state.params, ref.params)
    if shard:
        replicated = strategies.from_names(strategy, {"data": 2, "context": 4})
        params = jax.eval_shape(model.init, jax.random.key(0))
        layout = spmd.resolve_state(replicated, params, optax.sgd(0.1), step.mesh)
        stored = costmodel.model_state_bytes(step.layout)["params"]
        assert stored < 0.3 * costmodel.model_state_bytes(layout)["params"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "kind", "shard"),
    [(m, k, False) for m in METHODS for k in ("gpt-tiny", "gpt-tiny-nnx")]
    + [("ring", "gpt-tiny", True), ("alltoall", "gpt-tiny-nnx", True)],
)
def test_fsdp_tp_cp_trains_like_one_device(method, kind, shard):
    model = models.get(kind, layers=2)
    shape = {"fsdp": 2, "context": 2, "tensor": 2}
    options = strategies.ContextOptions(method, shard_params=shard)
    plan = strategies.from_names("fsdp+tp+cp", shape, context_options=options)
    losses, state, step = _steps(plan, shape, model, batch=4)
    ref_losses, ref, _ = _steps(spmd.Plan(), {"data": 1}, model, batch=4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(state.params, ref.params)
    assert shard == any("context" in row.axes for row in step.layout.params.leaves)


def test_parameters_split_over_context_join_another_split_and_say_where_they_cannot():
    """FSDP over the context axis takes a free dimension, else joins one another part split (MaxText's
    ``embed`` over fsdp and context together); an array neither allows keeps a note saying so."""
    plan = strategies.fsdp(min_bytes=0) + strategies.context_parallel(shard_params=True, min_bytes=0)
    tree = {
        "free": nn.LogicallyPartitioned(np.zeros((4, 16, 8)), ("layers", "embed", "mlp")),
        "joined": nn.LogicallyPartitioned(np.zeros((4, 16)), ("layers", "mlp")),
        "neither": nn.LogicallyPartitioned(np.zeros((4, 6)), ("layers", "mlp")),
    }
    rows = {r.path: r for r in plan.resolve(tree, {"fsdp": 2, "context": 4}).leaves}
    assert rows["free"].spec == P(None, "fsdp", "context")
    assert rows["joined"].spec == P(None, ("fsdp", "context"))
    assert (
        rows["neither"].spec == P(None, "fsdp") and "no free dimension divisible by 'context'" in rows["neither"].note
    )
    with pytest.raises(spmd.PlanError, match=r"shard_params=True\) \(--cp-shard-params\)"):
        strategies.fsdp(axis="context") + strategies.context_parallel()


class _OwnAttention(nn.Module):
    """A user's attention: their own projections, spmd.attention in place of the softmax."""

    heads: int = 4

    @nn.compact
    def __call__(self, x):
        b, s, d = x.shape
        q, k, v = (nn.DenseGeneral((self.heads, d // self.heads), name=n)(x) for n in ("q", "k", "v"))
        return nn.DenseGeneral(d, axis=(-2, -1), name="o")(spmd.attention(q, k, v))


class _OwnLM(nn.Module):
    balance: bool = True

    @nn.compact
    def __call__(self, tokens):
        order = spmd.balance_sequence if self.balance else (lambda t: t)
        x = nn.Embed(64, 32)(order(tokens)) + nn.Embed(16, 32)(spmd.sequence_positions(tokens.shape[1]))
        x = x + _OwnAttention()(nn.LayerNorm()(x))
        return nn.Dense(64)(spmd.restore_sequence(x) if self.balance else x)


def test_a_users_attention_module_trains_like_one_device_and_must_restore_its_order():
    model = models.from_module(_OwnLM(), name="own", config=models.LMConfig(vocab=64, seq_len=16))
    shape = {"data": 2, "context": 4}
    plan = strategies.data_parallel() + strategies.context_parallel(method="ring")
    losses, state, _ = _steps(plan, shape, model)
    ref_losses, ref, _ = _steps(spmd.Plan(), {"data": 1}, model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(state.params, ref.params)

    unbalanced = models.from_module(_OwnLM(balance=False), name="own", config=models.LMConfig(vocab=64, seq_len=16))
    with pytest.raises(spmd.PlanError, match="did not put its sequence in head-tail order"):
        _steps(plan, shape, unbalanced)


def _plan_json(capsys, method, mesh="data=2,context=4", strategy="dp+cp", *extra):
    code, out, err = run_cli(
        capsys, "plan", "--model", "gpt-tiny", "--layers", "2", "--mesh", mesh, "--strategy", strategy,
        "--cp-method", method, "--batch-size", "2", "--json", *extra,
    )  # fmt: skip
    assert code == 0, err
    return json.loads(out)


def _over_context(rows):
    return sum(c["traffic_bytes"] for c in rows if c["axes"] == ["context"])


@pytest.mark.parametrize("method", ["ring", *(pytest.param(m, marks=pytest.mark.slow) for m in METHODS[::2])])
def test_compiled_traffic_and_flops_over_context_are_the_cost_models(capsys, method):
    report = _plan_json(capsys, method)
    kinds = {c["kind"] for c in report["collectives"] if c["axes"] == ["context"]}
    assert {"allgather": "all-gather", "ring": "collective-permute", "alltoall": "all-to-all"}[method] in kinds
    ratio = _over_context(report["collectives"]) / _over_context(report["analytic_collectives"])
    assert 0.9 <= ratio <= 1.1, ratio
    flops = report["compiled_flops_per_device"] / report["flops_per_device"]
    assert 0.95 <= flops <= 1.05, flops


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_a_pipelines_traffic_over_context_is_the_cost_models(capsys, method):
    """Inside a pipeline the program is automatic over the context axis: the layers' gradients are reduced
    there at every backward action, as the cost model counts; the attention's exchanges (the ring's between
    neighbour pairs) are the cost model's too, and the stage messages are split over context."""
    report = _plan_json(capsys, method, "stage=2,context=4", "pp+cp", "--batch-size", "4", "--microbatches", "4")
    ratio = _over_context(report["collectives"]) / _over_context(report["analytic_collectives"])
    assert 0.9 <= ratio <= 1.1, ratio
    exchanges = lambda rows: _over_context([c for c in rows if c["kind"] != "all-reduce"])  # noqa: E731
    ratio = exchanges(report["collectives"]) / exchanges(report["analytic_collectives"])
    assert 0.95 <= ratio <= 1.05, ratio
    if method == "ring":
        pairs = [c for c in report["collectives"] if c["axes"] == ["context"] and c.get("group_size") == 2]
        assert {c["kind"] for c in pairs} == {"all-gather", "reduce-scatter"}
    stage = lambda rows: sum(c["traffic_bytes"] for c in rows if c["axes"] == ["stage"])  # noqa: E731
    assert stage(report["collectives"]) == pytest.approx(stage(report["analytic_collectives"]), rel=0.01)


@pytest.mark.slow
def test_load_balancing_halves_the_busiest_devices_attention_in_the_compiled_program(capsys):
    """The compiled program's matmul FLOPs on the busiest device (the block switch weighted by its table) fall
    with head-tail order by what the table says: (2c+1)/(4c−1) of the attention products."""
    balanced, in_order = (
        _plan_json(capsys, "ring"),
        _plan_json(capsys, "ring", "data=2,context=4", "dp+cp", "--no-load-balance"),
    )
    drop = in_order["compiled_flops_per_device"] - balanced["compiled_flops_per_device"]
    assert drop > 0
    assert drop == pytest.approx(in_order["flops_per_device"] - balanced["flops_per_device"], rel=0.01)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mesh", "data=2,context=4", "--seq-len", "36"], "not divisible by 8"),
        (["--mesh", "data=8"], "mesh axis 'context'"),
        (["--mesh", "data=2,context=4", "--cp-method", "zigzag"], "invalid choice"),
        (["--mesh", "context=8", "--cp-method", "alltoall"], "splits the heads"),
        (["--mesh", "data=2,context=2,tensor=2", "--strategy", "dp+cp+sp"], "use tp rather than sp with cp"),
    ],
)
def test_bad_context_parallel_input_exits_2_with_one_line(capsys, args, message):
    strategy = "dp+cp" if "data=" in args[1] else "cp"
    code, out, err = run_cli(
        capsys, "plan", "--model", "gpt-tiny", "--layers", "1", "--strategy", strategy, "--batch-size", "2", *args
    )
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("mesh", "strategy", "message"),
    [
        ("data=2,context=4", "sdp+cp", "does not compose with subnetwork"),
        ("data=2,context=4", "dp+cp --device-speeds 2,2,1,1,1,1,1,1", "does not compose with uneven shares"),
    ],
)
def test_execution_modes_that_cannot_take_the_exchanges_are_refused(capsys, mesh, strategy, message):
    strategy, *flags = strategy.split()
    code, _, err = run_cli(capsys, "plan", "--model", "gpt-tiny", "--mesh", mesh, "--strategy", strategy, *flags)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "shard"),
    [("allgather", False), ("ring", False), ("ring", True), ("alltoall", False), ("alltoall", True)],
)
def test_a_pipeline_over_stages_splits_each_stages_sequence_like_one_device(method, shard):
    """stage=2,context=4: each stage's four devices split the sequence (head-tail, moved by all-gathers inside
    the stages' branches), and with ``shard_params`` their stage's parameters; two 1F1B steps equal one
    device's."""
    model = models.get("gpt-tiny", layers=2)
    shape = {"stage": 2, "context": 4}
    options = strategies.PipelineOptions("1f1b", 4)
    cp = strategies.ContextOptions(method, shard_params=shard)
    plan = strategies.from_names("pp+cp", shape, pipeline_options=options, context_options=cp)
    losses, state, step = _steps(plan, shape, model, batch=4)
    ref_losses, ref, ref_step = _steps(spmd.Plan(), {"data": 1}, model, batch=4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(step.params_of(state), ref_step.params_of(ref))


@pytest.mark.slow
def test_long_sequences_temporaries_fall_with_the_context_axis():
    """gpt-tiny at 2048 tokens, batch 1: per-device temporaries on context=8 at most 0.3× one device's."""
    model = models.get("gpt-tiny", seq_len=2048, layers=2)
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = data.batch(0, 0, 1, 2048, model.config.vocab)

    def temp(plan, size):
        mesh = spmd.make_mesh({"context": size}, devices=jax.devices()[:size])
        step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=params)
        return spmd.report(step, batch).compiled_memory["temp_bytes"]

    assert temp(strategies.context_parallel(), 8) <= 0.3 * temp(spmd.Plan(), 1)


def test_the_cost_model_splits_activations_and_attention_over_the_context_axis():
    params = jax.eval_shape(models.get("gpt-tiny", layers=2).init, jax.random.key(0))
    workload = costmodel.Workload(batch=2, seq_len=32)
    options = {"optimizer": optax.sgd(0.1), "hardware": costmodel.HARDWARE["h100"]}
    one = costmodel.estimate(spmd.Plan(), params, {"data": 1}, workload, **options)
    four = costmodel.estimate(strategies.context_parallel(), params, {"context": 4}, workload, **options)
    assert four.activation_bytes == pytest.approx(one.activation_bytes / 4, rel=0.05)
    assert four.flops < one.flops / 4


def test_suggest_splits_the_sequence_of_a_batch_too_small_for_the_devices(capsys):
    """One sequence of 1024 tokens on 8 devices: no data-parallel plan can split it; suggest splits the sequence
    over a context axis, and the pick compiles within the budget. Without context axes it finds no plan."""
    args = ("suggest", "--model", "gpt-tiny", "--layers", "1", "--batch-size", "1", "--seq-len", "1024",
            "--memory-per-device", "64MiB", "--confirm", "1", "--json")  # fmt: skip
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    found = json.loads(out)
    assert "cp" in found["pick"]["strategy"].split("+") and found["pick"]["mesh"].get("context", 1) > 1
    assert found["pick"]["confirmed"]
    assert any("batch 1 does not split" in s for s in found["skipped"])
    code, _, err = run_cli(capsys, *args, "--max-context", "1")
    assert code == 2 and "no plan could be built" in err and "batch 1 does not split" in err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "strategy"), [({"data": 2, "context": 4}, "dp+cp"), ({"stage": 2, "context": 4}, "pp+cp")]
)
def test_accumulated_microbatches_split_their_sequence_and_train_like_one_device(shape, strategy):
    """Two microbatches a step, each laid out as the batch (the sequence over context): under dp+cp attention
    runs inside the program manual over the batch axis, under pp+cp in the executor's scan; the step equals
    one device's."""
    model = models.get("gpt-tiny", layers=2)
    plan = strategies.from_names(strategy, shape, pipeline_options=strategies.PipelineOptions("1f1b", 4))
    plan = plan + strategies.accumulate(2)
    losses, state, step = _steps(plan, shape, model, batch=8)
    ref_losses, ref, ref_step = _steps(spmd.Plan(), {"data": 1}, model, batch=8)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(step.params_of(state), ref_step.params_of(ref))


def test_suggest_splits_the_parameters_over_context_where_replicated_state_does_not_fit():
    """One sequence on 4 devices, 16 MiB of state (4 MiB of weights with Adam's moments) and 8 MiB a device:
    only cp with the parameters split over the context axis fits, and its run command says so."""
    from strategies import suggest

    params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    ranked, _ = suggest.rank(
        params, costmodel.Workload(1, 64), costmodel.HARDWARE["h100"], devices=4, memory_per_device=8 << 20,
        optimizer=optax.adam(1e-3), max_tensor=1, contexts=(4,),
    )  # fmt: skip
    fitting = [(s.strategy, s.flags) for s in ranked if s.fits]
    assert fitting and all(flags[:1] == ("--cp-shard-params",) for _, flags in fitting), fitting
    assert any(s.strategy == "cp" and not s.fits and not s.flags for s in ranked)
