"""The README's "Your own loop" section runs as written: a linen loop with its own optax update and an nnx loop
with nnx.Optimizer, each laid out by a plan over 8 devices and equal to one device."""

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
    assert "P('fsdp', 'tensor')" in capsys.readouterr().out  # the printed layout is the plan's
    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    ref_losses, ref_model = namespace["train"](one, spmd.Plan())
    losses, model = namespace["losses"], namespace.get("params", namespace.get("model"))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Adam divides each update by its own running scale: a gradient entry that is only reduction-order noise
    # still moves its parameter by up to the learning rate (1e-3), so parameters get a tenth of it as floor.
    if index == 0:
        assert_trees_close(model, ref_model, rtol=1e-5, atol=1e-4)
    else:
        from flax import nnx

        assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), rtol=1e-5, atol=1e-4)
