"""Where a measured bubble comes from: ``pp.replay`` plays a run's own action times again with free
messages, ``runs.pipeline.bubble_decomposition`` puts the stages' times, the uneven actions and the
hand-over apart. Checked on timelines made by ``simulate``, whose answer is known, then on a real run."""

import json

import pytest

from minitp import cli, cost, pp, runs
from minitp.pp import one_f_one_b, replay, simulate, zero_bubble_h1
from minitp.runs.pipeline import bubble_decomposition, handover_costs


def _delayed(timelines, rank, after, delay):
    """The timelines with every action of ``rank`` from index ``after`` on started ``delay`` later,
    as if a message had taken ``delay`` to arrive (the other ranks left as they were)."""
    out = [list(t) for t in timelines]
    out[rank] = [(a, s + delay, e + delay) if j >= after else (a, s, e) for j, (a, s, e) in enumerate(out[rank])]
    return out


@pytest.mark.parametrize("make,p,m", [(one_f_one_b, 2, 16), (one_f_one_b, 4, 8), (zero_bubble_h1, 3, 6)])
def test_replaying_a_simulated_step_gives_it_back(make, p, m):
    played = simulate(make(p, m), [1.0 + 0.1 * s for s in range(p)], [2.0 - 0.1 * s for s in range(p)])
    again = replay(played)
    assert [[a for a, _, _ in t] for t in again] == make(p, m)
    for t, u in zip(played, again):
        for (_, s, e), (_, s2, e2) in zip(t, u):
            assert (s2, e2) == pytest.approx((s, e))


def test_replay_removes_the_time_between_actions_and_keeps_the_compute():
    played = simulate(one_f_one_b(2, 16), 1.0, 2.0)
    late = _delayed(played, 0, 5, 0.7)  # the first stage waited 0.7 longer for a message, once
    assert min(b - a for a, b in zip(pp.bubble_fraction(played), pp.bubble_fraction(late))) > 0.01
    assert pp.bubble_fraction(replay(late)) == pytest.approx(pp.bubble_fraction(played))


def test_an_uneven_action_stays_in_the_replay():
    played = simulate(one_f_one_b(2, 16), 1.0, 2.0)
    a, s, e = played[1][9]
    slow = [list(t) for t in played]
    slow[1][9] = (a, s, e + 1.5)  # one backward of the last stage 1.5 slower: the first stage waits for it
    assert sum(pp.bubble_fraction(replay(slow))) > sum(pp.bubble_fraction(played)) + 0.01


def test_the_decomposition_of_equal_stages_is_the_formula_and_of_a_slower_stage_above_it():
    p, m = 2, 16
    formula = cost.pp_bubble_fraction(p, m, "1f1b")
    equal = _delayed(simulate(one_f_one_b(p, m), 1.0, 2.0), 0, 3, 0.4)
    assert bubble_decomposition(equal) == pytest.approx((formula, formula))
    last_slower = simulate(one_f_one_b(p, m), [1.0, 1.2], [2.0, 2.4])
    stage_times, compute_only = bubble_decomposition(last_slower)
    assert stage_times == pytest.approx(compute_only) and stage_times > formula + 0.02
    zb = simulate(zero_bubble_h1(p, m), 1.0, 2.0, 1.0)
    assert bubble_decomposition(zb) == pytest.approx((cost.pp_bubble_fraction(p, m, "zb"),) * 2)


@pytest.mark.parametrize("make,p,m,v", [(one_f_one_b, 2, 16, 1), (pp.interleaved_1f1b, 2, 8, 2),
                                        (zero_bubble_h1, 3, 6, 1)])
def test_the_hand_over_measured_from_a_step_plays_it_back(make, p, m, v):
    """A step played with messages costing 0.3 and 0.05 between a rank's actions: handover_costs reads
    both back from its timelines, and replaying the compute with them gives the step again."""
    schedule = make(p, m, v) if v > 1 else make(p, m)
    costly = replay(simulate(schedule, 1.0, 2.0), message_s=0.3, gap_s=0.05)
    assert sum(pp.bubble_fraction(costly)) > sum(pp.bubble_fraction(simulate(schedule, 1.0, 2.0))) + 0.01
    assert handover_costs(costly) == pytest.approx((0.3, 0.05))
    again = replay(costly, *handover_costs(costly))
    assert pp.bubble_fraction(again) == pytest.approx(pp.bubble_fraction(costly))
    assert handover_costs(simulate(schedule, 1.0, 2.0)) == pytest.approx((0.0, 0.0))


def test_the_hand_over_is_the_mean_of_the_gaps_and_waits_not_their_median():
    """One slow gap among many: a step's time is the sum of its gaps, so handover_costs counts the
    slow one in (the mean); the median would say the step lost nothing to it."""
    step = replay(simulate(one_f_one_b(2, 8), 1.0, 2.0), gap_s=0.1)
    slow = _delayed(step, 0, 5, 2.0)  # rank 0's sixth action starts 2.0 late
    gaps = [s - t[j - 1][2] for t in slow for j, (_, s, _) in enumerate(t) if j]
    message, gap = handover_costs(slow)
    assert gap > 0.1 + 1e-3
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(0.1)  # the median of every gap is the usual one


def test_the_report_places_the_compute_only_bubble_between_the_formula_and_the_measured_one(tmp_path):
    path = tmp_path / "r.json"
    assert cli.main(["run", "pp", "--nprocs", "2", "--microbatches", "4", "--steps", "3", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert runs.check(report) == []
    # free messages can only shorten a step, so the replay never idles more than the run did
    assert report["bubble_fraction_compute_only"] <= report["bubble_fraction_measured"] + 1e-9
    assert report["bubble_fraction_stage_times"] >= report["bubble_fraction_expected"] - 1e-9
    # the measured hand-over costs only add time to the compute-only replay
    assert report["handover_message_s"] >= 0 and report["handover_gap_s"] >= 0
    assert report["bubble_fraction_with_handover"] >= report["bubble_fraction_compute_only"] - 1e-9
