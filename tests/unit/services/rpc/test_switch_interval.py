"""PDSERVE_SWITCH_INTERVAL_MS: the interpreter's thread switch interval of a service process."""

from __future__ import annotations

import sys

import pytest

from services.rpc.grpc_server import switch_interval

SWITCH_INTERVAL_ENV = "PDSERVE_SWITCH_INTERVAL_MS"


@pytest.fixture(autouse=True)
def _restore():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_unset_leaves_the_interval(monkeypatch):
    monkeypatch.delenv(SWITCH_INTERVAL_ENV, raising=False)
    sys.setswitchinterval(0.005)
    assert switch_interval() == pytest.approx(0.005)


def test_set_in_milliseconds(monkeypatch):
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, "0.5")
    assert switch_interval() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


@pytest.mark.parametrize("raw", ["0", "-1", "fast", "nan", "5000"])
def test_a_bad_value_is_refused_with_its_name(monkeypatch, raw):
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, raw)
    sys.setswitchinterval(0.005)
    with pytest.raises(ValueError, match=SWITCH_INTERVAL_ENV):
        switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.005)  # unchanged
