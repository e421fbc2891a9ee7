"""Subnetwork data parallelism: ownership, the owner-averaged update against NumPy, unbiased backward masking,
real memory savings on gpt-small, and the command line."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
import strategies
from spmd import data, models
from spmd.execution import SubnetSpec, ownership
from tests.conftest import run_cli

MESH = {"data": 8}


@pytest.mark.parametrize("coverage,groups", [(0.5, 8), (0.25, 8), (0.125, 16), (1.0, 4)])
def test_ownership_is_balanced_complete_and_seeded(coverage, groups):
    spec = SubnetSpec(coverage=coverage, seed=3)
    o = ownership(spec, 8, {"layers": groups}, groups)
    m = o.mask("layers")
    assert m.any(axis=0).all()  # every group owned
    assert set(m.sum(axis=1)) == {int(coverage * groups)}  # every worker the same share
    assert set(m.sum(axis=0)) == {int(8 * coverage)}  # every group the same number of owners
    assert np.array_equal(m, ownership(spec, 8, {"layers": groups}, groups).mask("layers"))
    other = ownership(SubnetSpec(coverage=coverage, seed=4), 8, {"layers": groups}, groups).mask("layers")
    assert coverage == 1.0 or not np.array_equal(m, other)
    neurons = ownership(spec, 8, {"mlp": 32, "heads": 8}, 3)
    assert neurons.index["mlp"].shape == (round(1 / coverage), 3, int(32 * coverage))  # per layer


def _sdp_step(model, masking, granularity, optimizer, seed=0):
    plan = strategies.subnetwork_dp(coverage=0.5, granularity=granularity, masking=masking, seed=seed)
    narrow = lambda kept: models.loss_fn(models.narrowed(model, kept))  # noqa: E731
    params = jax.eval_shape(model.init, jax.random.key(0))
    return spmd.TrainStep(models.loss_fn(model), optimizer, plan, spmd.make_mesh(MESH), params=params, narrow=narrow)


def _placed(sub, path, x, part):
    """Part ``part``'s groups ``x`` put in the full layout, zeros elsewhere."""
    return sub._joined(path, [x if g == part else jnp.zeros_like(x) for g in range(sub.owners.parts)])


def _worker_grads(model, params, batch, step, masking):
    """Each worker's own gradient, on one device: its subnetwork's (forward masking) or the full model's
    (backward masking) on its slice of the batch, in the full layout with zeros where it owns nothing."""
    sub = step.executor.engine
    narrowed = models.loss_fn(models.narrowed(model, sub.kept))

    @jax.jit(static_argnums=2)
    def grad_of(params, local, part):
        own = lambda path, x: sub._take(path, x, np.array([part]))[0] if sub._dim(path) else x  # noqa: E731
        place = lambda path, x: _placed(sub, path, x, part) if sub._dim(path) else x  # noqa: E731
        if masking == "backward":  # the full model's gradient, of which only the owned groups count
            return sub._map(lambda path, x: place(path, own(path, x)), jax.grad(models.loss_fn(model))(params, local))
        return sub._map(place, jax.grad(narrowed)(sub._map(own, params), local))

    rows = batch["tokens"].shape[0] // 8
    one = jax.devices()[0]
    params = jax.device_put(params, one)
    return [
        jax.tree.map(
            np.asarray, grad_of(params, {"tokens": batch["tokens"][w * rows : (w + 1) * rows]}, sub.owners.part_of[w])
        )
        for w in range(8)
    ]


@pytest.mark.parametrize(
    "name,masking,granularity",
    [
        ("gpt-tiny", "forward", "block"),
        ("cnn-tiny", "forward", "neuron"),  # convolution channels
        pytest.param("gpt-tiny", "forward", "neuron", marks=pytest.mark.slow),  # MLP units and heads
        pytest.param("gpt-tiny", "backward", "neuron", marks=pytest.mark.slow),
    ],
)
def test_update_is_the_owner_average_computed_in_numpy(name, masking, granularity):
    model = models.get(name, layers=2)
    step = _sdp_step(model, masking, granularity, optax.sgd(1.0))  # the update is minus the gradient
    state = step.init(model.init, jax.random.key(0))
    groups = {"block": {"layers"}, "neuron": {"channels"} if name == "cnn-tiny" else {"mlp", "heads"}}
    assert set(step.executor.engine.sizes) == groups[granularity]
    before = jax.tree.map(np.asarray, step.params_of(state))
    batch = data.batch(0, 0, 16, model.config.seq_len, model.config.vocab)
    state, _ = step(state, batch)
    update = jax.tree.map(lambda a, b: np.asarray(b) - a, before, step.params_of(state))
    # The rule in NumPy: g_p = Σ_{i owns p} g_ip / |owners(p)|; shared parameters: the mean over all workers.
    grads = _worker_grads(model, before, batch, step, masking)
    sub = step.executor.engine
    count = sub._map(
        lambda path, x: (
            sum(_placed(sub, path, jnp.ones_like(sub._take(path, x, np.array([p]))[0]), p) for p in sub.owners.part_of)
            if sub._dim(path)
            else np.full(x.shape, 8.0)
        ),
        before,
    )
    expected = jax.tree.map(lambda c, *gs: -np.sum(gs, axis=0) / np.asarray(c), count, *grads)
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(update)[0], jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_backward_masking_is_unbiased():
    # Per-worker gradients of 16 groups; over random ownerships (seeds) the owner-averaged update averages to the
    # data-parallel update (the mean over all workers). Tolerance: 5 standard errors of the seed average.
    rng = np.random.default_rng(0)
    g = rng.normal(size=(8, 16))  # worker × group
    seeds = 2000
    estimates = []
    for seed in range(seeds):
        m = ownership(SubnetSpec(coverage=0.5, masking="backward", seed=seed), 8, {"layers": 16}, 16).mask("layers")
        estimates.append((m * g).sum(axis=0) / m.sum(axis=0))
    estimates = np.array(estimates)
    dp = g.mean(axis=0)
    stderr = estimates.std(axis=0) / np.sqrt(seeds)
    assert np.all(np.abs(estimates.mean(axis=0) - dp) <= 5 * stderr + 1e-12)
    # ... while any single ownership is biased away from it: the test could fail.
    assert np.abs(estimates[0] - dp).max() > 10 * stderr.max()


@pytest.fixture(scope="module")
def small_reports():
    """gpt-small on data=8 at batch 32: SDP at coverage 0.5 with either masking, and data parallelism (the
    forward-masking report joined with data parallelism's, as ``spmd plan`` does for a subnetwork plan)."""
    model = models.get("gpt-small")
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = data.batch(0, 0, 32, model.config.seq_len, model.config.vocab)
    mesh = spmd.make_mesh(MESH)
    dp = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), spmd.Plan(batch_axes=("data",)), mesh, params=params)
    out = {}
    for masking in ("forward", "backward"):
        plan = strategies.subnetwork_dp(coverage=0.5, masking=masking)
        narrow = lambda kept: models.loss_fn(models.narrowed(model, kept))  # noqa: E731
        step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=params, narrow=narrow)
        out[masking] = spmd.report(step, batch)
    out["forward"] = out["forward"].with_data_parallel(spmd.report(dp, batch))
    out["dp"] = out["forward"].data_parallel
    assert out["backward"].data_parallel is None
    return out


def test_the_report_measures_sdp_against_data_parallelism(small_reports):
    dp, sdp = small_reports["dp"], small_reports["forward"]
    assert dp.plan == spmd.Plan(batch_axes=("data",)) and dp.execution is None and dp.data_parallel is None
    # Data parallelism keeps the whole model on every device and reduces every gradient over all 8.
    assert dp.per_device_bytes["params"] == sum(r.bytes for r in dp.params)
    assert {c.group_size for c in dp.collectives} == {8}
    d = sdp.to_dict()
    assert d["data_parallel"]["per_device_bytes"] == dp.per_device_bytes
    assert d["data_parallel"]["compiled_memory"] == dp.compiled_memory
    ratios = d["vs_data_parallel"]
    assert ratios["total_bytes"] == sdp.per_device_bytes["total"] / dp.per_device_bytes["total"] <= 0.65
    assert ratios["compiled_argument_bytes"] <= 0.7
    assert ratios["comm_bytes"] == sdp.comm_bytes_per_step["compiled"] / dp.comm_bytes_per_step["compiled"] < 1
    assert re.search(r"against data parallelism on this mesh: model state .* \(this plan 0\.\d+×\)", str(sdp))


def test_forward_masking_stores_only_the_subnetwork(small_reports):
    dp, sdp = small_reports["dp"], small_reports["forward"]
    assert sdp.per_device_bytes["total"] <= 0.65 * dp.per_device_bytes["total"]
    assert sdp.compiled_memory["argument_bytes"] <= 0.7 * dp.compiled_memory["argument_bytes"]
    assert sdp.execution.kind == "subnet"
    s = sdp.execution.figures
    assert s["parts"] == 2 and s["owners_per_group"] == 4 and s["shared_param_bytes"] > 0
    # Shared parameters (embeddings, head, final norm) are a quarter of gpt-small: the rest is halved.
    assert sdp.per_device_bytes["params"] == s["owned_param_bytes"] + s["shared_param_bytes"]
    assert s["owned_param_bytes"] == pytest.approx(0.5 * (dp.per_device_bytes["params"] - s["shared_param_bytes"]))
    # Averaging runs over the owners only: the owned gradients' all-reduce spans groups of 4.
    assert {c.group_size for c in sdp.collectives if c.kind == "all-reduce"} == {4, 8}
    assert sdp.comm_bytes_per_step["compiled"] == pytest.approx(sdp.comm_bytes_per_step["analytic"], rel=0.01)


def test_backward_masking_shrinks_gradients_and_optimizer_state(small_reports):
    dp, sdp = small_reports["dp"], small_reports["backward"]
    shrunk = lambda r: r.per_device_bytes["grads"] + r.per_device_bytes["optimizer"]  # noqa: E731
    assert shrunk(sdp) <= 0.65 * shrunk(dp)
    assert sdp.per_device_bytes["params"] == dp.per_device_bytes["params"]  # every worker runs the full model
    assert sdp.comm_bytes_per_step["compiled"] == pytest.approx(sdp.comm_bytes_per_step["analytic"], rel=0.01)


def test_cli_run_sdp_reduces_the_loss(capsys):
    code, out, _ = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--mesh", "data=8", "--strategy", "sdp", "--coverage", "0.5",
        "--masking", "forward", "--steps", "30", "--json",
    )  # fmt: skip
    j = json.loads(out)
    assert code == 0 and len(j["losses"]) == 30 and j["losses"][-1] < 0.9 * j["losses"][0]
    assert j["per_device_bytes"]["total"] > 0 and "subnetworks over data (coverage 0.5" in j["plan"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--coverage", "0.3"], r"coverage 0.3 is not 1/P for a whole number P"),
        (["--coverage", "0.125", "--layers", "4"], r"4 layers do not split into 8 equal parts"),
        (["--granularity", "channel"], r"granularity 'channel'; choose from block, neuron"),
        (["--masking", "sideways"], r"masking 'sideways'; choose from forward, backward"),
        (["--model", "mlp"], r"model 'mlp' cannot be narrowed to a subnetwork"),
    ],
)
def test_cli_sdp_mistakes(capsys, args, message):
    code, _, err = run_cli(capsys, "plan", "--mesh", "data=8", "--strategy", "sdp", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_owned_arrays_are_stored_per_worker_and_split_over_data():
    model = models.get("gpt-tiny", layers=2)
    step = _sdp_step(model, "forward", "block", optax.sgd(0.1))
    layout = step.layout
    row = next(r for r in layout.params.leaves if r.path.endswith("mlp/wi/kernel"))
    assert row.names[0] == "worker" and row.spec[0] == "data" and row.shape[:2] == (8, 1)
    assert row.bytes_per_device == row.bytes // 8


@pytest.mark.parametrize(
    ("mesh", "strategy", "batch"),
    [
        ("data=4,tensor=2", "sdp+tp", 16),
        pytest.param("data=2,tensor=4", "sdp+tp", 8, marks=pytest.mark.slow),
        pytest.param("data=4,fsdp=2", "sdp+fsdp", 16, marks=pytest.mark.slow),
        pytest.param("data=2,fsdp=4", "sdp+fsdp", 8, marks=pytest.mark.slow),
    ],
)
def test_cli_check_compares_sdp_with_sdp_simulated_on_one_device(capsys, mesh, strategy, batch):
    """Subnetworks composed with tp or fsdp on the other axis train as the same subnetwork algorithm does on one
    device, its workers simulated one after another (the same ownership, the owner-averaged update)."""
    code, out, _ = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--mesh", mesh, "--strategy", strategy, "--coverage", "0.5",
        "--batch-size", str(batch), "--steps", "2", "--check", "--json",
    )  # fmt: skip
    j = json.loads(out)
    assert code == 0 and j["max_abs_diff"] <= 1e-4, j


@pytest.mark.parametrize("other", ["fsdp", "tp"])
def test_composed_subnetworks_shrink_the_state_with_coverage_as_on_data_alone(other):
    """On data=4 × (fsdp or tensor)=2, a device's model state under sdp is at most coverage × the owned share
    (the layers) plus the shared share (embeddings, norms, head) of the same plan without sdp, plus 5%."""
    model = models.get("gpt-tiny")
    mesh = spmd.make_mesh({"data": 4, "fsdp" if other == "fsdp" else "tensor": 2})
    params = jax.eval_shape(model.init, jax.random.key(0))
    narrow = lambda kept: models.loss_fn(models.narrowed(model, kept))  # noqa: E731

    def state(plan):
        step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=params, narrow=narrow)
        rows = [*step.layout.params.leaves, *step.layout.grads.leaves, *step.layout.moments.leaves]
        return sum(r.bytes_per_device for r in rows), sum(r.bytes_per_device for r in rows if "/layers/" not in r.path)

    base, shared = state(strategies.from_names(f"dp+{other}", dict(mesh.shape)))
    for coverage in (0.5, 0.25):
        options = strategies.SubnetOptions(coverage=coverage)
        sdp, _ = state(strategies.from_names(f"sdp+{other}", dict(mesh.shape), subnet_options=options))
        assert sdp <= coverage * (base - shared) + shared + 0.05 * base, (coverage, sdp / base, shared / base)
