"""The end-to-end demo, as a newcomer runs it: real processes, real files, bitwise checks that
pass on a sound checkpoint and fail on a doctored one."""
import os
import subprocess
import sys

import numpy as np
import tensorstore as ts

from shardpoint.demo import _load_full
from shardpoint.verify import verify_checkpoint


def test_demo_round_trips_bitwise_and_its_checks_can_fail(tmp_path):
    r = subprocess.run([sys.executable, "-m", "shardpoint.cli", "demo", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert text.count("bitwise equal") == 2 and "MISMATCH" not in text, text
    assert "verify --strict: OK" in text and "demo: PASSED" in text
    assert "1.000x: replicas written once" in text          # bytes written == unique bytes
    assert "exchanged" in text and "timings:" in text
    path = tmp_path / "step_1234"
    assert (path / "manifest.msgpack").is_file()             # --dir keeps the checkpoint

    # Change one element through TensorStore (checksums stay valid): verify cannot see it,
    # the demo's bitwise comparison must.
    assert _load_full(str(path))["bad"] == []
    arr = ts.open({"driver": "zarr3", "kvstore": {
        "driver": "file", "path": os.path.join(path, "tensors/optim/exp_avg/embed.weight")}},
        open=True).result()
    v = arr[5, 7].read().result()
    arr[5, 7].write(np.float32(v + 1)).result()
    assert verify_checkpoint(str(path), strict=True).ok
    assert _load_full(str(path))["bad"] == ["optim/exp_avg/embed.weight"]
