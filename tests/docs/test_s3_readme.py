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


def test_readme_object_store_examples_run(s3_env, gcs_env, tmp_path):
    """The three blocks in one fresh process (one torch import): S3 on moto, gs:// on the
    emulator; each bucket name is the only change."""
    pytest.importorskip("boto3")
    assert "s3://my-bucket/" in BLOCKS[0] and "s3://my-bucket/" in BLOCKS[1]
    assert "gs://my-bucket/" in BLOCKS[2]
    s3p, gsp = s3_env.fresh_prefix("readme"), gcs_env.fresh_prefix("readme")
    code = "\n".join(b.replace("s3://my-bucket/", f"s3://{s3_env.bucket}/{s3p}/{i}/")
                     for i, b in enumerate(BLOCKS[:2]))      # each block a bucket of its own
    code += "\n" + BLOCKS[2].replace("gs://my-bucket/", f"gs://{gcs_env.bucket}/{gsp}/")
    run(code, tmp_path)
    keys = [o["Key"] for o in s3_env.client().list_objects_v2(
        Bucket=s3_env.bucket, Prefix=s3p)["Contents"]]
    assert f"{s3p}/0/run/step_7/manifest.msgpack" in keys
    assert f"{s3p}/1/run/step_00000003/manifest.msgpack" in keys
    assert not any("step_00000001" in k for k in keys)       # retention removed step 1
    from shardpoint_core.store.gcs import GcsStore
    assert GcsStore.from_url(gcs_env.url(gsp)).head("run/step_1/manifest.msgpack")
    assert os.listdir(tmp_path) == []                        # nothing written locally
