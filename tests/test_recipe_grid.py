"""examples/recipe_grid.py replays HiPS's synchronous arithmetic in one process; it must be the real thing."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parent.parent / "examples" / "recipe_grid.py"
_spec = importlib.util.spec_from_file_location("recipe_grid", _PATH)
grid = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grid)


def test_the_replay_with_an_identity_codec_trains_exactly_like_dense_data_parallel_sgd():
    # the DC means go up and the global mean comes down through ErrorFeedback and the codec, scaled as on the
    # wire; with "none" that path must change nothing, down to the step at which the target is reached
    kw = dict(seed=0, lr=0.4, momentum=0.7, steps=8, target=0.6)
    through_codec = grid.steps_to_target(aggregate=grid.SparseHiPS({"type": "none"}, 0).mean, **kw)
    dense = grid.steps_to_target(aggregate=grid.dense_mean, **kw)
    assert dense is not None and through_codec == dense


def test_bi_sparse_sends_about_one_percent_per_dc_and_keeps_the_rest_for_later():
    rng = np.random.default_rng(0)
    sums = [rng.standard_normal(300_000).astype(np.float32) for _ in range(2)]
    hips = grid.SparseHiPS({"type": "bsc", "threshold": 0.01}, 200_000)
    mean = hips.mean(0, sums)
    # each DC sends ~1% (union <= ~2%); the downlink re-selects ~1% of that
    assert 0.005 * mean.size <= np.count_nonzero(mean) <= 0.02 * mean.size
    # nothing is lost: what arrived plus both tiers' residuals is the dense mean
    dense = grid.dense_mean(0, sums)
    up = sum(ef.residual(0) for ef in hips.up) * 2 / 4
    np.testing.assert_allclose(mean + hips.down.residual(0) + up, dense, atol=1e-5)
    # small tensors stay dense
    small = [s[:1000] for s in sums]
    np.testing.assert_array_equal(hips.mean(1, small), grid.dense_mean(1, small))


@pytest.mark.parametrize("text, said", [
    ('{"lan": {"type": "fp16"}, "wan": {"type": "bsc"}}', "give one codec's dict with its type"),
    ("bsc", "is not JSON"),
    ('{"type": "nosuch"}', "nosuch"),
    ('{"type": "dgc"}', "keeps its own residual"),      # a codec the replay's error feedback refuses
])
def test_a_compression_the_replay_cannot_run_is_refused_by_name(text, said, capsys):
    """A per-tier dict, GeoMX's string form or an unknown codec ended in a KeyError or a traceback."""
    with pytest.raises(SystemExit) as exc:
        grid.main(["--compression", text, "--seeds", "0", "--steps", "2"])
    assert exc.value.code == 2 and said in capsys.readouterr().err
