"""Helpers the tests share: checkpoint writers, servers and proxies to test against, and the
fixture modules tests/conftest.py registers as plugins."""
