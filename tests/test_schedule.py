"""Pipeline schedules as data: generators against the papers' closed forms, the validator's errors, the
simulator's timing, files, and the ``spmd schedule`` command."""

import json
from fractions import Fraction

import pytest

import strategies
from spmd.pipeline import (
    Action,
    Costs,
    Schedule,
    ScheduleError,
    gantt_text,
    simulate,
    simulate_lockstep,
    tick_table,
    validate,
)
from tests.conftest import run_cli


def bubble(name, p, m, v=None):
    return simulate(strategies.pipeline_schedule(name, stages=p, microbatches=m, virtual=v))


SIZES = [(2, 2), (2, 5), (3, 3), (4, 4), (4, 8), (4, 12), (5, 7), (8, 8), (8, 16)]


@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_and_1f1b_bubble_and_peak_in_flight(p, m):
    for name, peak in (("gpipe", m), ("1f1b", min(p, m))):
        t = bubble(name, p, m)
        assert t.bubble_fraction == Fraction(p - 1, m + p - 1), name
        assert t.peak_inflight[0] == peak and max(t.peak_inflight) == peak, (name, t.peak_inflight)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 12, 4), (3, 9, 2), (8, 16, 2)])
def test_interleaved_and_breadth_first_bubble(p, m, v):
    want = Fraction(p - 1, v * m + p - 1)
    assert bubble("interleaved", p, m, v).bubble_fraction == want
    assert bubble("bfs", p, m, v).bubble_fraction == want  # breadth-first matches it once m >= p
    # Breadth-first keeps every microbatch of a chunk in flight; interleaved 1F1B far fewer.
    assert max(bubble("bfs", p, m, v).peak_inflight) == m * v
    assert max(bubble("interleaved", p, m, v).peak_inflight) < m * v


@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 4), (4, 8), (5, 9), (8, 8), (8, 20)])
def test_zero_bubble_h1(p, m):
    t = bubble("zb-h1", p, m)
    assert t.bubble_fraction == Fraction(p - 1, 3 * m + p - 1)
    # Idle (p−1)(T_F + T_B − T_W) on the first device, at 1F1B's memory.
    assert t.idle[0] == p - 1
    assert t.peak_inflight == bubble("1f1b", p, m).peak_inflight and max(t.peak_held) == p


@pytest.mark.parametrize("p,m", [(2, 3), (3, 5), (4, 7), (4, 8), (5, 12), (8, 15), (8, 24)])
def test_zero_bubble_h2(p, m):
    t = bubble("zb-h2", p, m)
    assert t.bubble_fraction == 0
    assert max(t.peak_inflight) <= 2 * p - 1 and max(t.peak_held) == 2 * p - 1
    # With too few microbatches to fill the warm-up, a bubble remains.
    assert bubble("zb-h2", p, 2 * p - 2).bubble_fraction > 0


def test_costs_scale_the_bubble_and_comm_delays_the_neighbours():
    # GPipe with fused backward: the bubble is (p−1)/(m+p−1) whatever the F:BW ratio.
    assert (
        bubble("gpipe", 4, 8).bubble_fraction
        == simulate(
            strategies.pipeline_schedule("gpipe", stages=4, microbatches=8), Costs(F=1, B=2, W=3)
        ).bubble_fraction
    )
    # 2 stages, 1 microbatch, comm c: F [0,1]; F' [1+c, 2+c]; BW' [2+c, 4+c]; BW [4+2c, 6+2c].
    t = simulate(strategies.pipeline_schedule("1f1b", stages=2, microbatches=1), Costs(comm=0.5))
    assert t.makespan == 7 and t.starts[1] == (Fraction(3, 2), Fraction(5, 2))
    # ZB-H1's idle is (p−1)(T_F + T_B − T_W) for other costs too.
    t = simulate(strategies.pipeline_schedule("zb-h1", stages=4, microbatches=8), Costs(F=2, B=2, W=1))
    assert t.idle[0] == 3 * (2 + 2 - 1)
    # A chunk's op costs 1/v of a stage's.
    t = bubble("interleaved", 2, 2, 2)
    assert {
        e - s for row_s, row_e in zip(t.starts, t.ends, strict=True) for s, e in zip(row_s, row_e, strict=True)
    } == {
        Fraction(1, 2),
        Fraction(1),
    }
    with pytest.raises(ScheduleError, match="give F,B,W"):
        Costs.parse("1,2")


BROKEN = [  # (microbatches, per-device actions, the error)
    (1, (("F0", "BW0"), ("F0", "X0")), r"device 1, position 1: cannot read action 'X0'"),
    (
        1,
        (("F0", "BW0"), ("F0", "BW0", "F1", "BW1")),
        r"device 1, position 2: F\(microbatch 1, chunk 0\): microbatch out",
    ),
    (1, (("F0", "BW0", "F0"), ("F0", "BW0")), r"device 0, position 2: F\(microbatch 0, chunk 0\): repeats position 0"),
    (1, (("F0", "BW0"), ("F0",)), r"device 1: microbatch 0, chunk 0 has no B \(no backward at all\)"),
    (2, (("F0", "BW0"), ("F0", "BW0")), r"device 0: microbatch 1, chunk 0 has no F"),
    (1, (("F0", "B0", "W0"), ("F0", "B0")), r"device 1: microbatch 0, chunk 0 has no W; give BW, or both B and W"),
    (1, (("F0", "BW0", "W0"), ("F0", "BW0")), r"has BW and also B or W"),
    (
        1,
        (("F0", "W0", "B0"), ("F0", "B0", "W0")),
        r"device 0, position 1: W\(microbatch 0, chunk 0\) comes before its B",
    ),
    (1, (("BW0", "F0"), ("F0", "BW0")), r"device 0, position 0: BW\(microbatch 0, chunk 0\) comes before its F"),
]


@pytest.mark.parametrize("m,actions,message", BROKEN, ids=[m.split(":")[0][:40] for _, _, m in BROKEN])
def test_validator_names_device_position_and_action(m, actions, message):
    with pytest.raises(ScheduleError, match=message):
        validate(Schedule("t", m, actions))


def test_validator_finds_deadlocks():
    # A chunk's F placed before the F that makes its input (device 0 runs chunk 1 of microbatch 0 first).
    looped = (("F0.1", "F0", "BW0.1", "BW0"), ("F0", "F0.1", "BW0.1", "BW0"))
    needs = (
        r"device 0, position 0: F\(microbatch 0, chunk 1\) needs F\(microbatch 0, chunk 0\) \(device 1, position 0\)"
    )
    with pytest.raises(ScheduleError, match=needs + r" first.*deadlocks"):
        validate(Schedule("t", 1, looped, virtual=2))
    # A backward waiting for the next stage's backward, which waits in turn on a forward queued behind it.
    crossed = (("F0", "BW0", "F1", "BW1"), ("F1", "F0", "BW0", "BW1"))
    needs = r"device 0, position 1: BW\(microbatch 0, chunk 0\) needs BW\(microbatch 0, chunk 0\) \(device 1"
    with pytest.raises(ScheduleError, match=needs):
        validate(Schedule("t", 2, crossed))
    with pytest.raises(ScheduleError, match="for --virtual 2 use interleaved or bfs"):
        strategies.pipeline_schedule("1f1b", stages=4, microbatches=8, virtual=2)
    with pytest.raises(ScheduleError, match=r"microbatches divisible by stages \(6 by 4\)"):
        strategies.pipeline_schedule("interleaved", stages=4, microbatches=6, virtual=2)


def test_files_round_trip(tmp_path):
    s = strategies.pipeline_schedule("interleaved", stages=2, microbatches=4, virtual=2)
    assert Schedule.from_csv(s.to_csv(), name=s.name) == s
    assert Schedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    (tmp_path / "mine.csv").write_text("F0,F1,B0,W0,B1,W1\nF0,B0,F1,B1,W0,W1\n")
    loaded = Schedule.load(str(tmp_path / "mine.csv"))
    assert loaded.name == "mine" and loaded.microbatches == 2 and loaded.actions[1][2] == Action("F", 1)
    assert simulate(loaded).makespan == 7  # device 0: F0 F1 . B0 W0 B1 W1


def test_ticks_and_gantt():
    t = simulate(strategies.pipeline_schedule("1f1b", stages=2, microbatches=2), Costs(F=1, B=1, W=1, BW=1))
    ticks = t.ticks()
    assert [[str(a) if a else "." for a in row] for row in ticks] == [
        ["F0", "."], ["F1", "F0"], [".", "BW0"], ["BW0", "F1"], [".", "BW1"], ["BW1", "."]
    ]  # fmt: skip
    assert gantt_text(t).splitlines()[1].startswith("device 1 │ .   F0  BW0 F1  BW1")
    with pytest.raises(ScheduleError, match="exactly one time unit"):
        simulate(strategies.pipeline_schedule("1f1b", stages=2, microbatches=2)).ticks()


def test_cli_schedule_json_text_and_plot(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "schedule", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--json")
    j = json.loads(out)
    assert code == 0 and j["bubble_fraction"] == pytest.approx(3 / 27) and j["makespan"] == 27
    assert j["peak_inflight"] == [4, 3, 2, 1] and len(j["actions"]) == 4 and len(j["actions"][0]) == 24
    code, out, _ = run_cli(capsys, "schedule", "--schedule", "gpipe", "--stages", "2", "--microbatches", "2")
    assert code == 0 and "device 1 │ .   F0" in out and "bubble fraction 0.3333 (1/3)" in out
    plot = tmp_path / "g.png"
    code, _, _ = run_cli(capsys, "schedule", "--schedule", "bfs", "--virtual", "2", "--plot", str(plot), "--json")
    assert code == 0 and plot.read_bytes()[:4] == b"\x89PNG" and plot.stat().st_size > 10_000
    table = tmp_path / "t.csv"
    table.write_text("F0,BW0,F1,BW1\nF0,BW0,F1,BW1\n")
    code, out, _ = run_cli(capsys, "schedule", "--schedule", str(table), "--json")
    assert code == 0 and json.loads(out)["makespan"] == 12  # one microbatch at a time: no overlap


@pytest.mark.parametrize(
    "args,message",
    [
        (["--schedule", "zb-h9"], r"unknown schedule 'zb-h9'; choose from gpipe, 1f1b"),
        (["--schedule", "interleaved", "--microbatches", "6", "--virtual", "2"], r"divisible by stages \(6 by 4\)"),
        (["--microbatches", "0"], r"--microbatches must be a positive integer, got 0"),
        (["--costs", "1,x,1"], r"--costs '1,x,1': give F,B,W"),
        (["--schedule", "missing.csv"], r"--schedule 'missing.csv': no such file"),
    ],
)
def test_cli_schedule_mistakes(capsys, args, message):
    import re

    code, _, err = run_cli(capsys, "schedule", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


# ----------------------------------------------------------------------------------------- large tables
def reference_simulation(schedule, costs, scale=None):
    """The simulator as first written: sweep all devices until none can move (quadratic in the devices, so
    for small tables only); the linear one must give exactly its times."""
    p, v = schedule.stages, schedule.virtual
    grads = {
        (schedule.stage_of(d, a.chunk), a.microbatch): a.kind
        for d, row in enumerate(schedule.actions)
        for a in row
        if a.kind in ("B", "BW")
    }

    def needs(d, a):
        s = schedule.stage_of(d, a.chunk)
        at = lambda stage, kind: (schedule.where(stage)[0], Action(kind, a.microbatch, schedule.where(stage)[1]))  # noqa: E731
        if a.kind == "F":
            return [at(s - 1, "F")] if s else []
        if a.kind == "W":
            return [(d, Action("B", a.microbatch, a.chunk))]
        nxt = [at(s + 1, grads.get((s + 1, a.microbatch), "B"))] if s < p * v - 1 else []
        return [(d, Action("F", a.microbatch, a.chunk)), *nxt]

    ends, starts, position, free = {}, [[] for _ in range(p)], [0] * p, [Fraction(0)] * p
    while any(position[d] < len(row) for d, row in enumerate(schedule.actions)):
        moved = False
        for d, row in enumerate(schedule.actions):
            while position[d] < len(row) and all(n in ends for n in needs(d, row[position[d]])):
                a = row[position[d]]
                ready = [ends[n] + (costs.comm if n[0] != d else 0) for n in needs(d, a)]
                start = max([free[d], *ready])
                factor = Fraction(1) if scale is None else Fraction(scale[d][a.chunk])
                ends[d, a] = free[d] = start + getattr(costs, a.kind) / v * factor
                starts[d].append(start)
                position[d] += 1
                moved = True
        assert moved, "deadlock"
    return [tuple(s) for s in starts], [tuple(ends[d, a] for a in row) for d, row in enumerate(schedule.actions)]


@pytest.mark.parametrize("name", list(strategies.SCHEDULES))
def test_simulator_gives_the_reference_times(name):
    s = strategies.pipeline_schedule(
        name, stages=4, microbatches=8, virtual=2 if name in ("interleaved", "bfs") else None
    )
    v = s.virtual
    costs = Costs(F=1, B=Fraction(3, 2), W=0.5, comm=Fraction(1, 3))
    scale = [[1 + d] * v for d in range(4)]
    for args in ((Costs(), None), (costs, None), (costs, scale)):
        t = simulate(s, args[0], scale=args[1])
        assert (list(t.starts), list(t.ends)) == reference_simulation(s, *args)


def test_a_large_table_loads_validates_and_simulates(tmp_path):
    # 2,500 devices: the sweeping simulator took minutes on such a table; the answer is GPipe's closed form.
    p, m = 2500, 2
    (tmp_path / "big.csv").write_text(strategies.pipeline_schedule("gpipe", stages=p, microbatches=m).to_csv())
    s = validate(Schedule.load(str(tmp_path / "big.csv")))
    t = simulate(s)
    assert s.stages == p and sum(map(len, s.actions)) == 2 * m * p
    assert t.makespan == 3 * (m + p - 1) and t.bubble_fraction == Fraction(p - 1, m + p - 1)
    assert t.peak_inflight == (m,) * p and t.busy == (3 * m,) * p
    # and still finds a deadlock among 10,000 actions: the last device waits for F1 first, whose forward waits
    # behind a backward that needs the last device's BW0.
    rows = [list(map(str, row)) for row in s.actions]
    rows[-2], rows[-1] = ["F0", "BW0", "F1", "BW1"], ["F1", "F0", "BW0", "BW1"]
    (tmp_path / "bad.csv").write_text("\n".join(",".join(row) for row in rows))
    needs = (
        r"device 0, position 2: BW\(microbatch 0, chunk 0\) needs BW\(microbatch 0, chunk 0\) \(device 1, position 2\)"
    )
    with pytest.raises(ScheduleError, match=needs + " first.*deadlocks"):
        validate(Schedule.load(str(tmp_path / "bad.csv")))


# ------------------------------------------------------------------------------------ the V placement, ZB-V
def test_v_placement_maps_each_device_to_a_stage_going_down_and_one_coming_back():
    actions = (("F0", "F0.1", "B0.1", "W0.1", "B0", "W0"),) * 3
    s = Schedule("v", 1, actions, virtual=2, placement="v")
    assert [s.stage_of(d, c) for c in (0, 1) for d in range(3)] == [0, 1, 2, 5, 4, 3]
    assert [s.where(stage) for stage in range(6)] == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]
    assert Schedule("l", 1, actions, virtual=2).stage_of(2, 1) == 5  # looping: c·p + d


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"virtual": 3, "placement": "v"}, r"placement 'v' puts exactly two chunks on each device, but virtual is 3; "
         r"give virtual=2, or placement='loop'"),
        ({"placement": "zigzag"}, r"placement must be one of 'loop', 'v', got 'zigzag'; use 'loop'"),
    ],
)  # fmt: skip
def test_placement_mistakes(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        Schedule("t", 1, (("F0", "BW0"),), **kwargs)


def test_v_placement_survives_files(tmp_path):
    s = strategies.pipeline_schedule("zb-v", stages=3, microbatches=6)
    assert s.placement == "v" and s.to_dict()["placement"] == "v"
    assert Schedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    # A CSV table holds no placement: it is given again when read.
    assert Schedule.from_csv(s.to_csv(), name=s.name, placement="v") == s
    assert Schedule.from_csv(s.to_csv(), name=s.name).placement == "loop"
    (tmp_path / "zbv.json").write_text(json.dumps(s.to_dict()))
    (tmp_path / "zbv.csv").write_text(s.to_csv())
    assert Schedule.load(str(tmp_path / "zbv.json")).placement == "v"
    assert Schedule.load(str(tmp_path / "zbv.csv"), placement="v").actions == s.actions
    with pytest.raises(ScheduleError, match=r"zbv.json: placement is 'v' but 'loop' was asked for"):
        Schedule.load(str(tmp_path / "zbv.json"), placement="loop")
    with pytest.raises(ScheduleError, match=r"placement must be a string \('loop' or 'v'\), got 2"):
        Schedule.from_dict({"microbatches": 1, "actions": [["F0", "BW0"]], "placement": 2})


def test_comm_is_paid_between_devices_only():
    # ZB-V on 2 devices, one microbatch: stage 1 -> 2 stays on device 1, so its F and B pass without comm.
    s = strategies.pipeline_schedule("zb-v", stages=2, microbatches=1)
    t = simulate(s, Costs(F=2, B=2, W=2, comm=10))
    start = {(d, str(a)): st for d, row in enumerate(s.actions) for a, st in zip(row, t.starts[d], strict=True)}
    end = {(d, str(a)): e for d, row in enumerate(s.actions) for a, e in zip(row, t.ends[d], strict=True)}
    assert start[1, "F0"] == end[0, "F0"] + 10  # stage 0 -> 1: device 0 to 1
    assert start[1, "F0.1"] == end[1, "F0"]  # stage 1 -> 2: the same device
    assert start[0, "F0.1"] == end[1, "F0.1"] + 10  # stage 2 -> 3: back to device 0
    assert start[1, "B0.1"] == end[0, "B0.1"] + 10
    assert start[1, "B0"] == end[1, "W0.1"] < end[1, "B0.1"] + 10  # stage 2 -> 1: as soon as the device is free


ZBV_SIZES = [(p, m) for p in (2, 3, 4, 6) for m in (2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 4 * p)]


@pytest.mark.parametrize("p,m", ZBV_SIZES)
def test_zero_bubble_v_closed_forms(p, m):
    s = strategies.pipeline_schedule("zb-v", stages=p, microbatches=m)
    assert (s.virtual, s.placement) == (2, "v")
    t = simulate(s)  # T_F = T_B = T_W = 1 per stage, 1/2 per chunk
    assert t.bubble_fraction == 0 and t.idle == (0,) * p
    # Each device starts half a forward after the one before it and then never waits.
    assert t.makespan == 3 * m + Fraction(p - 1, 2)
    # 1F1B's peak, p microbatches of a whole stage, is 2p of half-stage chunks; ZB-V holds it on every device.
    assert t.peak_inflight == t.peak_held == (2 * p,) * p
    assert 2 * max(bubble("1f1b", p, m).peak_inflight) == 2 * p
    # Zero bubble whatever the common op time T: makespan m·3T + (p − 1)·T/2.
    t = simulate(s, Costs(F=3, B=3, W=3))
    assert t.idle == (0,) * p and t.makespan == 9 * m + Fraction(3 * (p - 1), 2)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zero_bubble_v_below_its_warm_up(p):
    # Fewer than 2p − 1 microbatches cannot fill the warm-up: the first device idles 2p − 1 − m units.
    for m in range(1, 2 * p - 1):
        t = bubble("zb-v", p, m)
        assert t.idle[0] == 2 * p - 1 - m and t.bubble_fraction == Fraction(2 * p - 1 - m, 2 * m + 2 * p - 1), m
        assert max(t.peak_inflight) <= 2 * p


def test_zero_bubble_v_is_always_two_chunks():
    with pytest.raises(ScheduleError, match=r"zb-v places exactly two chunks .* virtual is 2, got 3; leave --virtual"):
        strategies.pipeline_schedule("zb-v", stages=4, microbatches=8, virtual=3)
    assert strategies.pipeline_schedule("zb-v", stages=4, microbatches=8, virtual=2).virtual == 2
    assert strategies.pipeline("zb-v", stages=4, microbatches=8).execution.schedule.placement == "v"


def test_cli_zero_bubble_v_beats_zb_h1(capsys):
    code, out, _ = run_cli(capsys, "schedule", "--schedule", "zb-v", "--stages", "4", "--microbatches", "8", "--json")
    j = json.loads(out)
    assert code == 0 and j["bubble_fraction"] < 3 / 27 and j["placement"] == "v" and j["virtual"] == 2
    assert j["peak_inflight"] == [8, 8, 8, 8] and "lockstep" not in j
    code, _, err = run_cli(capsys, "schedule", "--schedule", "zb-v", "--virtual", "3")
    assert code == 2 and "leave --virtual out" in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------------- lock-step
def test_tick_table_is_the_unit_cost_grid():
    s = strategies.pipeline_schedule("interleaved", stages=2, microbatches=4, virtual=2)
    assert tick_table(s) == simulate(s, Costs(F=2, B=2, W=2, BW=2)).ticks()
    table = tick_table(strategies.pipeline_schedule("zb-v", stages=2, microbatches=2))
    assert all(sum(a is not None for a in tick) >= 1 for tick in table)
    # One action per device per tick; stage 1 -> 2 stays on device 1, which runs F0.1 right after F0.
    assert [[str(a) if a else "." for a in tick] for tick in table[:4]] == [
        ["F0", "."], ["F1", "F0"], [".", "F0.1"], ["F0.1", "F1"]
    ]  # fmt: skip


@pytest.mark.parametrize(
    "name,p,m,want",
    [
        # 1F1B, p=2, m=2: ticks F0 | F1 F0 | BW0 | BW0 F1 | BW1 | BW1 -> 1 + 1 + 2 + 2 + 2 + 2.
        ("1f1b", 2, 2, 10),
        # p=4, m=8: 22 ticks, the first 4 forwards only, each of the other 18 holds a BW -> 4·1 + 18·2.
        ("1f1b", 4, 8, 40),
        # GPipe never mixes: m + p − 1 forward ticks, then as many BW ticks -> async's 3(m + p − 1).
        ("gpipe", 2, 2, 9),
        ("gpipe", 4, 8, 33),
    ],
)
def test_lockstep_makespan_by_hand(name, p, m, want):
    s = strategies.pipeline_schedule(name, stages=p, microbatches=m)
    assert simulate_lockstep(s, Costs(F=1, B=1, W=1)).makespan == want


def test_lockstep_pays_the_dearest_action_of_each_tick():
    one_f_one_b, h1 = (strategies.pipeline_schedule(n, stages=4, microbatches=8) for n in ("1f1b", "zb-h1"))
    # F = B = W: zb-h1's 27 ticks of one unit against 1F1B's BW ticks of two.
    assert simulate_lockstep(h1, Costs(1, 1, 1)).makespan == 27 < simulate_lockstep(one_f_one_b).makespan == 40
    # F=1, B=2, W=3: every zb-h1 tick that holds a W costs 3; 1F1B's BW ticks cost BW. With the fused backward
    # as dear as W alone (as measured on this executor), 1F1B wins: 4·1 + 18·3 = 58 against 69.
    uneven = Costs(F=1, B=2, W=3)
    assert simulate_lockstep(h1, uneven).makespan == 69 > simulate_lockstep(one_f_one_b, Costs(1, 2, 3, BW=3)).makespan
    assert simulate_lockstep(one_f_one_b, Costs(1, 2, 3, BW=3)).makespan == 58
    # With BW = B + W = 5, 1F1B's mixed ticks cost more than zb-h1's: 4 + 18·5 = 94.
    assert simulate_lockstep(one_f_one_b, uneven).makespan == 94 > 69
    # Asynchronously zb-h1 is the faster either way.
    assert simulate(h1, uneven).makespan == 54 < simulate(one_f_one_b, uneven).makespan == 66


def test_lockstep_comm_and_scale():
    s = strategies.pipeline_schedule("zb-h1", stages=4, microbatches=8)
    base = simulate_lockstep(s, Costs(1, 2, 3)).makespan
    # One exchange per tick, the last tick's excepted (nothing follows it).
    assert simulate_lockstep(s, Costs(1, 2, 3, comm=Fraction(1, 4))).makespan == base + Fraction(26, 4)
    scaled = simulate_lockstep(s, Costs(1, 1, 1), scale=[[1], [1], [1], [2]])
    assert scaled.busy[3] == 2 * scaled.busy[0] and scaled.makespan > 27
    with pytest.raises(ScheduleError, match=r"simulate_lockstep: scale must give 1 factor\(s\) for each of the 4"):
        simulate_lockstep(s, scale=[[1]])


@pytest.mark.parametrize("name", list(strategies.SCHEDULES))
def test_lockstep_is_never_faster_than_asynchronous(name):
    costs = [Costs(1, 1, 1), Costs(1, 2, 3), Costs(1, 2, 3, BW=3), Costs(2, 1, Fraction(1, 2), comm=Fraction(1, 3))]
    for p, m in ((2, 4), (4, 8), (3, 6)):
        v = 2 if name in ("interleaved", "bfs") else None
        s = strategies.pipeline_schedule(name, stages=p, microbatches=m, virtual=v)
        scale = [[1 + (d % 2)] * s.virtual for d in range(p)]
        for c in costs:
            for sc in (None, scale):
                assert simulate_lockstep(s, c, scale=sc).makespan >= simulate(s, c, scale=sc).makespan, (p, m, c, sc)
        # Every op one tick: lock-step is the asynchronous timeline itself.
        unit = Costs(F=s.virtual, B=s.virtual, W=s.virtual, BW=s.virtual)
        assert simulate_lockstep(s, unit).starts == simulate(s, unit).starts


def test_cli_schedule_prints_lockstep_with_costs(capsys):
    args = ("schedule", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--costs", "1,2,3")
    code, out, _ = run_cli(capsys, *args, "--json")
    j = json.loads(out)
    assert code == 0 and j["makespan"] == 54 and j["bubble_fraction"] == pytest.approx(1 / 9)
    assert j["lockstep"]["makespan"] == 69 and j["lockstep"]["busy"] == [48.0] * 4
    assert j["lockstep"]["bubble_fraction"] == pytest.approx(1 - 48 / 69)
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and "makespan 54, bubble fraction 0.1111 (1/9)" in out
    assert "lock-step" in out and "makespan 69, bubble fraction 0.3043 (7/23)" in " ".join(out.split())
