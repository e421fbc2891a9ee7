"""Bad input from files and flags: every case ends in exit status 2 and one line on stderr that names what is
wrong (the file, the field, the text) and how to fix it; never a traceback, never a silently wrong result."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent


def one_error_line(code, err, message):
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("spmd: error: ") and re.search(message, err), err


# ----------------------------------------------------------------------------------------- schedule tables
TABLES = [  # (file name, its bytes, what the error says)
    ("list.json", b"[1, 2, 3]", r"schedule file \S*list.json: expected an object with microbatches and actions"),
    (
        "keys.json",
        b'{"x": 1}',
        r"keys.json: missing field 'microbatches'; give an object with microbatches and actions",
    ),
    ("rows.json", b'{"microbatches": 2, "actions": "F0"}', r"rows.json: .*actions must hold one list of actions"),
    ("cells.json", b'{"microbatches": 1, "actions": [[1, 2]]}', r"cells.json: .*position 0: action 1 must be"),
    ("count.json", b'{"microbatches": "2", "actions": [["F0"]]}', r"count.json: .*microbatches must be a positive"),
    ("bool.json", b'{"microbatches": true, "actions": [["F0", "BW0"]]}', r"microbatches must be a positive integer"),
    ("virtual.json", b'{"microbatches": 1, "virtual": 0, "actions": [["F0"]]}', r"virtual .* must be a positive"),
    ("stages.json", b'{"microbatches": 1, "stages": 2, "actions": [["F0", "BW0"]]}', r"stages is 2 but actions has 1"),
    ("name.json", b'{"name": 5, "microbatches": 1, "actions": [["F0", "BW0"]]}', r"name must be a string, got 5"),
    ("syntax.json", b'{"microbatches": 1,', r"syntax.json: not valid JSON"),
    ("deep.json", b"[" * 100_000, r"deep.json: not valid JSON"),
    ("latin1.csv", b"F0,BW0\n\xff\n", r"latin1.csv: not UTF-8 text \(byte 0xff at offset 7\); save it as UTF-8"),
    ("cells.csv", b"F0,BW0\nF0,Q1\n", r"cells.csv: schedule cells, device 1, position 1: cannot read action 'Q1'"),
    ("wide.csv", b"F0," + b"x" * 200_000 + b"\n", r"wide.csv: schedule wide: not a CSV table \(field larger than"),
    ("empty.csv", b"\n,,\n", r"empty.csv: schedule empty: the table is empty"),
    ("huge.csv", b"F" + b"9" * 5000 + b"\n", r"huge.csv: .*cannot read action"),
    (
        "order.csv",
        b"BW0,F0\nF0,BW0\n",
        r"schedule order: device 0, position 0: BW\(microbatch 0, chunk 0\) comes before",
    ),
]


@pytest.mark.parametrize("name,content,message", TABLES, ids=[t[0] for t in TABLES])
def test_bad_schedule_tables(capsys, tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    code, _, err = run_cli(capsys, "schedule", "--schedule", str(tmp_path / name))
    one_error_line(code, err, message)


def test_a_schedule_path_that_is_a_directory_or_unreadable(capsys, tmp_path):
    (tmp_path / "dir.json").mkdir()
    code, _, err = run_cli(capsys, "schedule", "--schedule", str(tmp_path / "dir.json"))
    one_error_line(code, err, r"dir.json: cannot read it \(Is a directory\); give a readable .json or .csv file")
    if os.getuid() != 0:  # root reads any file
        (tmp_path / "locked.csv").write_text("F0,BW0\n")
        (tmp_path / "locked.csv").chmod(0)
        code, _, err = run_cli(capsys, "schedule", "--schedule", str(tmp_path / "locked.csv"))
        one_error_line(code, err, r"locked.csv: cannot read it \(Permission denied\)")


@pytest.mark.parametrize(
    "costs", ["nan", "nan,1,1", "inf,1,1", "1,1,1,-inf", "1e400,1,1", "-1,1,1", "1,1", "1,1,1,1,1"]
)
def test_costs_must_be_three_or_four_finite_non_negative_numbers(capsys, costs):
    code, _, err = run_cli(capsys, "schedule", "--schedule", "gpipe", "--stages", "2", f"--costs={costs}")
    one_error_line(code, err, re.escape(f"--costs {costs!r}: give F,B,W (or F,B,W,comm) as finite non-negative"))


@pytest.mark.parametrize("flag", ["--stages", "--microbatches", "--virtual"])
def test_a_table_fixes_its_sizes_so_flags_for_them_are_refused(capsys, tmp_path, flag):
    (tmp_path / "t.csv").write_text("F0,BW0\nF0,BW0\n")
    code, _, err = run_cli(capsys, "schedule", "--schedule", str(tmp_path / "t.csv"), flag, "2")
    one_error_line(code, err, rf"{flag}: the schedule table \S*t.csv fixes it; remove the flag")


def test_costs_are_checked_before_a_table_is_read(capsys, tmp_path):
    code, _, err = run_cli(capsys, "schedule", "--schedule", str(tmp_path / "t.json"), "--costs", "nan,1,1")
    one_error_line(code, err, r"--costs 'nan,1,1'")


# ----------------------------------------------------------------------------------------- device profiles
PROFILES = [  # (the profile, what the error says)
    ([{"speed": 1}], r"expected \{\"devices\": \[\{\"kind\": \.\.\., \"speed\": \.\.\.\}, \.\.\.\]\}, got list"),
    ({"devices": []}, r"expected \{\"devices\""),
    ({"devices": [{"kind": "a"}] * 8}, r"device 0: missing field 'speed'"),
    ({"devices": [{"speed": "3"}] * 8}, r"device 0: speed must be a positive number \(relative throughput\), got '3'"),
    ({"devices": [{"speed": 1}] * 7 + [{"speed": None}]}, r"device 7: speed must be a positive number"),
    ({"devices": [{"speed": 1}] * 7 + [{"speed": float("nan")}]}, r"device 7: speed must be .*, got nan"),
    ({"devices": [{"speed": -2}] * 8}, r"device 0: speed must be a positive number .*, got -2"),
    ({"devices": [{"speed": True}] * 8}, r"device 0: speed must be a positive number .*, got True"),
    ({"devices": [{"speed": 1, "memory": [1]}] * 8}, r"device 0: memory must be a size like '80GiB'"),
    ({"devices": [{"speed": 1, "memory": "lots"}] * 8}, r"device 0: memory 'lots': give a positive size like 16GiB"),
    ({"devices": [{"speed": 1, "bandwidth": [1e9]}] * 8}, r"device 0: bandwidth must map mesh axes to bytes/s"),
    (
        {"devices": [{"speed": 1, "bandwidth": {"data": "x"}}] * 8},
        r"device 0: bandwidth of axis 'data' must be a positive",
    ),
    ({"devices": [{"speed": 1, "kind": 3}] * 8}, r"device 0: kind must be a string like 'h100', got 3"),
    ({"devices": [{"speed": 1, "memroy": "1GiB"}] * 8}, r"device 0: unknown field 'memroy'; the fields are kind, spe"),
    ({"devices": [{"speed": 1}] * 8, "speeds": [1]}, r"unknown field 'speeds'; a profile holds only devices"),
]


@pytest.mark.parametrize("profile,message", PROFILES, ids=[m[:30] for _, m in PROFILES])
def test_bad_device_profiles(capsys, tmp_path, profile, message):
    (tmp_path / "p.json").write_text(json.dumps(profile))
    code, _, err = run_cli(
        capsys, "plan", "--model", "mlp", "--mesh", "data=8", "--device-profile", f"{tmp_path}/p.json"
    )
    one_error_line(code, err, re.escape(f"--device-profile '{tmp_path}/p.json': ") + message)


def test_a_device_profile_path_that_is_a_directory_or_not_text(capsys, tmp_path):
    args = ["plan", "--model", "mlp", "--mesh", "data=8", "--device-profile"]
    (tmp_path / "dir.json").mkdir()
    code, _, err = run_cli(capsys, *args, str(tmp_path / "dir.json"))
    one_error_line(code, err, r"dir.json': cannot read it \(Is a directory\); give a readable JSON file")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe{}")
    code, _, err = run_cli(capsys, *args, str(tmp_path / "bin.json"))
    one_error_line(code, err, r"bin.json': not UTF-8 text")


def test_a_measured_profile_with_an_infinite_bandwidth_still_loads(tmp_path):
    # spmd profile on one device records an infinite all-reduce bandwidth (nothing to move): JSON's Infinity.
    from spmd.devices import Profile

    (tmp_path / "p.json").write_text('{"devices": [{"kind": "cpu", "speed": 1.5, "bandwidth": {"all": Infinity}}]}')
    assert Profile.load(str(tmp_path / "p.json")).devices[0].bandwidth == (("all", float("inf")),)


# ----------------------------------------------------------------------------------------- meshes and advice
@pytest.mark.parametrize(
    "mesh,message",
    [
        ("data=1,None=8", r"mesh 'data=1,None=8': axis name 'None' must be an identifier .* e.g. data=2,tensor=4"),
        ("1x=8", r"axis name '1x' must be an identifier"),
        ("=8", r"axis name '' must be an identifier"),
        ("data=-1,fsdp=-1", r"more than one axis of size -1"),
        ("data=2.5", r"cannot read 'data=2.5'; write axis=size pairs, e.g. data=2,tensor=4"),
    ],
)
def test_bad_meshes(capsys, mesh, message):
    code, _, err = run_cli(capsys, "plan", "--model", "mlp", "--mesh", mesh)
    one_error_line(code, err, message)


def test_mesh_size_advice_names_only_flags_the_command_takes(capsys):
    code, _, err = run_cli(capsys, "plan", "--model", "mlp", "--mesh", "data=16")
    one_error_line(code, err, r"make the sizes multiply to 8 .*or --devices 16 with the spmd command")
    code, _, err = run_cli(capsys, "plan", "--model", "mlp", "--mesh", "data=2048")
    one_error_line(code, err, r"needs 2048 devices but 8 are present; make the sizes multiply to 8 \(or use -1")
    assert "--devices" not in err  # more than the command would emulate


def test_demo_takes_no_mesh_so_its_advice_is_the_device_count():
    # A process of its own: this one's 8 devices are up and cannot become 4.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "spmd", "demo", "--devices", "4", "--steps", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    one_error_line(proc.returncode, proc.stderr, r"spmd demo runs on the mesh data=2,fsdp=2,tensor=2 of 8 devices")
    assert "run it with --devices 8" in proc.stderr and "--mesh" not in proc.stderr and "sizes" not in proc.stderr


def test_suggest_prints_a_run_command_with_the_flags_its_pick_depends_on():
    import types

    from spmd.cli.parser import check, parser
    from spmd.cli.suggest import _run_command

    args = parser().parse_args(
        ["suggest", "--model", "gpt-tiny", "--layers", "2", "--memory-per-device", "3MiB", "--devices", "16"]
    )
    check(args)
    flags = ("--remat", "dots", "--accumulate", "2", "--precision", "bf16")  # the policies the pick chose
    best = types.SimpleNamespace(mesh={"data": 16}, strategy="osdp", flags=flags)
    command = _run_command(args, best)
    assert command == (
        "spmd run --model gpt-tiny --mesh data=16 --strategy osdp --remat dots --accumulate 2 --precision bf16 "
        "--devices 16 --layers 2 --batch-size 32 --memory-per-device 3145728"
    )
    # and run accepts every flag of it
    run_args = parser().parse_args(command.split()[1:])
    check(run_args)
    assert run_args.devices == 16 and run_args.layers == 2 and run_args.memory_per_device == 3 << 20
    assert run_args.remat.kind == "dots" and run_args.accumulate == 2 and run_args.precision == "bf16"
    # A --remat given to suggest replaced every plan's own policy: the command keeps it.
    args = parser().parse_args(["suggest", "--memory-per-device", "3MiB", "--remat", "names:query_proj"])
    check(args)
    command = _run_command(args, types.SimpleNamespace(mesh={"data": 8}, strategy="zero3", flags=()))
    assert command.startswith("spmd run --model gpt-tiny --mesh data=8 --strategy zero3 --remat names:query_proj ")
