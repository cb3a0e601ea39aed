"""Run weft's gate and test suite on Modal GPUs, from a machine without one.

preflight: what is checked before any network call; app: the Modal app; worker: what its
functions do in the container; fanout: a container per test case; pytest_plugin and session:
`pytest --modal`; cli: `main.py --modal` and `main.py --collect`.
"""
