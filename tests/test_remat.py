"""Remat policies: each one's sharded step equals one device, FSDP's default keeps its memory without recomputing
matmuls (read from the compiled program), a user's layer follows the active plan, and the CLI's --remat."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from flax import nnx

import spmd
import strategies
from spmd import costmodel, data, models
from spmd._hlo import matmul_flops
from tests.conftest import assert_trees_close, run_cli, train_steps

STEPS, BATCH = 2, 8
POLICIES = ("none", "full", "dots", "names:query_proj,mlp_hidden", "offload:mlp_hidden,attn_out")
# The default run trains under offload (names kept, on the host where the backend has one); the rest run with
# -m slow (none and dots are FSDP's old and new defaults, which tests/test_equivalence.py trains too).
DEFAULT = ("offload:mlp_hidden,attn_out",)


@pytest.fixture(scope="module")
def one_device():
    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    return train_steps(models.get("gpt-tiny", layers=2), spmd.Plan(), one, steps=STEPS, batch_size=BATCH)


@pytest.mark.parametrize(
    "policy", [pytest.param(p, marks=() if p in DEFAULT else (pytest.mark.slow,)) for p in POLICIES]
)
def test_each_policy_trains_zero3_like_one_device(policy, one_device):
    plan = dataclasses.replace(strategies.zero3(), remat=policy)
    model = models.get("gpt-tiny", layers=2, remat=plan.remat)
    losses, state, step = train_steps(model, plan, spmd.make_mesh({"data": 8}), steps=STEPS, batch_size=BATCH)
    assert_trees_close(losses, one_device[0])
    assert_trees_close(step.params_of(state), one_device[2].params_of(one_device[1]))
    batch = data.batch(0, 0, BATCH, 32, 256)
    assert step.rematerialises(batch) == (policy != "none")
    # What each policy recomputes is what the compiled program runs: a policy carried out as another would not be.
    r = spmd.report(step, batch)
    assert r.compiled_flops == pytest.approx(r.flops_per_device, rel=1e-6)


@pytest.mark.slow
def test_the_nnx_gpt_follows_the_policy_like_the_linen_one():
    plan = dataclasses.replace(strategies.zero3(), remat="names:query_proj,mlp_hidden")
    model = models.get("gpt-tiny-nnx", layers=2, remat=plan.remat)
    losses, _, step = train_steps(model, plan, spmd.make_mesh({"data": 8}), steps=STEPS, batch_size=BATCH)
    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    plain = train_steps(models.get("gpt-tiny-nnx", layers=2), spmd.Plan(), one, steps=STEPS, batch_size=BATCH)
    assert_trees_close(losses, plain[0])
    batch = data.batch(0, 0, BATCH, 32, 256)
    assert step.rematerialises(batch)
    r = spmd.report(step, batch)  # the names kept, the rest recomputed: as the cost model counts for this policy
    assert r.compiled_flops == pytest.approx(r.flops_per_device, rel=1e-6)


def _compiled(strategy, remat=None):
    plan = strategies.from_names(strategy)
    plan = plan if remat is None else dataclasses.replace(plan, remat=remat)
    model = models.get("gpt-small", layers=2, remat=plan.remat)
    step = spmd.TrainStep(
        models.loss_fn(model),
        optax.adam(1e-3),
        plan,
        spmd.make_mesh({"data": 8}),
        params=jax.eval_shape(model.init, jax.random.key(0)),
    )
    compiled = step.compile(data.batch(0, 0, 16, model.config.seq_len, model.config.vocab))
    stats = compiled.memory_analysis()
    return matmul_flops(compiled.as_text()), stats.argument_size_in_bytes + stats.temp_size_in_bytes


def test_fsdp_default_keeps_its_memory_without_recomputing_matmuls():
    # gpt-small cut to 2 layers, batch 16, data=8: the default (dots) does the matmul work of data parallelism in
    # under a third of its memory; whole-layer remat (what FSDP did before) costs 14% more matmul work here (two
    # layers; 19.5% with gpt-small's eight, see benchmarks/remat.py).
    assert strategies.zero3().remat == spmd.Remat("dots")
    dp_flops, dp_memory = _compiled("dp")
    flops, memory = _compiled("zero3")
    full_flops, full_memory = _compiled("zero3", remat="full")
    assert flops <= 1.001 * dp_flops  # measured 1.000
    assert memory <= 0.35 * dp_memory  # measured 0.319
    assert full_flops >= 1.12 * dp_flops and full_memory < memory  # measured 1.138, 0.280


def test_offloaded_activations_go_to_host_in_the_traced_step():
    # The traced step moves the named activations to pinned host memory (device_put to the host memory space)
    # and back for the backward pass. The CPU backend drops the move when it lowers (JAX lowers device_put's
    # memory spaces on GPU and TPU only): its compiled program keeps them in device memory and reports no host
    # bytes. Training under offload equals one device (above).
    model = models.get("gpt-tiny", layers=2, remat="offload:mlp_hidden")
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = data.batch(0, 0, BATCH, 32, 256)
    text = str(jax.make_jaxpr(jax.grad(models.loss_fn(model)))(params, batch))
    assert "f32<host>[8,32,256]" in text and "MemorySpace.Host" in text  # mlp_hidden: [batch, seq, mlp]
    plan = dataclasses.replace(strategies.zero3(), remat="offload:mlp_hidden")
    step = spmd.TrainStep(models.loss_fn(model), optax.sgd(0.1), plan, spmd.make_mesh({"data": 8}), params=params)
    compiled = step.compile(batch)
    if jax.default_backend() == "cpu":
        assert compiled.memory_analysis().host_temp_size_in_bytes == 0 and "S(5)" not in compiled.as_text()


def test_the_moe_gpt_tags_its_layer_input_and_expert_mlp_as_the_gpt_does():
    # A names or offload policy over mlp_hidden must find it in the expert MLP too, or it would keep nothing.
    for name in ("layer_input", "mlp_hidden"):
        model = models.get("moe-tiny", layers=2, remat=f"offload:{name}")
        params = jax.eval_shape(model.init, jax.random.key(0))
        text = str(jax.make_jaxpr(jax.grad(models.loss_fn(model)))(params, data.batch(0, 0, BATCH, 32, 256)))
        assert text.count("MemorySpace.Host") == 1, name  # the named activation, kept on the host


def test_an_nnx_module_class_is_refused_with_the_wrapping_that_works():
    with pytest.raises(spmd.PlanError, match=r"rematerialise\(Linear\): .* rematerialise\(lambda layer, x: layer"):
        spmd.rematerialise(nnx.Linear)


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(16, use_bias=False)(x))


def _user_step(plan, apply, params):
    def loss(params, batch):
        return jnp.mean(apply(params, batch["x"]) ** 2)

    return spmd.TrainStep(loss, optax.sgd(0.1), plan, spmd.make_mesh({"data": 8}), params=params), loss


@pytest.mark.parametrize("wrap", ["class", "function"])
def test_a_users_layer_follows_the_active_plans_policy(wrap):
    # spmd.rematerialise reads the policy when the step traces the layer: the same layer, two plans.
    layer = spmd.rematerialise(_Layer)() if wrap == "class" else _Layer()
    apply = layer.apply if wrap == "class" else spmd.rematerialise(layer.apply)
    batch = {"x": jax.random.normal(jax.random.key(1), (8, 16))}
    params = layer.init(jax.random.key(0), batch["x"])
    plain, loss = _user_step(strategies.data_parallel(), apply, params)
    remat, _ = _user_step(dataclasses.replace(strategies.data_parallel(), remat="dots"), apply, params)
    assert not plain.rematerialises(batch) and remat.rematerialises(batch)
    state = remat.init(lambda rng: layer.init(rng, batch["x"]), jax.random.key(0))
    _, got = remat(state, batch)
    assert_trees_close(got, loss(params, batch))


def test_the_cost_model_keeps_what_each_policy_keeps():
    model = models.get("gpt-tiny", layers=4)
    params = jax.eval_shape(model.init, jax.random.key(0))
    workload = costmodel.Workload(BATCH, 32)
    plan = strategies.zero3()
    rows = plan.resolve(params, {"data": 8}).leaves

    def kept(policy):
        p = dataclasses.replace(plan, remat=policy)
        return costmodel.activation_bytes(rows, p, {"data": 8}, workload), costmodel.host_activation_bytes(
            rows, p, {"data": 8}, workload
        )

    none, full, dots = kept("none")[0], kept("full")[0], kept("dots")[0]
    names, offload = kept("names:mlp_hidden"), kept("offload:mlp_hidden")
    assert full < names[0] < dots < none and names[1] == 0
    # Offload keeps on the device what full remat keeps, and moves the named hidden layer, every layer's, to host.
    hidden = 4 * (BATCH // 8) * 32 * model.config.mlp * 4  # layers · tokens per device · mlp · 4 bytes
    assert offload == (full, hidden) and names[0] == full + hidden
    offloading = dataclasses.replace(plan, remat="offload:mlp_hidden")
    est = costmodel.estimate(
        offloading, params, {"data": 8}, workload, optimizer=optax.sgd(0.1), hardware=costmodel.HARDWARE["h100"]
    )
    assert est.host_activation_bytes == hidden
    # They go to the host in the forward and come back for the backward, over the host link.
    assert [(t.kind, t.bytes) for t in est.host_traffic] == [("host-transfer", 2 * hidden)]
    assert est.step_memory(0)["host_transfer_bytes"] == 2 * hidden


def test_plans_merge_one_policy():
    assert (strategies.data_parallel() + strategies.fsdp()).remat.kind == "dots"
    assert spmd.Plan(remat=True).remat == spmd.Remat("full")
    with pytest.raises(spmd.PlanError, match=r"nothing saved\) and .*matmul outputs saved"):
        spmd.Plan(remat="full") + strategies.fsdp()
    assert "layers rematerialised (offloaded to host: mlp_out)" in str(spmd.Plan(remat="offload:mlp_out"))


@pytest.mark.parametrize("value", ["bogus", "names:", "offload", "dots:qkv"])
def test_bad_remat_values_exit_2_naming_the_forms(capsys, value):
    code, out, err = run_cli(capsys, "plan", "--mesh", "data=8", "--strategy", "zero3", "--remat", value)
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, err
    assert "none, full, dots, names:a,b or offload:a,b" in err and "mlp_hidden" in err, err


@pytest.mark.parametrize("value", ["names:mlp_hiden", "offload:query_proj,qkv"])
def test_a_name_no_built_in_activation_carries_exits_2(capsys, value):
    # Saving a name nothing is tagged with keeps nothing: full remat under another name, so it is refused.
    code, out, err = run_cli(capsys, "plan", "--mesh", "data=8", "--strategy", "zero3", "--remat", value)
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, err
    assert "the built-in models tag no activation" in err and "they tag layer_input" in err, err


def test_remat_flag_overrides_the_strategys_policy(capsys):
    argv = ["plan", "--mesh", "data=8", "--strategy", "zero3", "--layers", "1", "--json", "--remat", "names:query_proj"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert json.loads(out)["plan"].endswith("layers rematerialised (saved: query_proj)")
