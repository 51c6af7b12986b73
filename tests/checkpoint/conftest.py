import pytest

from tests.helpers.runs import losses, run


def pytest_collection_modifyitems(items):
    # trainer.checkpoint silences DCP's one-process warning at import; pytest resets filters per test
    for item in items:
        if "tests/checkpoint/" in str(item.path):
            item.add_marker(pytest.mark.filterwarnings("ignore:torch.distributed is disabled"))


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """The reference: six steps in one job."""
    out = tmp_path_factory.mktemp("straight")
    run(out)
    return out, losses(out)
