"""bench.kernels --only sparse-mla-sm90 times the sm_90 kernel only when its check passed: the gate over the
check's rows."""
from bench.kernels.suite import check_passed

TILE = {"kernel": "check sm90 first tile, stage by stage", "tile_exact": True, "tile_err": 0.0, "scores_err": 4.5e-07,
        "p_err": 0.0, "pv_err": 1.9e-07, "nan": {"scores": False, "p": False, "pv": False}}
CASE = {"kernel": "check sm90 decode B=64 Sq=1 H=64", "why_not": None, "out_err": 0.0021, "triton_err": 0.0021,
        "lse_err": 1.1e-05, "inf_match": True, "nan": False}


def test_rows_of_a_passing_check_pass():  # the rows of the first H200 run (the first-tile row has no out_err)
    assert check_passed([TILE, CASE])


def test_any_bad_row_fails_the_check():
    assert not check_passed([])
    assert not check_passed([TILE, {**CASE, "out_err": 0.03}])
    assert not check_passed([TILE, {**CASE, "out_err": float("nan")}])
    assert not check_passed([TILE, {**CASE, "nan": True}])
    assert not check_passed([{"kernel": "check sm90 first tile, stage by stage", "error": "RuntimeError()"}, CASE])
    assert not check_passed([{**TILE, "tile_exact": False}, CASE])
    assert not check_passed([{**TILE, "pv_err": 0.5}, CASE])
    assert not check_passed([{**TILE, "nan": {"scores": True, "p": False, "pv": False}}, CASE])
