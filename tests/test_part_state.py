"""State saved per part, re-cut for another cut of the same tensor (geomx.part_state): what a job resumed over
another WAN or with another codec needs, since both change how its tensors are cut into parts."""
from __future__ import annotations

import math

import numpy as np
import pytest

from geomx import statefile
from geomx.cluster.compressed import CODEC_FIELD, ClientWire, decode
from geomx.cluster.server_checkpoint import ServerCheckpoints, checkpoint_name
from geomx.compression import parse_policy
from geomx.errors import ConfigError
from geomx.kvstore.partition import plan_parts
from geomx.part_state import NotRecuttable, base_key, part_range, recut, recut_stream, saved_pieces

SHAPE = (10, 4)
WHOLE = {"param": np.arange(40, dtype=np.float32).reshape(SHAPE),
         "optimizer": {"state": {0: {"step": np.array(7.0, np.float32),
                                     "exp_avg": np.linspace(-1, 1, 40, dtype=np.float32).reshape(SHAPE)}},
                       "param_groups": [{"lr": 0.01, "params": [0]}]}}


def _cut(partition_bytes: int) -> list:
    return plan_parts("w", SHAPE, 4, partition_bytes) or []


def _state_of(part) -> dict:
    """WHOLE's state of one part, as a server that owned the part would have saved it."""
    sl = slice(part.start, part.stop)
    return {"param": WHOLE["param"].reshape(-1)[sl].reshape(part.shape),
            "optimizer": {"state": {0: {"step": WHOLE["optimizer"]["state"][0]["step"],
                                        "exp_avg": WHOLE["optimizer"]["state"][0]["exp_avg"].reshape(-1)[sl]
                                        .reshape(part.shape)}},
                          "param_groups": [{"lr": 0.01, "params": [0]}]}}


@pytest.mark.parametrize("saved_bytes,resumed_bytes", [(48, 80), (48, 0), (80, 16), (0, 48)])
def test_state_saved_in_one_cut_and_recut_to_another_is_the_whole_tensors_state_sliced(saved_bytes, resumed_bytes):
    """Parts of 3 rows re-cut to parts of 5 rows, to the whole tensor, to flat parts of 4 elements, and a
    whole tensor's state cut into parts: every element-wise array is the whole state's slice in the new part's
    shape, and the step counter and the parameter groups (the same in every part) are kept."""
    saved = _cut(saved_bytes) or [type("Whole", (), {"key": "w", "start": 0, "stop": 40, "shape": SHAPE})]
    shapes = {p.key: p.shape for p in saved}
    states = {p.key: _state_of(p) for p in saved}
    pieces = saved_pieces("w", shapes, states)
    assert [p.key for p in pieces] == [p.key for p in saved] and pieces[-1].stop == 40
    for part in _cut(resumed_bytes) or [type("Whole", (), {"key": "w", "start": 0, "stop": 40, "shape": SHAPE})]:
        assert part_range(part.key, part.shape, 40) == (part.start, part.stop)
        got = recut(pieces, part.start, part.stop, part.shape, shaped=True)
        want = _state_of(part)
        np.testing.assert_array_equal(got["param"], want["param"])
        np.testing.assert_array_equal(got["optimizer"]["state"][0]["exp_avg"], want["optimizer"]["state"][0]["exp_avg"])
        assert got["param"].shape == part.shape and float(got["optimizer"]["state"][0]["step"]) == 7.0
        assert got["optimizer"]["param_groups"] == [{"lr": 0.01, "params": [0]}]


def test_parts_that_disagree_on_what_is_not_element_wise_are_refused_naming_where():
    parts = _cut(48)
    states = {p.key: _state_of(p) for p in parts}
    states[parts[1].key]["optimizer"]["state"][0]["step"] = np.array(8.0, np.float32)
    pieces = saved_pieces("w", {p.key: p.shape for p in parts}, states)
    with pytest.raises(NotRecuttable, match="/optimizer/state/0/step"):
        recut(pieces, 0, 20, (5, 4), shaped=True)


def test_incomplete_or_mixed_saved_parts_are_refused_naming_the_tensor_and_the_parts():
    parts = _cut(48)
    shapes = {p.key: p.shape for p in parts}
    with pytest.raises(ConfigError, match=r"tensor 'w' lacks part\(s\) \[2\] of 4"):
        saved_pieces("w", {k: s for k, s in shapes.items() if k != "w#2/4"}, {})
    with pytest.raises(ConfigError, match=r"tensor 'w' cut in \[2, 4\] parts at once"):
        saved_pieces("w", {**shapes, "w#0/2": (5, 4)}, {})
    assert saved_pieces("v", shapes, {}) == [] and base_key("w#3/4") == "w" and base_key(7) == 7
    with pytest.raises(ConfigError, match="no part of the saved tensor of 40 elements"):
        part_range("w#0/3", (3, 4), 40)       # three parts of 12 cannot hold 40 elements
    with pytest.raises(ConfigError, match="no part of the saved tensor of 40 elements"):
        part_range("w", (10,), 40)            # a whole key spans its tensor


def _stream(codec: str, residual: np.ndarray, seed: int) -> dict:
    return {"codec": codec, "codec_state": {"seed": seed, "slots": {codec: {
                "step": 4, "rng": {"bit_generator_state": np.random.default_rng(seed).bit_generator.state},
                "memory": residual * 2}}},
            "feedback": {"residuals": {0: residual}}}


def test_a_compression_stream_recut_carries_its_residual_and_counters_and_draws_afresh():
    """The residual and element-wise codec memory are sliced across the old parts' boundary, the step counter
    kept, the seed and the random generator left to the new stream (a generator continued in two new parts
    would repeat its draws); pieces of different codecs give no stream (it starts afresh)."""
    residual = np.arange(12, dtype=np.float32)
    pieces = saved_pieces("g", {"g#0/2": (6,), "g#1/2": (6,)},
                          {"g#0/2": _stream("topk", residual[:6], 1), "g#1/2": _stream("topk", residual[6:], 2)})
    got = recut_stream(pieces, 4, 10)
    np.testing.assert_array_equal(got["feedback"]["residuals"][0], residual[4:10])
    slot = got["codec_state"]["slots"]["topk"]
    np.testing.assert_array_equal(slot["memory"], residual[4:10] * 2)
    assert slot["step"] == 4 and "rng" not in slot and "seed" not in got["codec_state"]
    pieces[1] = pieces[1].__class__(pieces[1].key, 6, 12, _stream("qsgd", residual[6:], 2))
    assert recut_stream(pieces, 4, 10) is None


def test_a_workers_push_residual_is_carried_into_the_parts_of_another_cut_so_no_gradient_is_lost():
    """A worker's top-k push streams of a 16-element tensor cut in 4 parts, restored into a process that cuts
    it in 2 (ClientWire.load_state_dict's ``cuts``): what the servers decode over six rounds plus what the
    streams still hold equals every gradient pushed. Without the cuts (the control) the old parts' residuals
    name keys this process never pushes, and the sum falls short by them."""
    policy = parse_policy({"wan": {"type": "topk", "ratio": 0.25}, "size_lower_bound": 0})
    codec = policy.codec_for("wan", "g#0/2", 8)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(16).astype(np.float32) for _ in range(6)]

    def push(wire: ClientWire, keys: list, grad: np.ndarray) -> np.ndarray:
        out, size = [], 16 // len(keys)
        for i, key in enumerate(keys):
            arrays, fields = wire.encode_push(key, grad[i * size:(i + 1) * size], np.dtype(np.float32))
            out.append(decode(codec, fields[CODEC_FIELD], arrays, (size,)))
        return np.concatenate(out)

    def residuals(wire: ClientWire, keys: list) -> np.ndarray:
        return np.concatenate([wire._push[k].feedback.residual(0) for k in keys])

    four = [f"g#{i}/4" for i in range(4)]
    two = [("g#0/2", 0, 8, (8,)), ("g#1/2", 8, 16, (8,))]
    sums = {}
    for carried in (True, False):
        first = ClientWire(policy, "wan", weights=False, salt="w")
        delivered = sum(push(first, four, g) for g in grads[:3])
        saved = statefile.loads(statefile.dumps(first.state_dict(replicas=False)))
        second = ClientWire(policy, "wan", weights=False, salt="w")
        second.load_state_dict(saved, cuts={"g": two} if carried else None)
        delivered = delivered + sum(push(second, [k for k, *_ in two], g) for g in grads[3:])
        sums[carried] = delivered + residuals(second, ["g#0/2", "g#1/2"])
    np.testing.assert_allclose(sums[True], sum(grads), rtol=0, atol=1e-5)
    assert not np.allclose(sums[False], sum(grads), atol=1e-3)


def test_an_integer_keys_tensor_is_found_whole_or_in_parts_whichever_way_it_was_saved():
    """A part key spells its tensor's key as text (7 -> "7#0/2"): an integer key saved whole is found for its
    parts, and its saved parts for the whole key."""
    whole = {7: SHAPE}
    states = {7: _state_of(type("Whole", (), {"start": 0, "stop": 40, "shape": SHAPE}))}
    pieces = saved_pieces(base_key("7#1/2"), whole, states)
    assert [p.key for p in pieces] == [7]
    np.testing.assert_array_equal(recut(pieces, 20, 40, (5, 4), shaped=True)["param"], WHOLE["param"][5:])
    parts = plan_parts(7, SHAPE, 4, 48)
    pieces = saved_pieces(7, {p.key: p.shape for p in parts}, {p.key: _state_of(p) for p in parts})
    assert [p.key for p in pieces] == ["7#0/4", "7#1/4", "7#2/4", "7#3/4"]
    np.testing.assert_array_equal(recut(pieces, 0, 40, SHAPE, shaped=True)["param"], WHOLE["param"])


def test_a_global_server_resumes_a_part_of_another_cut_from_the_parts_every_server_saved(tmp_path):
    """Two global servers saved a tensor's four parts (two each) with Adam-like state; a job that cuts it in two
    parts resumes each from the four, on whichever server now owns it, and a whole key likewise; a third global
    server, which saved nothing, finds its keys in the others' files."""
    parts = _cut(48)
    for rank, mine in ((0, parts[:2]), (1, parts[2:])):
        entries = [{"key": p.key, "shape": list(p.shape), "value": _state_of(p)["param"], "update": _state_of(p),
                    "wire": None} for p in mine]
        statefile.save(tmp_path / checkpoint_name(rank, 6),
                       {"format": "geomx-global-server-checkpoint/1", "rank": rank, "round": 6, "keys": entries})
    reader = ServerCheckpoints(rank=1, every=3, directory=None, resume_from=tmp_path, resume_round=6)
    assert reader.resumed_state("w#2/4", (3, 4))["key"] == "w#2/4"            # its own file: as saved
    for part in _cut(80):
        entry = reader.resumed_state(part.key, part.shape)
        np.testing.assert_array_equal(entry["value"], _state_of(part)["param"])
        np.testing.assert_array_equal(entry["update"]["optimizer"]["state"][0]["exp_avg"],
                                      _state_of(part)["optimizer"]["state"][0]["exp_avg"])
        assert reader.rounds[part.key] == 6
    more_servers = ServerCheckpoints(rank=2, every=3, directory=None, resume_from=tmp_path, resume_round=6)
    np.testing.assert_array_equal(more_servers.resumed_state("w#3/4", (1, 4))["value"], WHOLE["param"][9:])
    whole = reader.resumed_state("w", SHAPE)
    np.testing.assert_array_equal(whole["value"], WHOLE["param"])
    with pytest.raises(ConfigError, match=r"key 'v' is not in the global servers' checkpoint of round 6"):
        reader.resumed_state("v", (math.prod(SHAPE),))
