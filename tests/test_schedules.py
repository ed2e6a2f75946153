"""Schedule tables and the simulator: Megatron's 1F1B bound, ZB-H1, lock-step makespans."""

import json

import numpy as np
import pytest

from jax_wgrad import schedules as sim
from jax_wgrad.parallel import ParallelConfig
from jax_wgrad.parallel.schedules import IDLE, ScheduleTable, get_schedule, one_f_one_b, zb_h1


def _walk(table: ScheduleTable, cf=1.0, cb=1.0, cw=1.0):
    """Independent re-implementation: walk the table tick by tick; a tick lasts as long as
    its busiest stage's work; count each stage's live microbatches."""
    p = table.num_stages
    makespan, held, peak = 0.0, [0] * p, [0] * p
    for t in range(table.num_ticks):
        busiest = 0.0
        for s in range(p):
            work = 0.0
            if table.forward[t, s] != IDLE:
                work += cf
                held[s] += 1
                peak[s] = max(peak[s], held[s])
            if table.backward[t, s] != IDLE:
                work += cb if table.split_backward else cb + cw
                held[s] -= 0 if table.split_backward else 1
            if table.weight[t, s] != IDLE:
                work += cw
                held[s] -= 1
            busiest = max(busiest, work)
        makespan += busiest
    return makespan, peak


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("p, m", [(4, 8), (1, 3), (2, 2), (4, 1), (4, 3), (8, 16)])
def test_walking_the_table_reproduces_makespan_and_in_flight(name, p, m):
    table = get_schedule(name, p, m)
    for costs in [(1, 1, 1), (1, 2, 1), (2, 1, 0.5)]:
        makespan, peak = _walk(table, *costs)
        assert table.makespan(*costs) == makespan
        assert [table.in_flight(s) for s in range(p)] == peak == [min(p - s, m) for s in range(p)]


def test_zb_h1_beats_1f1b_at_unit_costs():
    out = {
        n: sim.main(["--schedule", n, "--stages", "4", "--microbatches", "8", "--json"])
        for n in ("1f1b", "zb-h1")
    }
    assert out["1f1b"]["makespan"] == 40 and out["zb-h1"]["makespan"] == 30
    assert out["zb-h1"]["makespan"] <= 0.85 * out["1f1b"]["makespan"]
    assert out["zb-h1"]["bubble_fraction"] < out["1f1b"]["bubble_fraction"]
    assert out["1f1b"]["max_in_flight"] == out["zb-h1"]["max_in_flight"] == [4, 3, 2, 1]


def test_simulator_json_and_plot(tmp_path, capsys):
    png = tmp_path / "zb.png"
    sim.main(
        [
            "--schedule",
            "zb-h1",
            "--stages",
            "3",
            "--microbatches",
            "5",
            "--cost-w",
            "0.5",
            "--json",
            "--plot",
            str(png),
        ]
    )
    row = json.loads(capsys.readouterr().out)
    assert {"makespan", "bubble_fraction", "max_in_flight", "num_ticks", "schedule"} <= set(row)
    assert row["costs"] == {"F": 1.0, "B": 1.0, "W": 0.5} and row["max_in_flight"] == [3, 2, 1]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["--stages", "0", "--microbatches", "2"],
        ["--stages", "2", "--microbatches", "2", "--cost-f", "0"],
        ["--schedule", "gpipe", "--stages", "2", "--microbatches", "2"],
    ],
)
def test_simulator_bad_arguments(argv):
    with pytest.raises(SystemExit) as err:
        sim.main(argv)
    assert err.value.code == 2


def test_zb_h1_splits_every_backward_and_keeps_1f1b_order():
    z, o = zb_h1(4, 8), one_f_one_b(4, 8)
    assert z.split_backward and not o.split_backward and (o.weight == IDLE).all()

    def fb(t, s):
        """Stage ``s``'s forwards and backwards in tick order: ``[("F" | "B", microbatch)]``."""
        return [
            (k, int(c[i, s]))
            for i in range(t.num_ticks)
            for k, c in (("F", t.forward), ("B", t.backward))
            if c[i, s] >= 0
        ]

    for s in range(4):
        # The same F/B order as 1F1B; every W after its B, in order.
        assert fb(z, s) == fb(o, s)
        assert (z.ticks("W", s) >= z.ticks("B", s)).all()
        assert z.last_grad_tick(s) == z.ticks("W", s).max()


@pytest.mark.parametrize("name", ["1f1b", "1f1b-paired", "zb-h1"])
@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 3)])
def test_a_stage_syncs_in_the_tick_after_its_last_gradient_task(name, p, m):
    t = get_schedule(name, p, m)
    tasks = [np.asarray(t.forward), np.asarray(t.backward), np.asarray(t.weight)]
    for s in range(p):
        last, sync = t.last_grad_tick(s), t.sync_tick(s)
        if last == t.num_ticks - 1:  # nothing runs after the schedule's last tick
            assert sync == last
        else:  # a tick in which the stage has no task of its own left
            assert sync == last + 1 and all(c[sync, s] == IDLE for c in tasks)
    # 1F1B: the last stage finishes first; the first stage's last B ends the schedule
    if name == "1f1b" and (p, m) == (4, 8):
        assert [t.sync_tick(s) for s in range(4)] == [21, 21, 20, 19]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 3, 8, 17, 32])
def test_paired_1f1b_reaches_the_bubble_bound_with_twice_the_slots(p, m):
    """1f1b-paired: a B and an F share a tick, so under lock step its makespan is
    1F1B's bubble-bounded ideal (M + P - 1) (F + B) -- 1F1B's own is longer whenever
    P > 1 and M > 1 -- for at most 2 (P - s) microbatches in flight on stage s."""
    paired, plain = get_schedule("1f1b-paired", p, m), one_f_one_b(p, m)
    f, b = 1.0, 2.0  # a backward (input and weight gradients) costs twice a forward
    assert paired.makespan(f, b / 2, b / 2) == (m + p - 1) * (f + b)
    assert paired.makespan(f, b / 2, b / 2) <= plain.makespan(f, b / 2, b / 2)
    if p > 1 and m > 1:
        assert paired.makespan(f, b / 2, b / 2) < plain.makespan(f, b / 2, b / 2)
    assert all(paired.in_flight(s) <= 2 * (p - s) for s in range(p))
    assert [plain.in_flight(s) for s in range(p)] == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize("p, m, v", [(2, 8, 2), (4, 8, 2), (2, 4, 2), (4, 16, 4), (3, 6, 3)])
def test_paired_interleaved_reaches_the_bubble_bound_in_megatrons_order(p, m, v):
    """1f1b-paired with model chunks: Megatron's interleaved order per stage, a B and an F
    sharing a tick; under lock step the makespan is the bubble bound (M V + P - 1)(F + B)/V
    (a chunk's task costing 1/V of the stage's), for one pair more in flight."""
    paired, plain = get_schedule("1f1b-paired", p, m, v), get_schedule("1f1b", p, m, v)
    assert paired.name == "interleaved-1f1b-paired" and paired.num_chunks == v

    def order(t, s):
        return [
            (k, int(c[i, s]), int(ch[i, s]))
            for i in range(t.num_ticks)
            for k, c, ch in (("F", t.forward, t.forward_chunk), ("B", t.backward, t.backward_chunk))
            if c[i, s] >= 0
        ]

    for f, b in [(1, 2), (1, 1)]:
        assert paired.makespan(f / v, b / v, 0) == pytest.approx((m * v + p - 1) * (f + b) / v)
        assert paired.makespan(f / v, b / v, 0) <= plain.makespan(f / v, b / v, 0) + 1e-9
    # a backward twice a forward (no recompute): interleaved 1F1B loses ticks to lock step
    assert paired.makespan(1 / v, 2 / v, 0) < plain.makespan(1 / v, 2 / v, 0)
    for s in range(p):
        # the same tasks in the same order, up to the F and B of a shared tick
        assert sorted(order(paired, s)) == sorted(order(plain, s))
        assert [x for x in order(paired, s) if x[0] == "B"] == [
            x for x in order(plain, s) if x[0] == "B"
        ]
        assert paired.in_flight(s) <= plain.in_flight(s) + 1
    ParallelConfig(
        pipeline_model_parallel_size=p,
        virtual_pipeline_model_parallel_size=v,
        pipeline_schedule="1f1b-paired",
        global_batch_size=m,
        micro_batch_size=1,
        world_size=p,
    )


def test_paired_ticks_have_no_split_backward_form():
    from jax_wgrad.parallel.interleaved import interleaved_schedule

    with pytest.raises(ValueError, match="paired ticks have no split-backward form"):
        interleaved_schedule(2, 4, 2, split_backward=True, paired=True)


def test_table_validation_of_w_tasks():
    f = np.array([[0], [1], [IDLE], [IDLE]])
    b = np.array([[IDLE], [0], [1], [IDLE]])
    with pytest.raises(ValueError, match="W tasks need split_backward"):
        ScheduleTable("x", f, b, np.array([[IDLE], [IDLE], [0], [1]]))
    with pytest.raises(ValueError, match="runs W before B"):
        ScheduleTable("x", f, b, np.array([[0], [IDLE], [1], [IDLE]]), split_backward=True)
    ScheduleTable("x", f, b, np.array([[IDLE], [0], [IDLE], [1]]), split_backward=True)


@pytest.mark.parametrize("name", ["1f1b", "1f1b-paired", "zb-h1"])
def test_one_stage_runs_every_task_of_a_microbatch_in_its_tick(name):
    """No pipeline, no lock step: tick m runs F(m), B(m) (and W(m)); no task is ever idle,
    so the executor needs no conditional."""
    t = get_schedule(name, 1, 5)
    assert t.num_ticks == 5 and t.in_flight(0) == 1
    assert t.forward[:, 0].tolist() == t.backward[:, 0].tolist() == list(range(5))
    assert t.always_busy("F") and t.always_busy("B")
    assert t.always_busy("W") == t.split_backward == (name == "zb-h1")
    assert t.makespan(1, 2, 1) == 5 * (1 + 2 + 1)
    assert not any(get_schedule(name, 2, 5).always_busy(k) for k in "FBW")
