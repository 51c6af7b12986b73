import pytest

from runs import losses, run


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """The reference: six steps in one job."""
    out = tmp_path_factory.mktemp("straight")
    run(out)
    return out, losses(out)
