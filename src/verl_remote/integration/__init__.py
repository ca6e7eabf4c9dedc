"""The seams into verl: the plugin verl imports in every process (:mod:`.verl_plugin`, :mod:`.verl_hooks`), the
trainer and TaskRunner (:mod:`.trainer`), the CPU-only forwarder workers (:mod:`.worker`) and the rollout replica
(:mod:`.rollout`) every backend subclasses, and what a run needs around them (checkpoint records, the cluster's
paths, the watchdog that ends a run's leftovers)."""
