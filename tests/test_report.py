"""The plan report agrees with the compiled program: memory to the byte, collectives per loop iteration."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
import strategies
from spmd import data, models
from spmd._hlo import matmul_flops

BATCH = 16


def _report(model, strategy, mesh_axes):
    params = jax.eval_shape(model.init, jax.random.key(0))
    plan, mesh = strategies.from_names(strategy), spmd.make_mesh(mesh_axes)
    step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=params)
    return spmd.report(step, data.batch(0, 0, BATCH, model.config.seq_len, model.config.vocab))


@pytest.fixture(scope="module")
def mlp():
    return models.get("mlp")


@pytest.mark.parametrize("strategy,axis", [("dp", "data"), ("fsdp", "fsdp")])
def test_compiled_arguments_are_exactly_the_planned_state(mlp, strategy, axis):
    r = _report(mlp, strategy, {axis: 8})
    pd = r.per_device_bytes
    batch_bytes = BATCH // 8 * mlp.config.seq_len * 4  # int32 tokens, split over the batch axis
    step_counter = 4
    assert r.compiled_memory["argument_bytes"] == pd["params"] + pd["optimizer"] + step_counter + batch_bytes
    total = sum(row.bytes for row in r.params)
    assert pd["params"] == (total if strategy == "dp" else total // 8)
    # Adam's two moments mirror the parameters; its step count is one replicated int32.
    assert pd["optimizer"] == 2 * pd["params"] + 4


def test_data_parallel_all_reduces_exactly_the_gradients(mlp):
    r = _report(mlp, "dp", {"data": 8})
    (ar,) = [c for c in r.collectives if c.kind == "all-reduce"]
    grads = sum(row.bytes for row in r.params)
    assert ar.axes == ("data",) and ar.group_size == 8
    assert ar.bytes == grads + 4  # the gradients plus the scalar loss
    assert ar.traffic_bytes == int(2 * 7 / 8 * ar.bytes)


def test_fsdp_gathers_every_parameter(mlp):
    r = _report(mlp, "fsdp", {"fsdp": 8})
    gathers = [c for c in r.collectives if c.kind == "all-gather"]
    assert sum(c.bytes for c in gathers) == sum(row.bytes for row in r.params)
    assert all(c.axes == ("fsdp",) for c in gathers)


def test_the_compiled_matmul_flops_stand_next_to_the_models_6nt(mlp):
    r = _report(mlp, "dp", {"data": 8})
    kernels = sum(np.prod(row.shape) for row in r.params if row.path.endswith("/kernel"))  # all but the embedding
    tokens = BATCH * mlp.config.seq_len
    assert r.model_flops == 6 * kernels * tokens / 8
    assert r.compiled_flops == r.model_flops  # no attention, no recompute: the program does 6·N·T, all of it
    assert r.to_dict()["model_flops_per_device"] == r.model_flops
    assert "(1.00× 6·N·T)" in re.sub(r"\s+", " ", str(r))


def test_collectives_inside_the_layer_scan_count_once_per_layer():
    counts = {}
    for layers in (2, 4, 6):
        r = _report(models.get("gpt-tiny", layers=layers), "fsdp", {"fsdp": 8})
        counts[layers] = sum(c.count for c in r.collectives if c.kind == "all-gather")
    # Same program text for every depth; the while loop's trip count makes the difference, linearly.
    assert counts[4] - counts[2] == counts[6] - counts[4] > 0


def test_report_renders_as_json_terminal_tables_and_html(mlp):
    r = _report(mlp, "dp", {"data": 8})
    d = r.to_dict()
    assert d["mesh"] == {"axes": {"data": 8}, "devices": 8}
    assert [row["path"] for row in d["params"]][:1] == ["params/embed/embedding"]
    html = r._repr_html_()
    assert html.startswith("<pre") and "params/embed/embedding" in html and "<body" not in html
    assert "Collectives the compiler generated" in str(r)  # print(report) shows the tables
    assert repr(r) == "Report(mesh data=8; batch over data; parameters replicated; 4 params; 1 collectives)"
    from rich.console import Console

    console = Console(record=True, width=140)
    console.print(r)
    text = console.export_text()
    assert "Collectives the compiler generated" in text and "all-reduce" in text


def test_large_replicated_parameters_are_warned_about():
    big = models.get("mlp", vocab=4096)  # a 4096 × 64 embedding: 1 MiB, replicated by dp
    r = _report(big, "dp", {"data": 8})
    assert any("params/embed/embedding" in w and "fully replicated" in w for w in r.warnings)
    r = _report(big, "fsdp", {"fsdp": 8})
    assert not any("fully replicated" in w for w in r.warnings)


def test_sequence_parallel_turns_tensor_all_reduces_into_reduce_scatter_and_all_gather():
    model = models.get("gpt-tiny", layers=2)
    tp = _report(model, "dp+tp", {"data": 2, "tensor": 4})
    sp = _report(model, "dp+sp", {"data": 2, "tensor": 4})

    def on_tensor(r, kind):
        return sum(c.count for c in r.collectives if c.kind == kind and c.axes == ("tensor",))

    assert on_tensor(tp, "reduce-scatter") == 0 and on_tensor(tp, "all-gather") == 0
    assert on_tensor(sp, "reduce-scatter") >= on_tensor(tp, "all-reduce") - on_tensor(sp, "all-reduce") > 0
    assert on_tensor(sp, "all-gather") > 0
    # Norm-region activations split over the sequence: less scratch memory per device.
    assert sp.compiled_memory["temp_bytes"] < 0.8 * tp.compiled_memory["temp_bytes"]
    # The cost model reads the activation all-reduces off the split matmuls: it agrees with the compiler.
    for r in (tp, sp):
        comm = r.comm_bytes_per_step
        assert 0.95 <= comm["compiled"] / comm["analytic"] <= 1.05, comm
        assert not any("collective traffic" in w for w in r.warnings)
    kinds = {(t.kind, t.axes) for t in sp.analytic_collectives}
    assert {("reduce-scatter", ("tensor",)), ("all-gather", ("tensor",))} <= kinds


def test_a_batch_without_token_arrays_is_reported_with_its_workload_unknown():
    # An image classifier: no [batch, seq] array to read a workload from. The compiled side is whole, the
    # analytic side is the parameters' (the gradient all-reduce, to the byte), and what needs the workload is None.
    import jax.numpy as jnp
    from flax import linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(16, (3, 3))(x))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    model, batch = CNN(), {"image": jnp.ones((16, 8, 8, 3)), "label": jnp.zeros((16,), jnp.int32)}

    def loss(params, b):
        logits = model.apply(params, b["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["label"]).mean()

    params = jax.eval_shape(model.init, jax.random.key(0), batch["image"])
    step = spmd.TrainStep(
        loss, optax.adam(1e-3), strategies.data_parallel(), spmd.make_mesh({"data": 8}), params=params
    )
    r = spmd.report(step, batch)
    d = r.to_dict()
    assert d["flops_per_device"] is None and d["modelled_step_time"] is None
    assert d["analytic_memory"]["argument_bytes"] == d["compiled_memory"]["argument_bytes"]
    assert "temp_bytes" not in d["analytic_memory"]
    assert [(c.kind, c.axes) for c in r.collectives] == [("all-reduce", ("data",))]
    assert abs(d["comm_bytes_per_step"]["analytic"] - d["comm_bytes_per_step"]["compiled"]) <= 8
    assert any(w.startswith("workload unknown: the batch has no (batch, seq) token array") for w in r.warnings)
    # Given a workload, the analytic side is whole again.
    given = spmd.report(step, batch, workload=spmd.costmodel.Workload(batch=16, seq_len=64)).to_dict()
    assert given["flops_per_device"] > 0 and "temp_bytes" in given["analytic_memory"]


def test_the_terminal_view_prints_warnings_as_they_are(mlp):
    # A regex rule's brackets are not rich markup: the warning reads as the rule was written.
    plan = strategies.data_parallel() + spmd.Plan.from_rules([(r"no_such/w[io]/kernel", (None, None))])
    params = jax.eval_shape(mlp.init, jax.random.key(0))
    with pytest.warns(spmd.PlanWarning):
        step = spmd.TrainStep(models.loss_fn(mlp), optax.adam(1e-3), plan, spmd.make_mesh({"data": 8}), params=params)
        r = spmd.report(step, data.batch(0, 0, BATCH, mlp.config.seq_len, mlp.config.vocab))
    assert "rule 'no_such/w[io]/kernel' matched nothing" in str(r)


# ------------------------------------------------------------------- a token lookup on fsdp=4 × tensor=2


class Lookup:
    """An embedding lookup and two projections, laid out as a BERT-like model under fsdp + tensor parallelism."""

    def __init__(self):
        from flax import linen as nn

        class Model(nn.Module):
            @nn.compact
            def __call__(self, ids):
                x = nn.Embed(64, 32, name="word")(ids) + nn.Embed(512, 32, name="position")(jnp.arange(ids.shape[1]))
                return nn.Dense(64, name="head")(nn.Dense(64, name="up")(x))

        self.model, self.batch = Model(), {"input_ids": jnp.zeros((8, 16), jnp.int32)}
        self.params = jax.eval_shape(self.model.init, jax.random.key(0), self.batch["input_ids"])
        rules = [("up/kernel", (None, "tensor")), ("head/kernel", ("tensor", None))]
        # A rule naming an axis of one device, as MaxText's rules do: it splits nothing.
        self.plan = (
            strategies.fsdp()
            + strategies.tensor_parallel(rules=rules)
            + spmd.Plan.from_rules([("head/bias", ("expert",))])
        )
        # Two axes of one device, as a MaxText mesh has nine: the tables leave them out.
        self.mesh = spmd.make_mesh({"data": 1, "fsdp": 4, "tensor": 2, "expert": 1})
        self.tx = optax.adam(1e-3)
        self.step = spmd.TrainStep(self.loss, self.tx, self.plan, self.mesh, params=self.params)

    @functools.cached_property
    def lowered(self):
        return self.step.lower(self.batch)  # the training step's program, as jax hands over a step of your own

    def loss(self, params, batch):
        logits = self.model.apply(params, batch["input_ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["input_ids"]).mean()


@pytest.fixture(scope="module")
def lookup():
    return Lookup()


def test_a_group_over_part_of_an_axis_is_named_so_and_axes_of_one_device_are_left_out(lookup):
    r = spmd.report(lookup.step, lookup.batch)
    text = str(r)
    # XLA gathers the table over 2 of fsdp's 4 devices (its reading of the lookup), and reshards between two
    # device orders by collective-permutes whose pairs form cycles of 3 devices.
    (part,) = [c for c in r.collectives if c.spans]
    assert (part.kind, part.axes, part.spans, part.group_size) == ("all-gather", ("fsdp",), (2,), 2)
    assert "fsdp (2 of 4)" in text
    assert any(c.kind == "collective-permute" and c.axes == ("fsdp", "tensor") for c in r.collectives)
    assert "note: collective-permute over fsdp,tensor: its group is the most devices" in text
    assert "Plan on mesh fsdp=4 × tensor=2:" in text and "data=1" not in text and "expert" not in text.split("note")[0]
    assert "note: 2 mesh axes of size 1 not shown (data, expert)" in text
    assert re.search(r"params/head/bias +│ \(64,\) +│ float32 │ \(-\) ", text)
    d = r.to_dict()  # the JSON keeps every axis
    assert d["mesh"]["axes"] == {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
    assert next(row for row in d["params"] if row["path"] == "params/head/bias")["spec"] == ["expert"]


def test_a_step_of_your_own_is_reported_as_the_training_step_is(lookup):
    # The same program handed over as jax made it, with the plan, mesh, parameters and optimizer: the same report,
    # but for the training step's own int32 step counter in the analytic arguments.
    step = spmd.report(lookup.step, lookup.batch)
    own = spmd.report(
        lookup.lowered, lookup.batch, plan=lookup.plan, mesh=lookup.mesh, params=lookup.params,
        optimizer=lookup.tx,
    )  # fmt: skip
    assert own.params == step.params and own.collectives == step.collectives
    assert own.compiled_memory == step.compiled_memory and own.per_device_bytes == step.per_device_bytes
    assert own.analytic_memory["argument_bytes"] == step.analytic_memory["argument_bytes"] - 4
    assert own.compiled_flops == step.compiled_flops == step.flops_per_device  # the model ignores plan.remat
    # A lowered program does not show whether the model rematerialises: said, and the estimate takes the plan's
    # word (remat recomputes the layers of a layer stack: this model has none, so it adds no work here).
    assert any(w.startswith("remat: the plan asks for it") for w in own.warnings)
    assert "layers rematerialised" in repr(own) and "layers rematerialised" not in repr(step)
    assert own.flops_per_device == step.flops_per_device


def test_what_a_step_of_your_own_does_not_say_is_unknown(lookup):
    lowered = lookup.lowered
    bare = spmd.report(lowered, plan=lookup.plan, mesh=lookup.mesh)  # neither parameters nor batch
    assert not bare.layout_known and bare.params == () and bare.per_device_bytes == {}
    assert bare.comm_bytes_per_step["analytic"] is None and bare.comm_bytes_per_step["compiled"] > 0
    assert bare.compiled_memory["argument_bytes"] > 0 and bare.compiled_flops > 0
    assert any(w.startswith("parameters unknown: pass params=") for w in bare.warnings)
    assert "unknown: pass params=" in str(bare)
    no_tx = spmd.report(lowered, lookup.batch, plan=lookup.plan, mesh=lookup.mesh, params=lookup.params)
    assert set(no_tx.per_device_bytes) == {"params", "grads"} and "argument_bytes" not in no_tx.analytic_memory
    assert any(w.startswith("optimizer unknown") for w in no_tx.warnings)
    assert no_tx.params == spmd.report(lookup.step, lookup.batch).params
    # Parameters given as arrays placed otherwise than the plan asks: said, per array.
    replicated = NamedSharding(lookup.mesh, P())
    placed = jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), replicated), lookup.params)
    r = spmd.report(lowered, lookup.batch, plan=lookup.plan, mesh=lookup.mesh, params=placed, optimizer=lookup.tx)
    assert "params/up/kernel is laid out as P() and the plan asks P('fsdp', 'tensor')" in {
        w.split(":")[0] for w in r.warnings
    }
    assert not any("head/bias is laid out" in w for w in r.warnings)  # P("expert") over one device: the same
    shardings = lookup.plan.shardings(lookup.params, lookup.mesh)
    placed = jax.tree.map(lambda a, s: jax.device_put(np.zeros(a.shape, a.dtype), s), lookup.params, shardings)
    r = spmd.report(lowered, lookup.batch, plan=lookup.plan, mesh=lookup.mesh, params=placed, optimizer=lookup.tx)
    assert not any("is laid out as" in w for w in r.warnings)


def test_an_illegal_call_is_a_clear_error(lookup):
    lowered = lookup.lowered
    with pytest.raises(TypeError, match="a TrainStep carries its plan, mesh, parameters and optimizer.*drop plan="):
        spmd.report(lookup.step, lookup.batch, plan=lookup.plan)
    with pytest.raises(TypeError, match=r"train_step.trace\(params, opt_state, batch\).*got a function, which jax"):
        spmd.report(jax.jit(lookup.loss), lookup.batch, plan=lookup.plan, mesh=lookup.mesh)
    with pytest.raises(TypeError, match="needs the spmd.Plan and the jax Mesh it was laid out by; got plan=NoneType"):
        spmd.report(lowered, lookup.batch)
    with pytest.raises(spmd.PlanError, match="rules uses mesh axis 'expert', but the mesh has only fsdp=2,tensor=2"):
        spmd.report(lowered, plan=lookup.plan, mesh=spmd.make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4]))
    four = spmd.make_mesh({"data": 1, "fsdp": 2, "tensor": 2, "expert": 1}, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match="the program runs on 8 devices and the mesh .* has 4"):
        spmd.report(lowered, plan=lookup.plan, mesh=four)
    with pytest.raises(TypeError, match="optimizer= takes an optax transformation"):
        spmd.report(lowered, plan=lookup.plan, mesh=lookup.mesh, params=lookup.params, optimizer="adam")
    # A program jitted without shardings runs on one device: not the 8-device plan's program.
    alone = jax.jit(lookup.loss).lower(lookup.params, lookup.batch)
    with pytest.raises(ValueError, match="the program runs on 1 devices and the mesh .* has 8"):
        spmd.report(alone, plan=lookup.plan, mesh=lookup.mesh)


@pytest.mark.slow
def test_a_pipeline_counts_the_matmuls_of_the_branches_each_tick_runs():
    # A pipeline's ticks switch between stage programs: counted as they run, not every branch on every tick.
    model = models.get("gpt-tiny", layers=2)
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = data.batch(0, 0, 8, model.config.seq_len, model.config.vocab)
    mesh = spmd.make_mesh({"stage": 2}, devices=jax.devices()[:2])
    plan = strategies.pipeline("gpipe", stages=2, microbatches=2)
    step = spmd.TrainStep(models.loss_fn(model), optax.sgd(0.1), plan, mesh, params=params, staged=model.staged)
    r = spmd.report(step, batch)
    every_branch = matmul_flops(step.compile(batch).as_text())
    # Each of the 3 ticks runs one stage (or idles) per device: at most half the model's work per microbatch.
    assert r.flops_per_device <= r.compiled_flops <= 1.5 * r.flops_per_device < every_branch
