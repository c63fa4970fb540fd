"""A wrong answer gets a hint, not the answer."""

from gaccum_course.exercises import check


def test_the_00_2_hint_does_not_give_the_factor_away():
    right = check("00.2", 4, quiet=True)
    assert right and "4x larger" in right.message
    for wrong in (2, 3, 8):
        hint = check("00.2", wrong, quiet=True)
        assert not hint and hint.message.startswith("not quite")
        assert "4x" not in hint.message and "4.0x" not in hint.message and "larger" not in hint.message
