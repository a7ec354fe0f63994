"""The progress bar's ``advance`` and ``set_total`` draw bytes done of the total, or nothing."""

from shardpoint.tools import progress


def test_bar_draws_bytes_done_of_the_total_set_later(capsys):
    with progress.bar("verify", None, True) as adv:
        adv.set_total(4 << 20)  # the total becomes known once the source is open
        adv(1 << 20)
        adv(1 << 20)
    err = capsys.readouterr().err
    assert "verify" in err and "2.0/4.0 MiB" in err


def test_disabled_bar_draws_nothing(capsys):
    with progress.bar("verify", None, False) as adv:
        adv.set_total(4 << 20)
        adv(1 << 20)
    assert capsys.readouterr() == ("", "")
