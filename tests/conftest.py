"""Fixtures live in tests/fixtures/<area>.py and are registered here, so every test file sees them."""

pytest_plugins = [
    "fixtures.data",
    "fixtures.models",
    "fixtures.store",
    "fixtures.service",
    "fixtures.s3",
]
