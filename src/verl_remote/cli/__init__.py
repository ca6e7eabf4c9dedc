"""The ``verl-remote`` command (:mod:`.main`) and the driver of a run (:mod:`.run`): checks before Ray starts
(:mod:`.preflight`), the console (:mod:`.console`), ``doctor`` and the one-line diagnoses of failures."""
