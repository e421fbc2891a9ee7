import jax

# Eight emulated CPU devices for every test; must happen before JAX's backend starts.
jax.config.update("jax_num_cpu_devices", 8)


import numpy as np  # noqa: E402

# Adam divides each update by its own running scale, so reduction-order noise in a near-zero gradient can move a
# parameter by a fraction of the learning rate: parameters are compared with an absolute floor of 1e-5.
PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-5


def assert_trees_close(actual, desired, rtol=PARAM_RTOL, atol=PARAM_ATOL, *, relative_to_max=False):
    """Leaf-wise allclose; ``relative_to_max`` scales atol by each leaf's largest magnitude (for gradient
    moments, where one gradient entry summed with cancellation carries noise relative to the others' size)."""
    a, b = jax.tree.leaves(actual), jax.tree.leaves(desired)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        tol = atol * max(float(np.max(np.abs(y), initial=0)), 1e-30) if relative_to_max else atol
        np.testing.assert_allclose(x, y, rtol=rtol, atol=tol)


def run_cli(capsys, *args):
    """``spmd`` with ``args`` in this process: its exit status, standard output and standard error."""
    from spmd.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def run_checked(capsys, mesh, strategy, speeds, batch_size):
    """``spmd run --check --json`` of gpt-tiny for 2 steps on ``mesh`` under ``strategy`` on devices of
    ``speeds``: its JSON, once the run exited 0."""
    import json

    code, out, err = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--mesh", mesh, "--strategy", strategy, "--device-speeds", speeds,
        "--batch-size", str(batch_size), "--steps", "2", "--check", "--json",
    )  # fmt: skip
    assert code == 0, err
    return json.loads(out)


def train_steps(model, plan, mesh, *, steps, batch_size):
    """``steps`` SGD-with-momentum steps of ``model`` under ``plan`` from seed 0 on the built-in data: the
    losses, the final state and the step. SGD with momentum: parameter differences are then the gradient
    differences times the step size, so a wrong reduction shows plainly (Adam would magnify reduction-order
    noise in near-zero gradients instead), and momentum gives an optimizer state to lay out as well."""
    import optax

    import spmd
    from spmd import data, models

    params = jax.eval_shape(model.init, jax.random.key(0))
    step = spmd.TrainStep(
        models.loss_fn(model),
        optax.sgd(0.1, momentum=0.9),
        plan,
        mesh,
        params=params,
        staged=model.staged,
        narrow=lambda sizes: models.loss_fn(models.narrowed(model, sizes)),
    )
    state = step.init(model.init, jax.random.key(0))
    losses = []
    for i in range(steps):
        state, loss = step(state, data.batch(0, i, batch_size, model.config.seq_len, model.config.vocab))
        losses.append(float(loss))
    return np.array(losses), state, step
