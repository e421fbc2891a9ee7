"""Meshes from logical names, device emulation, and the --mesh parser."""

import subprocess
import sys

import jax
import pytest
from jax.sharding import AxisType

import spmd


def test_make_mesh_names_sizes_and_auto_axes():
    mesh = spmd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    assert spmd.make_mesh({"data": 8}, explicit=True).axis_types == (AxisType.Explicit,)


def test_one_size_may_be_inferred():
    assert dict(spmd.make_mesh({"data": -1, "tensor": 2}).shape) == {"data": 4, "tensor": 2}
    with pytest.raises(ValueError, match="more than one axis of size -1"):
        spmd.make_mesh({"data": -1, "tensor": -1})
    with pytest.raises(ValueError, match=r"cannot infer 'data' in mesh data=-1,tensor=3: 8 devices"):
        spmd.make_mesh({"data": -1, "tensor": 3})


def test_product_must_match_the_devices():
    with pytest.raises(ValueError, match=r"mesh data=5 needs 5 devices but 8 are present"):
        spmd.make_mesh({"data": 5})
    with pytest.raises(ValueError, match=r"axis 'data' has size 0"):
        spmd.make_mesh({"data": 0})


def test_hybrid_mesh_with_dcn_axis():
    # One process here, so the single granule holds all devices and a dcn split of 2 cannot be laid out;
    # a dcn split of 1 gives the ordinary mesh, and bad splits are rejected before any layout.
    mesh = spmd.make_mesh({"data": 2, "tensor": 4}, dcn={"data": 1})
    assert dict(mesh.shape) == {"data": 2, "tensor": 4}
    with pytest.raises(ValueError, match=r"dcn size 3 for axis 'data' does not divide its total size 2"):
        spmd.make_mesh({"data": 2, "tensor": 4}, dcn={"data": 3})
    with pytest.raises(ValueError, match=r"dcn axes \['stage'\] are not mesh axes"):
        spmd.make_mesh({"data": 8}, dcn={"stage": 2})


def test_parse_mesh_errors():
    assert spmd.parse_mesh("data=2, fsdp=2,tensor=2") == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match=r"cannot read 'data2'"):
        spmd.parse_mesh("data2")
    with pytest.raises(ValueError, match=r"axis 'data' appears twice"):
        spmd.parse_mesh("data=2,data=4")
    with pytest.raises(ValueError, match=r"axis 'data' has size -3"):
        spmd.parse_mesh("data=-3")


@pytest.mark.parametrize(
    "axes,message",
    [
        ({"data": 1, None: 8}, r"axis name None must be an identifier"),
        ({"None": 8}, r"axis name 'None' must be an identifier .* not a Python keyword"),
        ({"": 8}, r"axis name '' must be an identifier"),
        ({"1x": 8}, r"axis name '1x' must be an identifier"),
        ({"data": 8.0}, r"axis 'data' has size 8.0; sizes are positive integers"),
        ({"data": True}, r"axis 'data' has size True"),
        ({}, r"mesh \{\} must map axis names to sizes"),
        ([("data", 8)], r"must map axis names to sizes"),
    ],
)
def test_make_mesh_rejects_names_and_sizes_with_an_example(axes, message):
    with pytest.raises(ValueError, match=message + r".*e\.g\. \{'data': 2, 'tensor': 4\}"):
        spmd.make_mesh(axes)


@pytest.mark.parametrize(
    "text,message",
    [
        ("data=1,None=2", r"mesh 'data=1,None=2': axis name 'None' must be an identifier"),
        ("1x=2", r"axis name '1x' must be an identifier"),
        ("=2", r"axis name '' must be an identifier"),
        ("data=-1,fsdp=-1", r"more than one axis of size -1"),
        ("data=2,,", r"cannot read ''"),
    ],
)
def test_parse_mesh_rejects_names_and_sizes_with_an_example(text, message):
    with pytest.raises(ValueError, match=message + r".*e\.g\. data="):
        spmd.parse_mesh(text)


def test_a_mesh_too_large_to_emulate_is_not_offered_emulation():
    with pytest.raises(ValueError, match=r"or --devices 16 with the spmd command"):
        spmd.make_mesh({"data": 16})
    with pytest.raises(ValueError, match=r"make the sizes multiply to 8 \(or use -1 for one axis\)$"):
        spmd.make_mesh({"data": 4096})


def test_in_a_multi_process_job_more_devices_come_from_the_launcher(monkeypatch):
    # Under spmd launch a process's --devices is refused: the advice names the launcher's flags instead.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"start the job with 16 devices in all \(under spmd launch: --processes") as e:
        spmd.make_mesh({"data": 16})
    assert "--devices 16" not in str(e.value) and "emulate" not in str(e.value)


def test_emulate_devices_after_backend_start_says_how_to_fix():
    assert len(jax.devices()) == 8
    spmd.emulate_devices(8)  # what is already there: fine
    with pytest.raises(RuntimeError, match=r"already started with 8 cpu device\(s\).*XLA_FLAGS"):
        spmd.emulate_devices(4)


def test_emulate_devices_before_backend_start():
    code = "import spmd, jax; spmd.emulate_devices(4); print(len(jax.devices()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "4"
