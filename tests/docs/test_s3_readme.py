"""The README's object-store examples run as written against the local servers (the bucket
name is the only change), each in a fresh process that finds its server through the standard
environment: the S3 save/load and manager examples on moto, the gs:// one on the GCS
emulator."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(ROOT, "README.md")).read()
SECTION = README.split("## Object stores (S3)", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```python\n(.*?)```", SECTION, re.S)


def run(code, cwd):
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                       text=True, timeout=300, stdin=subprocess.DEVNULL, env=os.environ.copy())
    assert r.returncode == 0, r.stderr


def test_every_block_of_the_section_is_run_here():
    assert len(BLOCKS) == 3
    assert all(len(b.strip().splitlines()) <= 6 for b in BLOCKS)


@pytest.mark.parametrize("which", [0, 1])
def test_readme_s3_examples_run(s3_env, tmp_path, which):
    pytest.importorskip("boto3")
    block = BLOCKS[which]
    assert "s3://my-bucket/" in block
    prefix = s3_env.fresh_prefix("readme")
    run(block.replace("s3://my-bucket/", f"s3://{s3_env.bucket}/{prefix}/"), tmp_path)
    keys = [o["Key"] for o in s3_env.client().list_objects_v2(
        Bucket=s3_env.bucket, Prefix=prefix)["Contents"]]
    want = "run/step_7" if which == 0 else "run/step_00000003"
    assert f"{prefix}/{want}/manifest.msgpack" in keys
    assert not any("step_00000001" in k for k in keys)       # retention removed step 1
    assert os.listdir(tmp_path) == []                       # nothing written locally


def test_readme_gcs_example_runs(gcs_env, tmp_path):
    block = BLOCKS[2]
    assert "gs://my-bucket/" in block
    prefix = gcs_env.fresh_prefix("readme")
    run(block.replace("gs://my-bucket/", f"gs://{gcs_env.bucket}/{prefix}/"), tmp_path)
    from shardpoint_core.store.gcs import GcsStore
    assert GcsStore.from_url(gcs_env.url(prefix)).head("run/step_1/manifest.msgpack")
    assert os.listdir(tmp_path) == []
