"""The README's "Your own loop" section runs as written: a linen loop with its own optax update and an nnx loop
with nnx.Optimizer, each laid out by a plan over 8 devices, equal to one device, and reported by spmd.report from
the step as jax made it."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest

import spmd
from tests.conftest import assert_trees_close

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks():
    section = README.read_text().split("## Your own loop\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


@pytest.mark.parametrize("index", [0, 1], ids=["linen-optax", "nnx-optimizer"])
def test_the_readme_loop_runs_and_equals_one_device(index, capsys):
    blocks = _blocks()
    assert len(blocks) == 2
    namespace: dict = {}
    exec(compile(blocks[index], f"README.md (your own loop, block {index + 1})", "exec"), namespace)
    out = capsys.readouterr().out
    assert "P('fsdp', 'tensor')" in out  # the printed layout is the plan's
    _check_the_report(namespace["report"], out)
    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    ref_losses, ref_model, _ = namespace["train"](one, spmd.Plan())
    losses, model = namespace["losses"], namespace.get("params", namespace.get("model"))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Adam divides each update by its own running scale: a gradient entry that is only reduction-order noise
    # still moves its parameter by up to the learning rate (1e-3), so parameters get a tenth of it as floor.
    if index == 0:
        assert_trees_close(model, ref_model, rtol=1e-5, atol=1e-4)
    else:
        from flax import nnx

        assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), rtol=1e-5, atol=1e-4)


def _check_the_report(r, printed):
    # The plan's layout: the up-projection (64, 256) split over fsdp and tensor, a quarter per device.
    (up,) = [row for row in r.params if row.shape == (64, 256)]
    assert tuple(up.spec) == ("fsdp", "tensor") and up.bytes_per_device == 64 * 256 * 4 // 4
    assert "Plan on mesh data=2 × fsdp=2 × tensor=2" in printed and "(fsdp, tensor)" in printed
    assert not any("is laid out as" in w for w in r.warnings)  # nnx's placed parameters are as the plan asks
    # The compiled program: fsdp gathers the weights and scatters their gradients, data all-reduces.
    kinds = {(c.kind, c.axes) for c in r.collectives}
    assert {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)), ("all-reduce", ("data",))} <= kinds
    # Its arguments are the state the plan lays out plus the batch, to the byte up to the optimizer's counters.
    assert r.compiled_memory["temp_bytes"] > 0
    assert abs(r.compiled_memory["argument_bytes"] - r.analytic_memory["argument_bytes"]) <= 8
    # Matmul FLOPs: 4 tokens per device (16 over data and fsdp), 2 matmuls of 64·256 split over tensor; forward
    # 2, backward 4 FLOPs per multiply-add, less the first layer's input gradient, which nothing needs.
    per_token = 64 * 256 // 2
    assert r.compiled_flops == (2 + 4) * 4 * per_token + (2 + 2) * 4 * per_token
    assert r.flops_per_device == 2 * 6 * 4 * per_token  # the cost model counts both input gradients
