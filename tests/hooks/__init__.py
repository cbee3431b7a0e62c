"""Test hook modules (:mod:`pagedkv.runtime.test_hooks`): a test installs one into a service process with
``PAGEDKV_TEST_HOOKS=tests.hooks.<name>`` in the process's environment (its working folder the
repository root, or the root on its ``PYTHONPATH``), or into its own process with
``pagedkv.runtime.test_hooks.installed("tests.hooks.<name>")``. Each reads its parameters from environment
variables of its own, read at each call.
"""
