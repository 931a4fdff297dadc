"""The test session's fixtures come from tests/support, registered here as plugins: test modules
import plain helpers from ``tests.support.X`` and never from this file."""

pytest_plugins = [
    "tests.support.environment",  # autouse: the process environment and the cache directory
    "tests.support.model_root",  # model_root, model_id, server
    "tests.support.references",  # reference
    "tests.support.s3_server",  # s3_server
]
