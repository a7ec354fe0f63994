"""The end-to-end demo passes its own bitwise checks (real processes, real files)."""
import contextlib
import io

from shardpoint.demo import run_demo


def test_demo_round_trips_bitwise(tmp_path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run_demo(str(tmp_path))
    text = out.getvalue()
    assert rc == 0, text
    assert text.count("bitwise equal") == 2 and "verify --strict: OK" in text
    assert "replicas written once" in text and "1.000x" in text
