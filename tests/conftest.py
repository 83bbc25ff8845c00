import importlib.util

# The cluster harness needs the `test` extra (cryptography for its certificates); the GPU machine
# has only torch and transformers and runs tests/gpu without it.
pytest_plugins = ["tests.cluster.plugin"] if importlib.util.find_spec("cryptography") else []
