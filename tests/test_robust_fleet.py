"""One bad member cannot wreck the model: a fleet of 4 datacenters × 1 rank under DiLoCo with
the norm-clipped mean, whose datacenter 1 sends 100 × its pseudo-gradient from round 3 on
(``lowcomm fault corrupt``), ends within 2 % of the clean run's eval loss (today's mean, as one
MPI job: a fleet with no failure is that job bit for bit, tests/test_fleet.py), strikes and
fences datacenter 1, and charges the gathered bytes to the ledger. What ``mean`` makes of the
same corruption, and the rules' equations, are in-process in tests/test_aggregate.py."""
import json
import time

from conftest import cli, scaled
from fleet_helpers import fleet, single_job, when

STEPS, PERIOD, DCS = 60, 10, 4
RUN = [f"steps={STEPS}", "task.step_ms=5", "lr=0.05", "topology=dc:4,rank:1",
       f"policy.dc=diloco:period={PERIOD},outer_momentum=0.5,algorithm=ring", "policy.rank=syncdp"]


def launched(out, dc: int) -> bool:
    """Whether the fleet in ``out`` has made datacenter ``dc``'s folder (its marker says so)."""
    from lowcomm.tools.slow import SlowError, newest_folder
    try:
        return newest_folder(out, dc).is_dir()
    except (SlowError, OSError, ValueError):
        return False


def test_a_corrupted_datacenter_is_clipped_fenced_and_the_model_is_not_wrecked(tmp_path):
    deadline = time.monotonic() + scaled(240)
    clean = single_job(tmp_path / "clean", *RUN, np=DCS)
    bad = fleet(tmp_path / "bad", *RUN[:4], f"policy.dc=diloco:period={PERIOD},outer_momentum=0.5,"
                "algorithm=ring,aggregate=clip,clip=2,strikes=3", "policy.rank=syncdp",
                dcs=DCS, np=DCS)
    fault = {}
    when(lambda: launched(tmp_path / "bad", 1),
         lambda: fault.update(ran=cli("fault", "corrupt", tmp_path / "bad", "--dc", "1", "--kind",
                                      "scale=100", "--from-round", "3")), deadline)
    (rc, out), (rc_bad, out_bad) = clean.wait(deadline), bad.wait(deadline)
    assert rc == 0 and rc_bad == 0, (out[-2000:], out_bad[-3000:])
    assert fault["ran"].returncode == 0, fault["ran"].output
    assert json.loads(fault["ran"].stdout)["from_round"] == 3, fault["ran"].output
    said = (tmp_path / "bad" / "dc1" / "stderr.log").read_text()
    assert "corrupted pseudo-gradient (scale=100) from round 3 of fragment 0" in said, said[-2000:]
    s, ref = bad.summary(), clean.summary()
    assert s["dcs_agree"] and s["finished_dcs"] == [0, 1, 2, 3], s
    assert abs(s["eval_loss"] - ref["eval_loss"]) <= 0.02 * ref["eval_loss"], \
        (s["eval_loss"], ref["eval_loss"])
    rounds = STEPS // PERIOD
    for dc in range(DCS):                            # every member computed the same verdict
        agg = json.loads((tmp_path / "bad" / f"dc{dc}" / "summary.json").read_text())["aggregate"]
        assert agg["rule"] == "clip" and agg["strikes"]["clipped"] == {"1": rounds - 2}, agg
        assert agg["strikes"]["fenced"] == [1] and agg["last"]["used"] == [0, 2, 3], agg
    # each member sends its pseudo-gradient to the 3 others every round (a ring all-gather)
    assert s["bytes_by_level"]["dc"] == rounds * DCS * (DCS - 1) * s["params"] * 4, s["bytes_by_level"]
