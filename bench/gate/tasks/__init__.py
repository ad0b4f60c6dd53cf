"""The shipped gate tasks: one module each, with a module-level ``TASK`` (task.py). Their
``dims`` are the small tier: Pallas' interpreter on a CPU checks a candidate in seconds."""
