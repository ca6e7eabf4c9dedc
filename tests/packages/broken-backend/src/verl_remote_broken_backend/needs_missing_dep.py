import verl_remote_no_such_dependency  # noqa: F401  (not installed, on purpose)

SPEC = None
