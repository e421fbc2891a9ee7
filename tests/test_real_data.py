"""The README's "Real data" section runs as written: a grain pipeline feeding a TrainStep through
spmd.global_batch, in one process and as two processes under spmd launch (each reading its own half), equal to
one device on the same global batches; and a loss taking key and step, sharded equal to one device."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grain
import jax
import numpy as np
import optax
import pytest

import spmd
import strategies
from spmd import data, models
from tests.conftest import assert_trees_close

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _blocks():
    section = README.read_text().split("## Real data\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def one_device_run(batches):
    """The README block's model and optimizer trained on one device on ``batches``: losses and parameters."""
    model = models.get("mlp")
    mesh = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    params = jax.eval_shape(model.init, jax.random.key(0))
    step = spmd.TrainStep(models.loss_fn(model), optax.sgd(0.1), spmd.Plan(), mesh, params=params)
    state, losses = step.init(model.init, jax.random.key(0)), []
    for batch in batches:
        state, loss = step(state, batch)
        losses.append(float(loss))
    return losses, jax.device_get(state.params)


@pytest.fixture(scope="module")
def grain_block():
    namespace: dict = {}
    exec(compile(_blocks()[0], "README.md (real data, block 1)", "exec"), namespace)
    return namespace


def test_the_readme_grain_pipeline_trains_equal_to_one_device(grain_block):
    batches = list(grain_block["dataset"])
    assert len(batches) == 3 and batches[0]["tokens"].shape == (32, models.get("mlp").config.seq_len)
    losses, params = one_device_run(batches)
    np.testing.assert_allclose(grain_block["losses"], losses, rtol=1e-5)
    assert_trees_close(jax.device_get(grain_block["state"].params), params)


def test_a_grain_data_loader_sharded_by_process_feeds_fsdp_equal_to_one_device():
    model = models.get("mlp")
    records = data.batch(1, 0, 64, model.config.seq_len, model.config.vocab)["tokens"]
    sampler = grain.samplers.IndexSampler(
        num_records=len(records), shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True), seed=0,
        shuffle=True, num_epochs=1,
    )  # fmt: skip
    loader = grain.DataLoader(
        data_source=records, sampler=sampler, operations=[grain.transforms.Batch(16, drop_remainder=True)],
        worker_count=0,
    )  # fmt: skip
    batches = [{"tokens": b} for b in loader]
    assert len(batches) == 4
    mesh = spmd.make_mesh({"fsdp": 8})
    params = jax.eval_shape(model.init, jax.random.key(0))
    step = spmd.TrainStep(models.loss_fn(model), optax.sgd(0.1), strategies.fsdp(), mesh, params=params)
    state, losses = step.init(model.init, jax.random.key(0)), []
    for local in batches:
        batch = spmd.global_batch(local, step)
        assert batch["tokens"].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
        state, loss = step(state, batch)
        losses.append(float(loss))
    ref_losses, ref_params = one_device_run(batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(jax.device_get(state.params), ref_params)


def test_a_local_batch_that_is_not_a_whole_share_is_refused(grain_block):
    step = grain_block["step"]
    with pytest.raises(
        ValueError, match=r"process 0 holds 8 of the 8 row blocks .* needs a multiple of 8 rows; got 12"
    ):
        spmd.global_batch({"tokens": np.zeros((12, 32), np.int32)}, step)
    with pytest.raises(ValueError, match=r"the same leading \(batch\) dimension; got shapes \[\(8, 32\), \(16, 32\)\]"):
        spmd.global_batch({"a": np.zeros((8, 32)), "b": np.zeros((16, 32))}, step)


EPILOGUE = """
import json, os
import numpy as np
out = os.environ["REAL_DATA_OUT"]
np.save(f"{out}/rows{jax.process_index()}.npy", np.stack([b["tokens"] for b in dataset]))
if jax.process_index() == 0:
    json.dump({"losses": losses, "processes": jax.process_count()}, open(f"{out}/losses.json", "w"))
"""


@pytest.mark.slow  # two processes starting JAX and gloo: 15 s on idle cores, 40 s on busy ones
def test_under_spmd_launch_each_process_reads_its_half_and_the_run_equals_one_device(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_blocks()[0] + EPILOGUE)
    cmd = [sys.executable, "-m", "spmd", "launch", "--processes", "2", "--devices-per-process", "4", "--",
           sys.executable, str(script)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**ENV, "REAL_DATA_OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "losses.json").read_text())
    assert result["processes"] == 2
    halves = [np.load(tmp_path / f"rows{i}.npy") for i in range(2)]
    assert halves[0].shape == halves[1].shape == (3, 16, models.get("mlp").config.seq_len)
    # Disjoint halves that together are every record once.
    model = models.get("mlp")
    records = data.batch(0, 0, 96, model.config.seq_len, model.config.vocab)["tokens"]
    read = np.concatenate([h.reshape(-1, h.shape[-1]) for h in halves])
    assert sorted(map(bytes, read)) == sorted(map(bytes, records))
    # The global batch of step i is process 0's rows, then process 1's.
    batches = [{"tokens": np.concatenate([halves[0][i], halves[1][i]])} for i in range(3)]
    losses, _ = one_device_run(batches)
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)


def test_the_readme_dropout_block_runs_and_equals_one_device():
    namespace: dict = {}
    exec(compile(_blocks()[1], "README.md (real data, block 2)", "exec"), namespace)
    sharded, one = namespace["sharded"], namespace["one"]
    assert len(set(sharded)) == 3
    np.testing.assert_allclose(sharded, one, rtol=1e-5)
