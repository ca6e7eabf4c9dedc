"""Finding what is installed, in any process: backends through the ``verl.remote_backends`` entry points
(:mod:`.registry`, the registry API), their Hydra config groups (:mod:`.search_path`), the run's composed config
(:mod:`.compose`) and the verl it runs on (:mod:`.compat`). Imports nothing of verl's at module level."""
