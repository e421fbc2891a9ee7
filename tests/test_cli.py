"""The command line: the JSON contract, the demo end to end, and one clear line for every user mistake."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import optax
import pytest

import spmd
from spmd import cli, costmodel, models
from tests.conftest import run_cli

MESH = ["--mesh", "data=2,fsdp=2,tensor=2"]


@pytest.fixture(scope="module")
def plan_json():
    # Run in-process once for the module; the suite's 8 devices are already up.
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(["plan", "--model", "gpt-tiny", *MESH, "--strategy", "dp+fsdp+tp", "--json", "--layers", "2"])
    assert code == 0
    return json.loads(buf.getvalue())


def test_plan_json_contract(plan_json):
    assert plan_json["mesh"]["axes"] == {"data": 2, "fsdp": 2, "tensor": 2}
    row = next(r for r in plan_json["params"] if r["path"] == "params/layers/mlp/wi/kernel")
    assert row["shape"] == [2, 64, 256] and row["dtype"] == "float32"
    assert row["spec"] == [None, "fsdp", "tensor"]
    assert row["bytes_per_device"] == 2 * 64 * 256 * 4 // 4
    pd = plan_json["per_device_bytes"]
    assert pd["total"] == pd["params"] + pd["grads"] + pd["optimizer"]
    assert pd["params"] == sum(r["bytes_per_device"] for r in plan_json["params"])
    assert {"argument_bytes", "temp_bytes", "output_bytes"} <= set(plan_json["compiled_memory"])
    kinds = {c["kind"] for c in plan_json["collectives"]}
    assert "all-reduce" in kinds and "all-gather" in kinds
    for c in plan_json["collectives"]:
        assert {"kind", "count", "bytes", "traffic_bytes", "axes"} <= set(c)
        assert set(c["axes"]) <= {"data", "fsdp", "tensor"} and c["count"] >= 1
    # The tensor-parallel all-reduces of activations run over the tensor axis.
    assert any(c["kind"] == "all-reduce" and c["axes"] == ["tensor"] for c in plan_json["collectives"])
    # A plain plan has no execution mode: no mode's figures either.
    assert plan_json["execution"] is None and "pipeline" not in plan_json and "subnet" not in plan_json


def test_run_check_json_matches_one_device(capsys):
    code, out, _ = run_cli(
        capsys,
        "run",
        "--model",
        "gpt-tiny",
        "--layers",
        "2",
        *MESH,
        "--strategy",
        "dp+fsdp+tp",
        "--steps",
        "3",
        "--check",
        "--json",
    )
    assert code == 0
    j = json.loads(out)
    assert len(j["losses"]) == 3 and len(j["reference_losses"]) == 3
    assert j["max_abs_diff"] <= 1e-4
    assert j["losses"][-1] < j["losses"][0]


def test_run_with_a_user_factory(capsys):
    code, out, _ = run_cli(
        capsys,
        "run",
        "--model",
        "tests.test_third_party_lm:factory",
        "--mesh",
        "fsdp=8",
        "--strategy",
        "fsdp",
        "--steps",
        "2",
        "--json",
    )
    assert code == 0, out
    assert len(json.loads(out)["losses"]) == 2


def test_the_spmd_command_finds_a_user_module_in_the_working_directory(tmp_path):
    # The console script's own directory, not the working one, starts its path (python -P here): a module beside
    # the user is still found, as under `python -m spmd`.
    (tmp_path / "mymodule.py").write_text(Path(__file__).with_name("test_third_party_lm.py").read_text())
    entry = "import sys; from spmd.cli import command_line; sys.argv[0] = 'spmd'; command_line()"
    args = ["plan", "--model", "mymodule:factory", "--mesh", "data=8", "--json"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    r = subprocess.run(
        [sys.executable, "-P", "-c", entry, *args], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"] == "mymodule:factory"


def test_compare_rows_and_plot(capsys, tmp_path):
    plot = tmp_path / "compare.png"
    code, out, _ = run_cli(
        capsys,
        "compare",
        "--model",
        "gpt-tiny",
        "--layers",
        "2",
        "--mesh",
        "data=8",
        "--strategies",
        "dp,zero3",
        "--timed-steps",
        "2",
        "--json",
        "--plot",
        str(plot),
    )
    assert code == 0
    rows = json.loads(out)
    assert [r["strategy"] for r in rows] == ["dp", "zero3"]
    for r in rows:
        assert {"per_device_bytes", "compiled_memory", "collectives", "comm_bytes_per_step", "step_time_s"} <= set(r)
        assert set(r["comm_bytes_per_step"]) == {"compiled", "analytic"} and r["step_time_s"] > 0
        assert r["per_device_bytes"]["total"] == sum(r["per_device_bytes"][k] for k in ("params", "grads", "optimizer"))
        assert r["modelled_step_time"]["total_s"] > 0 and r["analytic_memory"]["argument_bytes"] > 0
    assert rows[1]["per_device_bytes"]["total"] < rows[0]["per_device_bytes"]["total"]
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


BAD = [
    (["plan", "--mesh", "data=5", "--strategy", "dp"], r"mesh data=5 needs 5 devices but 8 are present"),
    (
        ["plan", "--mesh", "data=8", "--strategy", "nope"],
        r"unknown strategy 'nope'; choose from dp, fsdp, tp, ",
    ),
    (
        ["plan", "--mesh", "data=8", "--strategy", "tp"],
        r"tensor_parallel uses mesh axis 'tensor', but the mesh has",
    ),
    (["plan", "--mesh", "data=2,data=4"], r"axis 'data' appears twice"),
    (["plan", "--mesh", "data:8"], r"cannot read 'data:8'"),
    (["plan", "--mesh", "data=-2,fsdp=4"], r"axis 'data' has size -2"),
    (["plan", "--model", "gpt-huge"], r"unknown model 'gpt-huge'"),
    (["plan", "--model", "no_such_pkg.mod:make"], r"could not import 'no_such_pkg.mod'"),
    (["run", "--steps", "0"], r"--steps must be a positive integer, got 0"),
    (["run", "--steps", "-3"], r"--steps must be a positive integer, got -3"),
    (
        ["plan", "--mesh", "data=8", "--batch-size", "12"],
        r"batch of shape \(12, 32\) cannot be split .* \(8 ways\)",
    ),
    (["plan", "--frobnicate"], r"unrecognized arguments: --frobnicate"),
    (["compare", "--mesh", "data=8", "--strategies", "dp,zero9"], r"unknown strategy 'zero9'"),
    (["suggest"], r"suggest needs --memory-per-device \(e.g. 16GiB\)"),
    (["suggest", "--memory-per-device", "lots"], r"--memory-per-device 'lots': give a positive size like 16GiB"),
    (["plan", "--mesh", "data=8", "--strategy", "osdp"], r"osdp chooses what to shard under a memory budget"),
    (
        ["plan", "--mesh", "data=8", "--strategy", "osdp", "--memory-per-device", "64KiB", "--layers", "1"],
        r"osdp: even with every parameter sharded over 'data' a device needs",
    ),
    (["plan", "--mesh", "data=8", "--block", "128"], r"block alignment \(128 rows\) applies to parameter splits"),
    (["plan", "--mesh", "tensor=8", "--strategy", "tp2d"], r"uses mesh axis 'tensor2', but the mesh has only"),
    (["plan", "--device-kind", "tpu-v9"], r"unknown device kind 'tpu-v9'; choose from tpu-v5e"),
    (["plan", "--axis-bandwidth", "tensor"], r"--axis-bandwidth 'tensor': give axis=GB/s pairs"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_user_mistakes_exit_2_with_one_line(capsys, args, message):
    import re

    code, out, err = run_cli(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spmd: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in err


def test_non_divisible_tensor_split_names_path_and_ways_out(capsys):
    # 4 heads cannot be split 8 ways: the error names the array, the axis, and the two fixes.
    code, _, err = run_cli(capsys, "plan", "--mesh", "tensor=8", "--strategy", "tp", "--layers", "1")
    assert code == 2
    assert "params/layers/attn/key/kernel" in err and "not divisible by mesh axes ('tensor',) of size 8" in err
    assert "allow_replication" in err


def test_demo_end_to_end_in_a_subprocess():
    """The README's main command, as a user runs it."""
    r = subprocess.run(
        [sys.executable, "-m", "spmd", "demo", "--steps", "4"], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    for expected in (
        "Plan on mesh data=2 × fsdp=2 × tensor=2",
        "Memory per device",
        "Collectives the compiler",
        "summary",
        "sharded how",
        "matches the single-device run",
    ):
        assert expected in out, expected


def test_suggest_picks_a_plan_that_fits_where_dp_does_not(capsys):
    # gpt-tiny (2 layers) with Adam: data parallelism needs about 4 MiB per device, so a 3 MiB budget forces
    # sharding; the pick is confirmed by compiling it on the 8 devices.
    budget = 3 << 20
    code, out, _ = run_cli(
        capsys, "suggest", "--model", "gpt-tiny", "--layers", "2", "--memory-per-device", "3MiB",
        "--device-kind", "h100", "--confirm", "1", "--json",
    )  # fmt: skip
    assert code == 0
    j = json.loads(out)
    ranked = j["ranked"]
    dp = next(r for r in ranked if r["strategy"] == "dp" and r["mesh"] == {"data": 8})
    assert not dp["fits"] and dp["modelled"]["memory_bytes"] > budget
    pick = j["pick"]
    assert pick["fits"] and pick["confirmed"] and pick["compiled_memory"]["peak_bytes"] <= budget
    assert pick["strategy"] != "dp" and "fits 3.00 MiB" in j["why"] and "plain data parallelism needs" in j["why"]
    # Ranked: every fitting plan before every other, each group by modelled step time.
    fits = [r["fits"] for r in ranked]
    assert fits == sorted(fits, reverse=True)
    times = [r["modelled"]["step_time"]["total_s"] for r in ranked if r["fits"]]
    assert times == sorted(times)
    assert {r["strategy"] for r in ranked} >= {"dp", "zero1", "zero2", "zero3", "dp+fsdp", "dp+tp", "dp+sp"}


def test_suggest_searches_remat_accumulation_and_precision_with_the_strategies():
    # Data parallelism of gpt-tiny (2 layers) on 8 devices does not fit 4.7 MiB as it is; it does with its
    # activations cut: by remat or by microbatches. The search finds those, and prices each policy.
    from strategies import suggest

    model = models.get("gpt-tiny", layers=2)
    params = jax.eval_shape(model.init, jax.random.key(0))
    bf16 = spmd.Precision(compute="bfloat16", params="float32", gather="bfloat16")
    ranked, _ = suggest.rank(
        params, costmodel.Workload(64, 32), costmodel.HARDWARE["h100"], devices=8, memory_per_device=int(4.7 * 2**20),
        optimizer=optax.adam(1e-3), max_tensor=1, remats=("none", "full"), accumulations=(1, 2, 4),
        precisions=(None, bf16),
    )  # fmt: skip
    dp = {s.flags: s for s in ranked if s.strategy == "dp"}
    assert len(dp) == 2 * 3 * 2  # its own policy (none) and full; three accumulations; two precisions
    plain, full, micro = dp[()], dp["--remat", "full"], dp["--accumulate", "4"]
    assert not plain.fits and full.fits and micro.fits
    assert full.estimate.flops > plain.estimate.flops == micro.estimate.flops  # full remat recomputes the layers
    assert micro.estimate.activation_bytes == plain.estimate.activation_bytes / 4  # one microbatch's at a time
    half = dp["--precision", "bf16"].estimate
    assert half.comm_bytes == plain.estimate.comm_bytes / 2  # its gradients reduced in bf16
    assert dp["--precision", "bf16"].plan.precision == bf16 and micro.plan.accumulate == 4


def test_remat_is_claimed_only_where_the_model_applies_it(capsys):
    # fsdp asks the model to rematerialise its layers: the built-in GPT does, a user's factory need not.
    mesh = ["--mesh", "fsdp=8", "--strategy", "fsdp", "--json"]
    code, out, err = run_cli(capsys, "plan", "--model", "tests.test_third_party_lm:factory", *mesh)
    assert code == 0, err
    user = json.loads(out)
    assert "rematerialised" not in user["plan"]
    assert any(w.startswith("remat: the plan asks the model to rematerialise") for w in user["warnings"])
    code, out, err = run_cli(capsys, "run", "--model", "tests.test_third_party_lm:factory", "--steps", "1", *mesh)
    assert code == 0 and "rematerialised" not in json.loads(out)["plan"], err
    code, out, err = run_cli(capsys, "plan", "--layers", "1", *mesh)
    assert code == 0, err
    builtin = json.loads(out)
    assert builtin["plan"].endswith("layers rematerialised (matmul outputs saved)")
    assert not any(w.startswith("remat:") for w in builtin["warnings"])
