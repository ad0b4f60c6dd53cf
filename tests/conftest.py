"""The suite's options and fixtures (--backend, Hypothesis profiles, ``backend``,
``examples``) come from pallascheck's pytest plugin (properties/pytest_plugin.py)."""
