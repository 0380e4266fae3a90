"""scripts/catch_rate.py, the power of the check on one wrong element, at a tiny size (M = 128):
its per-trial decision is the whole `check`'s on the planted files, an element far outside its
bound is caught and named, an untouched run never fails, and the trials count what they find."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.catch_rate import load_script, whole_check_status

KEYS, ROWS, D = 128, 8, 16


@pytest.fixture(scope="module")
def head_and_run(binary, tmp_path_factory):
    cr = load_script()
    work = tmp_path_factory.mktemp("catch_rate")
    in_dir, out_dir = cr.make_run(work, binary, "normal", KEYS, ROWS, D, seed=3)
    return cr, cr.Head(in_dir, out_dir), in_dir, out_dir, work


def test_an_untouched_run_passes_every_stage_and_a_copy_of_it_too(head_and_run):
    cr, head, *_ = head_and_run
    assert set(cr.PLANTED) <= set(head.stages)
    for stage in cr.PLANTED:
        assert head.results[stage].status == cr.PASS, stage
        assert head.decide(stage, np.array(head.clean[stage][0], dtype=np.float64)).status == cr.PASS, stage


def test_an_element_far_outside_its_bound_is_caught_and_named(head_and_run):
    cr, head, *_ = head_and_run
    rng = np.random.default_rng(0)
    for stage in cr.PLANTED:
        clean = np.array(head.clean[stage][0], dtype=np.float64)
        bound = head.allowance(stage)
        hits = 0
        for _ in range(10):
            at = tuple(int(rng.integers(n)) for n in clean.shape)
            planted = clean.copy()
            planted[at] += 10 * (bound.max() + abs(clean[at]) * 1e-3 + 1e-30)
            res = head.decide(stage, planted)
            hits += res.status == cr.FAIL and cr.located(res, at)
        assert hits >= 9, (stage, hits)
        assert head.decide(stage, clean).status == cr.PASS, stage  # (the plants left nothing behind)


def test_each_trial_decides_as_the_whole_check_does(head_and_run):
    cr, head, in_dir, out_dir, work = head_and_run
    rng = np.random.default_rng(1)
    verdicts = set()
    for stage in ("QK", "attention_weights", "output", "flash_lse", "dK", "flash_dV"):
        clean = np.array(head.clean[stage][0], dtype=np.float64)
        for factor in (3.0, 30.0):
            at = tuple(int(rng.integers(n)) for n in clean.shape)
            planted = clean.copy()
            planted[at] += factor * head.typical_error(stage)
            planted = planted.astype(np.float32).astype(np.float64)  # what a float32 file can hold
            fast = head.decide(stage, planted).status
            assert fast == whole_check_status(in_dir, out_dir, work, stage, planted), (stage, factor)
            verdicts.add(fast)
    assert verdicts == {cr.PASS, cr.FAIL}  # both verdicts compared, not one


def test_the_trials_count_catches_and_a_blind_check_catches_nothing(head_and_run, monkeypatch):
    cr, head, *_ = head_and_run
    rng = np.random.default_rng(2)
    cell = cr.plant_trials(head, "QK", "normal", KEYS, 20, rng)
    assert cell.trials == 20 and 0 <= cell.named <= cell.caught <= 20 and cell.clean_passes
    assert cell.typical > 0 and cell.allowance_over_typical > 0 and 0 <= cell.predicted <= 1
    assert cr.markdown([cell], [KEYS], ["normal"]).splitlines()[2].startswith("| QK | ")
    far = cr.plant_trials(head, "QK", "normal", KEYS, 20, rng, factor=1e4)
    assert far.rate() >= 0.9 and far.named == far.caught
    # A check that never sees the planted matrix (it decides on the untouched one) catches nothing.
    decide = cr.Head.decide
    monkeypatch.setattr(cr.Head, "decide", lambda self, stage, mat: decide(
        self, stage, np.array(self.clean[stage][0], dtype=np.float64)))
    assert cr.plant_trials(head, "QK", "normal", KEYS, 20, rng, factor=1e4).caught == 0
