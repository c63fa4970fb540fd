"""A wrong answer gets a hint, not the answer."""

from gaccum_course.exercises import check


def test_the_00_2_hint_does_not_give_the_factor_away():
    right = check("00.2", 4, quiet=True)
    assert right and "4x larger" in right.message
    for wrong in (2, 3, 8):
        hint = check("00.2", wrong, quiet=True)
        assert not hint and hint.message.startswith("not quite")
        assert "4x" not in hint.message and "4.0x" not in hint.message and "larger" not in hint.message


def test_the_01_1_hint_points_at_the_learning_rate_not_the_call():
    for wrong in (9.2622, 2.04):  # 9.2622: simulate's default learning rate, 0.08
        hint = check("01.1", wrong, quiet=True)
        assert not hint and "learning rate" in hint.message and "2.3156" not in hint.message
        assert "grad_accum_steps=3" not in hint.message


def test_the_02_2_factor_rounded_to_two_decimals_is_close_not_correct():
    assert not check("02.2", 1.33, quiet=True)
    assert check("02.2", 1.33, quiet=True).message.startswith("close")
    assert check("02.2", 1.3333, quiet=True) and check("02.2", 4 / 3, quiet=True)
