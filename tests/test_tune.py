"""The runtime-settings sweep: interleaved, cheapest unless clearly beaten."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.runtimes.contract import Runtime
from pipeline.measure import tune
from tests.conftest import StepClock


class Stepper(Runtime):
    """A decoder whose step takes a fixed time on StepClock: a stand-in with known speed."""

    def __init__(self, seconds: float):
        self.seconds, self.steps = seconds, 0

    def reset(self):
        pass

    def step(self, token):
        self.steps += 1
        StepClock.now += self.seconds
        return np.zeros(4)


def test_candidates_cover_threads_and_spinning():
    c = tune.candidates(2)
    assert {"intra_op_num_threads": 1, "allow_spinning": False} in c
    assert {"intra_op_num_threads": 2, "allow_spinning": True} in c
    assert not any(x["intra_op_num_threads"] == 1 and x["allow_spinning"] for x in c)
    assert {x["intra_op_num_threads"] for x in tune.candidates(6)} == {1, 2, 4, 6}


@pytest.mark.parametrize("speeds, chosen", [
    ({1: 0.004, 2: 0.002}, 2),     # twice as fast: the second core is worth it
    ({1: 0.004, 2: 0.0039}, 1),    # within the noise floor: keep the cheaper setting
])
def test_the_pick_is_measured_and_never_buys_noise(speeds, chosen, monkeypatch):
    monkeypatch.setattr(tune, "time", StepClock)
    settings = [{"intra_op_num_threads": t, "allow_spinning": False} for t in speeds]
    made = []

    def make(s):
        made.append(Stepper(speeds[s["intra_op_num_threads"]]))
        return made[-1]

    res = tune.sweep(make, settings, prompt=[1, 2, 3], decode_tokens=10, rounds=3)
    assert res["chosen"]["intra_op_num_threads"] == chosen
    assert all(row["decode_tok_s"]["n"] == 3 for row in res["candidates"])
    assert all(d.steps == 3 * (3 + 10) for d in made)  # every round: prompt then decode, each candidate
    fast = max(res["candidates"], key=lambda r: r["decode_tok_s"]["median"])
    assert fast["decode_tok_s"]["median"] == pytest.approx(1 / min(speeds.values()))
