"""The chapters' kind for pytest: nbval's cells of notebooks/*.ipynb are marked `notebook`. Here, as
`pytest notebooks --nbval` (make test's second run) does not load tests/conftest.py, which gives
every other test its kind."""


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker("notebook")
