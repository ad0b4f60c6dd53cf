"""Mutation testing of a kernel's checks (``pallascheck mutate``).

``operators`` finds single-point, kernel-aware mutants in a kernel module's source
(libcst); ``worker`` loads one mutant in a fuzz worker process (its own copy of the
module, that process only) and runs the spec's checks on it; ``run`` schedules the
baseline and the mutants over the workers and classifies each mutant; ``command``
is the subcommand and its report.
"""
