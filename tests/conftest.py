"""Shared test setup: the ``--runslow`` option for long property runs and big cases."""
import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (long property runs, big worlds)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tmp_ckpt(tmp_path):
    """A checkpoint path that does not exist yet, inside a fresh temporary directory."""
    return str(tmp_path / "ckpt")
