"""The README's S3 example runs as written against the local S3 server (the bucket name is
the only change), in a fresh process that finds the server through the AWS environment."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(ROOT, "README.md")).read()


def test_readme_s3_example_runs(s3_env, tmp_path):
    section = README.split("## Object stores (S3)", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    assert len(block.strip().splitlines()) <= 6 and "s3://my-bucket/" in block
    prefix = s3_env.fresh_prefix("readme")
    code = block.replace("s3://my-bucket/", f"s3://{s3_env.bucket}/{prefix}/")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, stdin=subprocess.DEVNULL, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    keys = [o["Key"] for o in s3_env.client().list_objects_v2(
        Bucket=s3_env.bucket, Prefix=prefix)["Contents"]]
    assert f"{prefix}/run/step_7/manifest.msgpack" in keys
    assert os.listdir(tmp_path) == []                       # nothing written locally
