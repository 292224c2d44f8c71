"""The order a step's gradients cross a congested link in (geomx.sync.wire_order): P3's tail-first priorities and
the share of the bytes its tail holds, measured from the pace of the replies. Why FSA sends the last layers
first, on the emulator's strict-priority link: tests/test_netem.py
(test_in_backward_order_uploads_finish_while_backward_still_makes_gradients_and_at_minus_index_none_does)."""
import pytest

import numpy as np

from geomx.errors import ConfigError
from geomx.sync.wire_order import (CUT_STEPS, MIN_LANDINGS, SMOOTHING, TAIL_MARGIN, TailFirst, backward_order,
                                   check_tail_fraction, tail_first_priorities, uploadable_share)


def test_fsas_order_puts_the_last_layers_highest_and_every_gradient_below_control_messages():
    assert backward_order(4) == [-4, -3, -2, -1]
    assert backward_order(0) == []


def test_the_last_layers_holding_the_tails_share_keep_the_backward_order_and_the_rest_go_below_first_first():
    sizes = [400, 200, 60, 60, 60, 60, 60, 100]  # 1,000 bytes; the last six hold 400
    assert tail_first_priorities(sizes, 0.4) == [-9, -10, -6, -5, -4, -3, -2, -1]
    # a layer that would take the tail past its share stays out of it
    assert tail_first_priorities(sizes, 0.39) == [-9, -10, -11, -5, -4, -3, -2, -1]
    # every tail layer outranks every other, the last highest; among the rest the first layers go first
    prio = tail_first_priorities(sizes, 0.4)
    assert min(prio[2:]) > max(prio[:2]) and prio[7] > prio[6] > prio[2] and prio[0] > prio[1]


def test_the_margins_hedge_adds_small_layers_past_the_estimate_but_no_layer_bigger_than_itself():
    # a share of 0.875 is an estimate of 0.7 and a hedge of 0.175 (TAIL_MARGIN 1.25)
    assert TAIL_MARGIN == 1.25
    # VGG's shape: a first fully connected layer of 78% of the bytes ends at 0.85, inside the share but past the
    # estimate, by more than the hedge: in the tail, every convolution's gradient would wait behind it
    vgg = [50, 50, 50, 780, 60, 10]
    assert tail_first_priorities(vgg, 0.875) == [-7, -8, -9, -10, -2, -1]
    # the same layer ending inside the estimate is taken, however big
    assert tail_first_priorities([300, 600, 50, 50], 0.875) == [-5, -3, -2, -1]
    # small layers past the estimate are the hedge's to take: 60 bytes each, a hedge of 80
    assert tail_first_priorities([400, 200, 60, 60, 60, 60, 60, 100], 0.4)[2:] == backward_order(8)[2:]


def test_a_whole_tail_is_fsas_order_and_no_tail_is_first_layers_first():
    sizes = [10, 20, 30]
    assert tail_first_priorities(sizes, 1.0) == backward_order(3)
    assert tail_first_priorities(sizes, 0.0) == [-4, -5, -6]


def test_the_uploadable_share_is_the_pace_of_the_replies_after_backward_times_the_backward_pass():
    # replies of 100 kB every 0.02 s: 5 MB/s; a backward pass of 0.3 s moves 1.5 MB of a 4 MB model
    landings = [(10.0 + 0.02 * k, 100_000) for k in range(10)]
    assert uploadable_share(backward_s=0.3, landings=landings, total_bytes=4_000_000) == pytest.approx(0.375)
    # a link faster than the model needs carries it all
    assert uploadable_share(backward_s=3.0, landings=landings, total_bytes=4_000_000) == 1.0


def test_too_few_replies_after_backward_mean_the_link_kept_up_with_it():
    few = [(1.0, 100_000), (1.01, 100_000)][:MIN_LANDINGS - 1]
    assert uploadable_share(backward_s=0.3, landings=few, total_bytes=4_000_000) == 1.0
    assert uploadable_share(backward_s=0.3, landings=[], total_bytes=4_000_000) == 1.0


def _step(order: TailFirst, start: float, *, backward_s: float, replies_after: list[tuple[float, int]]) -> None:
    """One step as P3 drives its order: pushes over the backward pass, its end, then the replies landing."""
    n = len(order.sizes)
    for k, i in enumerate(reversed(range(n))):           # backward makes the last layers first
        order.begin_push(i, start + backward_s * k / n)
    order.end_backward(start + backward_s)
    for t, i in replies_after:
        order.landed(i, t)


def test_the_tail_starts_whole_then_moves_halfway_to_a_quarter_above_each_steps_estimate():
    sizes = [100_000] * 40                                # 4 MB
    order = TailFirst(sizes)
    assert order.tail_fraction == 1.0
    assert [order.begin_push(i, 0.0) for i in range(40)] == backward_order(40)      # FSA's order at first
    order.end_backward(0.3)
    start = 1.0
    for _ in range(3):
        # 20 replies after backward, one every 0.02 s (5 MB/s): the uplink moves 1.5 MB of 4 in a 0.3 s pass
        _step(order, start, backward_s=0.3,
              replies_after=[(start + 0.35 + 0.02 * k, i) for k, i in enumerate(range(20))])
        start += 1.0
    order.begin_push(39, start)                           # the next step's first push reads the last step
    target = TAIL_MARGIN * 0.375
    expected = 1.0
    for _ in range(3):
        expected += SMOOTHING * (target - expected)
    assert order.tail_fraction == pytest.approx(expected, rel=1e-6)
    in_tail = [i for i in range(40) if order.begin_push(i, start) == i - 40]
    cut = round(expected * CUT_STEPS) / CUT_STEPS          # the cut moves in sixteenths of the bytes
    assert in_tail == list(range(40 - int(cut * 40 + 1e-9), 40))


def test_replies_that_landed_during_backward_do_not_count_toward_the_pace():
    order = TailFirst([100_000] * 10)
    order.end_backward(0.3)
    # the tail's replies land while backward runs (before 1.3); only the three after it give the pace
    _step(order, 1.0, backward_s=0.3, replies_after=[(1.1, 9), (1.2, 8), (1.31, 0), (1.33, 1), (1.35, 2)])
    order.begin_push(9, 2.0)
    share = uploadable_share(backward_s=0.3, landings=[(1.31, 100_000), (1.33, 100_000), (1.35, 100_000)],
                             total_bytes=1_000_000)
    assert order.tail_fraction == pytest.approx(1.0 + SMOOTHING * (min(1.0, TAIL_MARGIN * share) - 1.0))


def test_a_big_parameters_parts_count_toward_the_pace_as_each_lands_not_all_at_its_last():
    # an 800 kB parameter in 8 parts: six land during backward (it ends at 1.1), two after it, then a 100 kB reply
    order = TailFirst([800_000, 100_000, 100_000])
    order.end_backward(0.3)
    _step(order, 1.0, backward_s=0.1, replies_after=[])
    for t in (1.02, 1.03, 1.05, 1.06, 1.08, 1.09, 1.12, 1.14):
        order.landed(0, t, share=1 / 8)
    order.landed(1, 1.16)
    order.begin_push(2, 2.0)
    share = uploadable_share(backward_s=0.1, landings=[(1.12, 100_000), (1.14, 100_000), (1.16, 100_000)],
                             total_bytes=1_000_000)
    assert share == pytest.approx(0.5)          # the link's 5 MB/s for 0.1 s; the whole 800 kB at 1.14 read 1.0
    assert order.tail_fraction == pytest.approx(1.0 + SMOOTHING * (TAIL_MARGIN * share - 1.0))


def test_workers_whose_estimates_differ_a_little_cut_the_tail_alike():
    sizes = [100_000] * 32
    a, b = TailFirst(sizes, tail_fraction=0.49), TailFirst(sizes, tail_fraction=0.52)
    assert [a.begin_push(i, 0.0) for i in range(32)] == [b.begin_push(i, 0.0) for i in range(32)]


def test_a_parameter_step_pushes_without_a_gradient_goes_below_the_tail_and_such_a_step_leaves_the_share():
    order = TailFirst([100_000] * 10, tail_fraction=0.5)
    assert order.begin_push(9, 1.0, from_backward=False) == tail_first_priorities(order.sizes, 0.0)[9] == -20
    order.end_backward(1.0)                          # a step with no backward push: no pass to measure
    for k in range(5):
        order.landed(k, 1.5 + 0.01 * k)
    order.begin_push(9, 2.0)
    assert order.tail_fraction == 0.5


def test_a_frozen_parameter_counts_no_bytes_toward_the_tail():
    # sizes 0 for frozen parameters: a tail of half the bytes (the estimate, times the margin) is the last
    # trainable layer and the frozen one, not the first layer
    assert tail_first_priorities([100, 0, 100], 0.5 * TAIL_MARGIN) == [-4, -2, -1]


@pytest.mark.parametrize("value", [True, float("nan"), 1.5, -0.1, "0.5", None])
def test_a_saved_tail_share_that_is_not_a_number_in_zero_to_one_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match=r"tail_fraction must be a share of the bytes in \[0, 1\], got"):
        check_tail_fraction(value)


def test_a_saved_tail_share_of_any_real_type_is_taken():
    assert check_tail_fraction(np.float32(0.25)) == 0.25 and check_tail_fraction(1) == 1.0
