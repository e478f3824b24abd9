"""Loading a checkpoint says how far it is: the planned bytes up front, progress lines (bytes, share, rate,
time left) at most every PROGRESS_S, and the total at the end."""

from __future__ import annotations

import logging

from engine.config.model_config import ModelConfig
from engine.loading import weights
from engine.loading.loader import build_model


def test_a_load_reports_its_progress(tiny_code, monkeypatch, caplog):
    cfg = ModelConfig.from_pretrained(tiny_code)
    model = build_model(cfg, checkpoint=tiny_code)  # a model to load into (the load logged is the one below)
    monkeypatch.setattr(weights, "PROGRESS_S", 0.0)
    with caplog.at_level(logging.INFO, logger=weights.__name__):
        report = weights.load_weights(model, tiny_code, cfg)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(f"loading {report.loaded} tensors, ")
    progress = [m for m in lines if m.startswith("loading weights: ")]
    assert len(progress) == report.loaded and "100%" in progress[-1] and "GiB/s" in progress[-1]
    gib = report.bytes_read / 2**30
    assert lines[-1].startswith(f"loaded {report.loaded} tensors, {gib:.2f} GiB in ")
