"""Generated from proto/atmost/v1/*.proto by clients/python/generate_stubs.py.

Do not edit: run the generator (tests/test_stubs.py fails when these files
differ from what it makes).
"""
