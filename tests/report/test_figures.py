"""Report figures: real PNGs from schema-shaped metrics, None when the data is absent, identical bytes on
identical inputs (so a rerun of the report stage with unchanged metrics changes nothing)."""

from __future__ import annotations

import copy
import io

import pytest

from tandem.report import figures as F

from tests.report.fake_metrics import fake_analysis, fake_eval

PNG_SIG = b"\x89PNG\r\n\x1a\n"


def _size(png: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        return im.size


@pytest.fixture(scope="module")
def data():
    return fake_eval(), fake_analysis()


def test_every_figure_renders(data):
    ev, an = data
    pngs = {
        "solo": F.solo_passk_figure(ev), "tandem": F.tandem_passk_figure(ev), "drift": F.drift_figure(an),
        "klreg": F.klreg_figure(ev, an),
        "train": F.train_curves_figure({"tandem": {"step": [1, 2, 3], "reward": [0.1, 0.2, 0.3]}}, "reward"),
    }
    for name, png in pngs.items():
        assert png is not None and png.startswith(PNG_SIG), name
        w, h = _size(png)
        assert w > 200 and h > 200, (name, w, h)


def test_figures_are_deterministic(data):
    ev, an = data
    assert F.solo_passk_figure(ev) == F.solo_passk_figure(copy.deepcopy(ev))
    assert F.drift_figure(an) == F.drift_figure(copy.deepcopy(an))


def test_figures_change_with_the_data(data):
    ev, _ = data
    ev2 = copy.deepcopy(ev)
    ev2["arms"]["tandem"]["checkpoints"][-1]["modes"]["solo"]["macro"]["pass@1"] = 0.99
    assert F.solo_passk_figure(ev) != F.solo_passk_figure(ev2)


def test_missing_data_gives_none():
    empty_eval = {"settings": {"ks": [1], "modes": ["solo"]}, "arms": {}}
    assert F.solo_passk_figure(empty_eval) is None
    assert F.tandem_passk_figure(fake_eval(modes=("solo",))) is None  # no tandem mode evaluated
    assert F.klreg_figure(fake_eval(modes=("solo", "word")), fake_analysis()) is None  # needs the step mode
    assert F.drift_figure({"arms": {}}) is None
    assert F.train_curves_figure({"tandem": {"step": [1], "loss": [0.1]}}, "reward") is None


def test_undefined_values_are_skipped_not_zeroed():
    ev = fake_eval(arms=("tandem",), steps=(0, 10))
    for c in ev["arms"]["tandem"]["checkpoints"]:
        for m in c["modes"].values():
            m["macro"] = {k: None for k in m["macro"]}
    # every value undefined: nothing to draw rather than a line at 0
    assert F.solo_passk_figure(ev) is None


def test_pass_at_k_panels_draw_error_bars_from_intervals(data):
    ev, _ = data
    iv = {arm: {f"{m}/pass@{k}": (0.0, 1.0) for m in ("solo", "step", "word") for k in (1, 2, 4, 8)}
          for arm in ("base", "tandem", "grpo", "kl_reg")}
    assert F.solo_passk_figure(ev, iv) != F.solo_passk_figure(ev)
    assert F.tandem_passk_figure(ev, iv) != F.tandem_passk_figure(ev)
    assert F.solo_passk_figure(ev, {}) == F.solo_passk_figure(ev)  # no interval known: no bars
